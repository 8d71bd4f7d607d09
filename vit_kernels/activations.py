"""The activation vocabulary, in one place, and the PyTorch form of each GELU.

Two spellings are in use, each where its readers expect it:

* ``approximate`` -- ``"none"`` | ``"tanh"`` | ``"quick"`` (``GELU_APPROXIMATIONS``): the GELU argument
  of the functional ops (``vk.linear_gelu``, ``vk.mlp``); the first two are PyTorch's own words from
  ``F.gelu``, ``"quick"`` is the sigmoid form of CLIP-style models (QuickGELU).
* ``act`` -- ``"gelu"`` | ``"gelu_tanh"`` | ``"quick_gelu"`` | ``"relu"`` (``ACTIVATIONS``): the activation
  of the layers (``vit_kernels.nn``), of ``vit.ViTConfig`` and of the layers the integrations recognise.
  The Triton ops ``vit_kernels::linear_fwd`` / ``mlp_fwd`` take the GELU names of this spelling, or
  ``"none"`` for no activation.

``gelu_act`` and ``gelu_approximate`` translate between the two; ``GELU_FORMS`` numbers the GELUs for
the kernels. ``gelu`` and ``gelu_backward`` are the PyTorch computations of every form.

    gelu(z)       = z * Phi(z)                                         "none" (exact, with erf)
    gelu_tanh(z)  = 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))    "tanh"
    quick_gelu(z) = z * sigmoid(1.702 z)                               "quick"
        quick_gelu'(z) = s + 1.702 z s (1 - s),  s = sigmoid(1.702 z)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

GELU = "gelu"
GELU_TANH = "gelu_tanh"
QUICK_GELU = "quick_gelu"
RELU = "relu"
NONE = "none"  # no activation (an epilogue of the Triton linear kernel)

ACTIVATIONS = (GELU, GELU_TANH, QUICK_GELU, RELU)
GELU_APPROXIMATIONS = ("none", "tanh", "quick")
# The kernels' number for each GELU (the GELU_FORM constexpr of the Triton epilogues, the kForm
# template argument of the extension's bias_gelu).
GELU_FORMS = {GELU: 0, GELU_TANH: 1, QUICK_GELU: 2}
QUICK_GELU_SLOPE = 1.702

_ACT_BY_APPROXIMATE = {"none": GELU, "tanh": GELU_TANH, "quick": QUICK_GELU}
_APPROXIMATE_BY_ACT = {act: approximate for approximate, act in _ACT_BY_APPROXIMATE.items()}


def gelu_act(approximate: str) -> Optional[str]:
    """The activation name of a GELU approximation: ``"none"`` -> ``"gelu"``, ``"tanh"`` ->
    ``"gelu_tanh"``, ``"quick"`` -> ``"quick_gelu"``; None for anything else."""
    return _ACT_BY_APPROXIMATE.get(approximate)


def gelu_approximate(act: str) -> Optional[str]:
    """The ``approximate`` argument of a GELU activation name: ``"gelu"`` -> ``"none"``,
    ``"gelu_tanh"`` -> ``"tanh"``, ``"quick_gelu"`` -> ``"quick"``; None for an activation that is not
    a GELU (``"relu"``)."""
    return _APPROXIMATE_BY_ACT.get(act)


def gelu(z: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """The GELU of ``approximate`` on z (any shape), by PyTorch: ``F.gelu``, or z * sigmoid(1.702 z)."""
    if approximate == "quick":
        return z * torch.sigmoid(QUICK_GELU_SLOPE * z)
    return F.gelu(z, approximate=approximate)


def gelu_backward(grad: torch.Tensor, z: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """grad * gelu'(z) (z's shape) for the GELU of ``approximate``, by PyTorch."""
    if approximate == "quick":
        s = torch.sigmoid(QUICK_GELU_SLOPE * z)
        return grad * (s + QUICK_GELU_SLOPE * z * s * (1 - s))
    return torch.ops.aten.gelu_backward(grad, z, approximate=approximate)
