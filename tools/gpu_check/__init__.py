"""The GPU compile gate: every Triton kernel variant the launchers can choose on CUDA, compiled
ahead of time for real GPU targets (sm_80, sm_90) without a GPU, with its resource usage checked.

    python -m tools.gpu_check            # what `make check-gpu` runs
    python -m tools.gpu_check --all      # the full sweep (`make check-gpu-all`)

The variants come from the launchers themselves: ``cases`` drives each op's Triton launchers on
the simulated CUDA device (``tools.cuda_sim``, an H100), where a first call tries every candidate
tile, so every launch they would issue on a GPU (kernel, grid, arguments, constexprs, and every
config of an autotuned kernel) is recorded instead of run. ``compile`` binds each launch as Triton's JIT would (same specialisation of
integers and pointer alignment), compiles it for each target and reads registers, spills and
shared memory from the cubin; ``int_range`` checks the kernel's integer index arithmetic for int32
overflow at the launch's real sizes; ``report`` gates and writes JSON and markdown.
"""
