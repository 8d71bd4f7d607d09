"""The op specs (``vit_kernels.ops.specs``) under the name the benchmarks import them by: the A/B
harness (``benchmarks.trees.copy_harness``) puts its own copy of the specs here, so that a tree from
before they moved into the package is timed on the same inputs."""

from vit_kernels.ops.specs import KERNELS, LAYER_NORM_EPS, OPS, SPECS, OpSpec, Shape, attention_extras

__all__ = ["KERNELS", "LAYER_NORM_EPS", "OPS", "SPECS", "OpSpec", "Shape", "attention_extras"]
