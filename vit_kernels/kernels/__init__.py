"""The @triton.jit kernels, one module per op family; the host code that launches them is in
``vit_kernels.ops``."""
