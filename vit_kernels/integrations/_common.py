"""What every adapter shares: naming classes without importing their library, the checks that a
layer holds nothing we do not understand, activation names, and swapping a module's class for a
subclass with a fused ``forward`` (which keeps every parameter, buffer, attribute and method)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import vit_kernels.functional as vkf
from vit_kernels.activations import GELU, GELU_TANH, QUICK_GELU, RELU, gelu_act
from vit_kernels.ops.attention_reference import mask_broadcasts


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class, e.g. ``timm.layers.attention.Attention``."""
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class Swap:
    """A rule's verdict on one module: ``new`` replaces it (``new is module`` when only its class
    changed), or ``reason`` says why it stays; ``descend`` visits its children afterwards."""

    new: Optional[nn.Module] = None
    reason: str = ""
    descend: bool = False

    @classmethod
    def skip(cls, reason: str) -> "Swap":
        return cls(None, reason, descend=True)


# A rule takes the module and returns a Swap.
Rule = Callable[[nn.Module], Swap]


def own_tensors(module: nn.Module) -> list[str]:
    """Names of the parameters and buffers held directly by ``module`` (not by its children)."""
    return [n for n, t in list(module._parameters.items()) + list(module._buffers.items()) if t is not None]


def unknown_parts(module: nn.Module, children: Iterable[str], tensors: Iterable[str] = ()) -> Optional[str]:
    """Why ``module`` holds more than the named children and own tensors, or None."""
    extra_children = sorted(set(dict(module.named_children())) - set(children))
    extra_tensors = sorted(set(own_tensors(module)) - set(tensors))
    parts = []
    if extra_children:
        parts.append(f"submodules {extra_children}")
    if extra_tensors:
        parts.append(f"parameters/buffers {extra_tensors}")
    return f"has {' and '.join(parts)} the fused layer does not compute" if parts else None


