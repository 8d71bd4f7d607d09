"""``patch_model``: the adapter for models we don't own (timm ViTs, plain PyTorch).

Known layers are swapped in place for the fused ones, keeping the very same parameter tensors
(so optimizers, state dicts and weight tying are unaffected):

* ``nn.LayerNorm`` over one dimension                  -> ``vit_kernels.nn.LayerNorm``
* timm ``Attention`` (qkv, proj, num_heads; no q/k norm) -> ``vit_kernels.nn.Attention``
* timm ``Mlp`` (fc1, act = GELU / GELU-tanh / ReLU, fc2) -> ``vit_kernels.nn.Mlp``
* timm ``PatchEmbed`` (Conv2d with kernel == stride)     -> ``vit_kernels.nn.PatchEmbed``

Layers are recognised by their structure, so timm need not be installed. Anything else is left as
it is and listed in the report's ``skipped`` with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from torch import nn

from vit_kernels import nn as vkn


@dataclass
class PatchReport:
    """What ``patch_model`` did: ``replaced`` rows are (qualified name, old class, new class)."""

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} layer(s)"]
        lines += [f"  {name}: {old} -> {new}" for name, old, new in self.replaced]
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} layer(s)")
            lines += [f"  {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


def _is_identity(module: Optional[nn.Module]) -> bool:
    return module is None or isinstance(module, nn.Identity)


def _dropout_p(module: Optional[nn.Module]) -> float:
    return module.p if isinstance(module, nn.Dropout) else 0.0


def _activation_name(act: nn.Module) -> Optional[str]:
    if isinstance(act, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}[act.approximate]
    if isinstance(act, nn.ReLU):
        return "relu"
    return None


def _swap_layer_norm(module: nn.Module) -> tuple[Optional[nn.Module], str]:
    if len(module.normalized_shape) != 1:
        return None, "normalizes over more than the last dimension"
    new = vkn.LayerNorm(module.normalized_shape[0], eps=module.eps, elementwise_affine=False, bias=False)
    new.weight, new.bias = module.weight, module.bias
    return new, ""


def _swap_attention(module: nn.Module) -> tuple[Optional[nn.Module], str]:
    if not (_is_identity(getattr(module, "q_norm", None)) and _is_identity(getattr(module, "k_norm", None))):
        return None, "uses q/k normalization"
    if not _is_identity(getattr(module, "norm", None)):
        return None, "normalizes inside attention"
    dim, heads = module.qkv.in_features, module.num_heads
    scale = getattr(module, "scale", None)
    if scale is not None and abs(scale - (dim // heads) ** -0.5) > 1e-12:
        return None, f"uses a non-default scale {scale}"
    new = vkn.Attention(
        dim,
        heads,
        attn_drop=_dropout_p(getattr(module, "attn_drop", None)),
        proj_drop=_dropout_p(getattr(module, "proj_drop", None)),
    )
    new.qkv, new.proj = module.qkv, module.proj
    return new, ""


def _swap_mlp(module: nn.Module) -> tuple[Optional[nn.Module], str]:
    act = _activation_name(module.act)
    if act is None:
        return None, f"activation {type(module.act).__name__} is not one of GELU, GELU(tanh), ReLU"
    if not _is_identity(getattr(module, "norm", None)):
        return None, "normalizes inside the MLP"
    drop1, drop2 = _dropout_p(getattr(module, "drop1", None)), _dropout_p(getattr(module, "drop2", None))
    if drop1 != drop2:
        return None, f"uses two different dropout rates ({drop1}, {drop2})"
    if not isinstance(module.fc1, nn.Linear) or not isinstance(module.fc2, nn.Linear):
        return None, "fc1/fc2 are not nn.Linear"
    new = vkn.Mlp(module.fc1.in_features, module.fc1.out_features, module.fc2.out_features, act=act, drop=drop1)
    new.fc1, new.fc2 = module.fc1, module.fc2
    return new, ""


def _swap_patch_embed(module: nn.Module) -> tuple[Optional[nn.Module], str]:
    proj = module.proj
    if not isinstance(proj, nn.Conv2d) or proj.kernel_size != proj.stride or proj.kernel_size[0] != proj.kernel_size[1]:
        return None, "projection is not a square Conv2d with stride == kernel"
    if proj.padding not in ((0, 0), "valid") or proj.dilation != (1, 1) or proj.groups != 1:
        return None, "projection uses padding, dilation or groups"
    if not getattr(module, "flatten", True) or not _is_identity(getattr(module, "norm", None)):
        return None, "does not flatten to tokens, or normalizes the tokens"
    if getattr(module, "dynamic_img_size", False) or getattr(module, "dynamic_img_pad", False):
        return None, "uses dynamic image sizes"
    img_size = getattr(module, "img_size", None)
    new = vkn.PatchEmbed(img_size, proj.kernel_size[0], proj.in_channels, proj.out_channels)
    new.proj = proj
    return new, ""


def _matcher(module: nn.Module) -> Optional[Callable[[nn.Module], tuple[Optional[nn.Module], str]]]:
    """The swap function for ``module``, recognised by type or structure, or None."""
    if isinstance(module, (vkn.LayerNorm, vkn.Attention, vkn.Mlp, vkn.PatchEmbed)):
        return None
    if isinstance(module, nn.LayerNorm):
        return _swap_layer_norm
    name = type(module).__name__
    if name == "Attention" and all(hasattr(module, a) for a in ("qkv", "proj", "num_heads")):
        return _swap_attention
    if name == "Mlp" and all(hasattr(module, a) for a in ("fc1", "act", "fc2")):
        return _swap_mlp
    if name == "PatchEmbed" and hasattr(module, "proj") and getattr(module, "img_size", None) is not None:
        return _swap_patch_embed
    return None


def patch_model(model: nn.Module) -> PatchReport:
    """Swap known layers of ``model`` in place for fused ones with the same parameters."""
    report = PatchReport()
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            swap = _matcher(child)
            if swap is None:
                continue
            qualified = f"{parent_name}.{child_name}" if parent_name else child_name
            new, why = swap(child)
            if new is None:
                report.skipped.append((qualified, why))
                continue
            new.train(child.training)
            setattr(parent, child_name, new)
            report.replaced.append((qualified, type(child).__name__, type(new).__name__))
    return report
