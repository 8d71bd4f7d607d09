"""The activation vocabulary, in one place.

Two spellings are in use, each where its readers expect it:

* ``approximate`` -- ``"none"`` | ``"tanh"`` (``GELU_APPROXIMATIONS``): the GELU argument of the
  functional ops (``vk.linear_gelu``, ``vk.mlp``), PyTorch's own words from ``F.gelu``.
* ``act`` -- ``"gelu"`` | ``"gelu_tanh"`` | ``"relu"`` (``ACTIVATIONS``): the activation of the
  layers (``vit_kernels.nn``), of ``vit.ViTConfig`` and of the layers the integrations recognise.
  The Triton ops ``vit_kernels::linear_fwd`` / ``mlp_fwd`` take the GELU names of this spelling, or
  ``"none"`` for no activation (``KERNEL_ACTIVATIONS``).

``gelu_act`` and ``gelu_approximate`` translate between the two.
"""

from __future__ import annotations

from typing import Optional

GELU = "gelu"  # exact GELU: z * Phi(z), with the error function
GELU_TANH = "gelu_tanh"  # 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))
RELU = "relu"
NONE = "none"  # no activation (an epilogue of the Triton linear kernel)

ACTIVATIONS = (GELU, GELU_TANH, RELU)
KERNEL_ACTIVATIONS = (NONE, GELU, GELU_TANH)
GELU_APPROXIMATIONS = ("none", "tanh")

_ACT_BY_APPROXIMATE = {"none": GELU, "tanh": GELU_TANH}
_APPROXIMATE_BY_ACT = {act: approximate for approximate, act in _ACT_BY_APPROXIMATE.items()}


def gelu_act(approximate: str) -> Optional[str]:
    """The activation name of a GELU approximation: ``"none"`` -> ``"gelu"``, ``"tanh"`` ->
    ``"gelu_tanh"``; None for anything else."""
    return _ACT_BY_APPROXIMATE.get(approximate)


def gelu_approximate(act: str) -> Optional[str]:
    """The ``approximate`` argument of a GELU activation name: ``"gelu"`` -> ``"none"``,
    ``"gelu_tanh"`` -> ``"tanh"``; None for an activation that is not a GELU (``"relu"``)."""
    return _APPROXIMATE_BY_ACT.get(act)