def unknown_forward_args(module: nn.Module, accepted: Iterable[str]) -> Optional[str]:
    """Why the original ``forward`` takes arguments the replacement does not, or None."""
    params = inspect.signature(type(module).forward).parameters
    names = [n for n, p in params.items() if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    extra = sorted(set(names) - set(accepted))
    return f"forward takes argument(s) {extra} the fused layer does not understand" if extra else None


def dropout_p(module: Optional[nn.Module]) -> Optional[float]:
    """The rate of an ``nn.Dropout``, 0 for Identity/None, None for anything else."""
    if module is None or isinstance(module, nn.Identity):
        return 0.0
    if type(module) is nn.Dropout:
        return float(module.p)
    return None


def fusable_mask(mask: object, device: torch.device, batch: int, num_heads: int, length: int) -> bool:
    """Whether ``vk.attention`` takes ``mask`` (None, or SDPA's boolean or additive mask) for a
    self-attention of ``batch`` x ``num_heads`` x ``length`` tokens on ``device``: a tensor there that
    broadcasts to (B, H, L, L). Anything else runs the layer's own forward."""
    if mask is None:
        return True
    if not isinstance(mask, torch.Tensor) or not (mask.dtype == torch.bool or mask.is_floating_point()):
        return False
    return mask_broadcasts(mask, batch, num_heads, length) and mask.device == device


def is_identity(module: object) -> bool:
    return module is None or type(module) is nn.Identity


# Activation classes of other libraries by what they compute.
_ACTIVATION_CLASSES = {
    "timm.layers.activations.GELU": GELU,
    "timm.layers.activations.GELUTanh": GELU_TANH,
    "transformers.activations.PytorchGELUTanh": GELU_TANH,
    "transformers.activations.GELUTanh": GELU_TANH,
    "transformers.activations.NewGELUActivation": GELU_TANH,
    "timm.layers.activations.QuickGELU": QUICK_GELU,
    "transformers.activations.QuickGELUActivation": QUICK_GELU,
    "open_clip.transformer.QuickGELU": QUICK_GELU,
}


def activation_name(act: object) -> Optional[str]:
    """The name in ``vit_kernels.activations.ACTIVATIONS`` ('gelu', 'gelu_tanh', 'quick_gelu' or 'relu')
    of an activation module or function computing exactly that, else None."""
    if type(act) is nn.GELU:
        return gelu_act(act.approximate)
    if type(act) is nn.ReLU:
        return RELU
    if act in (F.relu, F.gelu):
        return RELU if act is F.relu else GELU
    name = qualified_name(type(act))
    if name == "transformers.activations.GELUActivation":
        return GELU if getattr(act, "act", None) is F.gelu else None
    return _ACTIVATION_CLASSES.get(name)


def is_silu(act: object) -> bool:
    """Whether an activation module or function computes silu(z) = z * sigmoid(z)."""
    return (
        type(act) is nn.SiLU
        or act is F.silu
        or qualified_name(type(act)) == "transformers.activations.SiLUActivation"
    )


def swiglu_forward(
    module: nn.Module,
    x,
    gate: tuple,
    up: tuple,
    norm: Optional[nn.Module],
    drop1: Optional[nn.Module],
    down: nn.Linear,
    drop2: Optional[nn.Module],
    residual: Optional[torch.Tensor] = None,
    layer_scale: Optional[torch.Tensor] = None,
):
    """down(drop2 . norm . drop1 (silu(x W_g^T + b_g) * (x W_u^T + b_u))) on the fused ops, each
    optional part the module's own (its dropout draws the same masks): one ``vk.swiglu_mlp`` call
    where no norm and no active dropout sit between the gating and the down projection.
    ``gate``, ``up``: (weight (Hd, D), bias (Hd,) or None); x (..., D) -> (..., D_out); with
    ``residual`` (..., D_out) [and ``layer_scale`` gamma (D_out,)]: residual + gamma * that (a block's
    add), in the down projection's GEMM."""
    dropping = module.training and any(dropout_p(d) != 0.0 for d in (drop1, drop2))
    if is_identity(norm) and not dropping:
        return vkf.swiglu_mlp(
            x, *gate, *up, down.weight, down.bias, residual=residual, layer_scale=layer_scale
        )
    hidden = vkf.swiglu(x, *gate, *up)
    for part in (drop1, norm):
        hidden = hidden if part is None else part(hidden)
    return project(down, drop2, hidden, residual, layer_scale)


def project(
    linear: nn.Linear,
    drop: Optional[nn.Module],
    h: torch.Tensor,
    residual: Optional[torch.Tensor] = None,
    layer_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """drop(linear(h)), then residual + gamma * that where ``residual`` is given: the add and the
    scale in the GEMM's epilogue unless the dropout is dropping (then added after it, as the module does)."""
    if residual is not None and (drop is None or not drop.training or dropout_p(drop) == 0.0):
        return vkf.linear(h, linear.weight, linear.bias, residual=residual, layer_scale=layer_scale)
    out = vkf.linear(h, linear.weight, linear.bias, layer_scale=layer_scale)
    out = out if drop is None else drop(out)
    return out if residual is None else residual + out


def describe_activation(act: object) -> str:
    return getattr(act, "__name__", None) or type(act).__name__


def mlp_activation_problem(act: object) -> Optional[str]:
    """Why ``vit_kernels.nn.Mlp`` does not compute an MLP's activation ``act`` (``activation_name``
    names none), or None."""
    if activation_name(act) is None:
        return f"activation {describe_activation(act)} is not one of GELU, GELU(tanh), QuickGELU, ReLU"
    return None


def patch_projection_problem(proj: object, unpadded: tuple = ((0, 0),)) -> Optional[str]:
    """Why a patch embedding's projection ``proj`` is not what ``vk.patch_embed`` computes, or None:
    it must be a square ``nn.Conv2d`` with stride == kernel, without dilation or groups, whose
    ``padding`` is one of ``unpadded`` (the settings that pad nothing, as the library spells them)."""
    if (
        type(proj) is not nn.Conv2d
        or proj.kernel_size != proj.stride
        or proj.kernel_size[0] != proj.kernel_size[1]
    ):
        return "projection is not a square Conv2d with stride == kernel"
    if proj.padding not in unpadded or proj.dilation != (1, 1) or proj.groups != 1:
        return "projection uses padding, dilation or groups"
    return None


_FUSED_CLASSES: dict[tuple[type, Callable], type] = {}


def unfused_forward(module: nn.Module, *args, **kwargs):
    """The forward of the class ``with_fused_forward`` gave ``module`` a subclass of: a fused forward
    calls it for what it cannot compute exactly (a mask, cross-attention, an odd size), so that a
    patched model never raises where the original would not."""
    return super(type(module), module).forward(*args, **kwargs)


def with_fused_forward(module: nn.Module, forward: Callable, prefix: str = "Fused") -> nn.Module:
    """Give ``module`` a subclass of its class whose ``forward`` is ``forward``; everything else
    (parameters, buffers, attributes, methods, hooks, state-dict keys) is untouched."""
    original = type(module)
    key = (original, forward)
    if key not in _FUSED_CLASSES:
        _FUSED_CLASSES[key] = type(
            f"{prefix}{original.__name__}",
            (original,),
            {"forward": forward, "__module__": forward.__module__, "__doc__": forward.__doc__},
        )
    module.__class__ = _FUSED_CLASSES[key]
    return module
