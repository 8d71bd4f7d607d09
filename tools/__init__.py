"""Build- and test-time tooling, outside the runtime package: the simulated CUDA device (``cuda_sim``)
and the GPU compile gate (``gpu_check``)."""
