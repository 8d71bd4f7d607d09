"""``patch_model``: the adapter for models we don't own (timm, Hugging Face, torchvision, plain PyTorch).

A layer is swapped only when its class is one the adapters in ``vit_kernels.integrations`` know and
every submodule, parameter, buffer and forward argument it has is understood; the swap keeps the
very same parameter tensors (so optimizers, state dicts and weight tying are unaffected). Everything
attention-, MLP-, norm- or patch-embedding-like that stays as it is is listed in the report's
``skipped`` with the reason, so the coverage is visible.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from vit_kernels.integrations import RULES
from vit_kernels.integrations._common import own_tensors, qualified_name

# What a module we do not know looks like, by its class name.
_LOOKS_LIKE = (
    ("attention", re.compile(r"attention|attn", re.IGNORECASE)),
    ("MLP", re.compile(r"mlp|feedforward|ffn|glu", re.IGNORECASE)),
    ("norm", re.compile(r"norm", re.IGNORECASE)),
    ("patch embedding", re.compile(r"patch_?embed", re.IGNORECASE)),
)


@dataclass
class PatchReport:
    """What ``patch_model`` did: ``replaced`` rows are (qualified name, old class, new class);
    ``skipped`` rows are (qualified name, reason) for the layers it left as they are."""

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} layer(s)"]
        lines += [f"  {name}: {old} -> {new}" for name, old, new in self.replaced]
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} layer(s)")
            lines += [f"  {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


def _unknown_layer_reason(module: nn.Module) -> Optional[str]:
    """Why an unknown module that looks like a layer we fuse is left alone, or None when it does not."""
    cls = type(module)
    if isinstance(module, nn.Conv2d) and module.kernel_size == module.stride and module.kernel_size != (1, 1):
        return "a patch-embedding-like Conv2d called directly by its model (only known patch-embedding layers are fused)"
    for kind, pattern in _LOOKS_LIKE:
        if pattern.search(cls.__name__):
            tensors = own_tensors(module)
            extra = f" (its own parameters/buffers: {', '.join(tensors)})" if tensors else ""
            return f"{kind}-like {qualified_name(cls)} is not a layer vit_kernels knows{extra}"
    return None


def _visit(parent: nn.Module, prefix: str, report: PatchReport) -> None:
    for child_name, child in list(parent.named_children()):
        _patch(parent, child_name, child, f"{prefix}.{child_name}" if prefix else child_name, report)


def _patch(
    parent: Optional[nn.Module], child_name: str, child: nn.Module, name: str, report: PatchReport
) -> None:
    """Swap ``child`` (``parent.<child_name>``; the model itself when ``parent`` is None) or say why not."""
    cls = type(child)
    if cls.__module__.startswith("vit_kernels."):
        return  # ours already
    rule = RULES.get(qualified_name(cls))
    if rule is None:
        why = _unknown_layer_reason(child)
        if why:
            report.skipped.append((name or "(model)", why))
        _visit(child, name, report)
        return
    swap = rule(child)
    label = name or "(model)"
    if swap.new is not None and swap.new is not child and parent is None:
        swap = type(swap)(
            None, "is the model itself: wrap it in a parent module to replace it", descend=False
        )
    if swap.new is None:
        report.skipped.append((label, swap.reason))
    else:
        if swap.new is not child:
            swap.new.train(child.training)
            setattr(parent, child_name, swap.new)
        report.replaced.append((label, cls.__name__, _describe(swap.new, child)))
    if swap.descend:
        _visit(swap.new if swap.new is not None else child, name, report)


def _describe(new: nn.Module, old: nn.Module) -> str:
    if new is old and qualified_name(type(new)) in RULES:
        return f"{type(new).__name__} (fused attention via its attention interface)"
    return f"{type(new).__module__}.{type(new).__name__}"


def patch_model(model: nn.Module) -> PatchReport:
    """Swap the known layers of ``model`` in place for fused ones with the same parameters.

    Returns the report: every swapped layer, and every attention-, MLP-, norm- or patch-embedding-
    like layer left alone with the reason. ``print(report)`` lists both.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    report = PatchReport()
    _patch(None, "", model, "", report)
    return report
