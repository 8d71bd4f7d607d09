"""The ops' two call paths: the registered op while tracing, a direct call in eager mode.

Every kernel is a registered op (``torch.library.triton_op`` for Triton, ``TORCH_LIBRARY`` for the
extension) with a fake implementation and ``torch.library.register_autograd``, so that
torch.compile and export keep it opaque in the graph. Called in eager mode, that registration costs
the host the dispatcher, then the Python autograd kernel and, for Triton ops, ``custom_op``'s
wrapper around the body: more than many ViT kernels run on a GPU. So in eager mode
``differentiable`` runs the same forward, setup_context and backward from a plain
``torch.autograd.Function`` (the body called directly), and
``direct`` calls a backward op's body directly; while tracing, both call the registered op.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _get_current_dispatch_mode


def tracing() -> bool:
    """Whether the call is being traced or transformed (Dynamo; a dispatch mode: fake tensors, make_fx,
    AOTAutograd's backward, export; a functorch transform such as vmap): then the registered op must
    be called, so that the graph holds it (or the dispatcher applies the transform). A dispatch mode
    with ``sees_eager_calls = True`` (one counting the ops an eager call runs) is not tracing."""
    if torch.compiler.is_compiling():  # first: Dynamo cannot trace the dispatch-mode stack's length
        return True
    mode = _get_current_dispatch_mode()
    return (
        mode is not None and not getattr(mode, "sees_eager_calls", False)
    ) or torch._C._are_functorch_transforms_active()


def _register(body: Callable) -> tuple[str, Optional[Callable]]:
    """Register ``body`` (a Triton op's Python implementation, named ``_<name>``, its schema read from
    its annotations) as ``torch.library.triton_op`` ``vit_kernels::<name>`` -> (name, the op). Without
    Triton nothing is registered (None): the Triton backend is off, and no call reaches the op."""
    from vit_kernels._triton import HAS_TRITON  # imported here: vit_kernels._triton imports this module

    name = body.__name__.lstrip("_")
    if not HAS_TRITON:
        return name, None
    torch.library.triton_op(f"vit_kernels::{name}", mutates_args=())(body)
    return name, getattr(torch.ops.vit_kernels, name).default


def direct(body: Callable) -> Callable:
    """Register ``body`` as an op (``_register``) -> a callable: the op while tracing, ``body`` (same
    arguments) in eager mode."""
    _, op = _register(body)

    def call(*args: Any) -> Any:
        return op(*args) if tracing() else body(*args)

    return call


def differentiable(
    body: Callable, backward: Callable, setup_context: Callable, double_backward: bool = False
) -> Callable:
    """Register ``body`` as an op (``_register``) with ``backward`` / ``setup_context`` as its
    autograd and return the op's eager-fast callable: the registered op while tracing;
    otherwise an ``autograd.Function`` with the same forward (``body``), setup_context and backward
    when a gradient will be needed, and the forward alone when none will. ``double_backward``: the
    backward is made of differentiable ops (a second derivative goes through it); otherwise it
    launches kernels, and a second derivative through it raises instead of treating it as a
    constant. ``backward`` takes None for an output that receives no gradient (eagerly no zeros are
    made for the outputs only backward reads, such as a saved pre-activation)."""
    name, op = _register(body)
    if op is not None:
        torch.library.register_autograd(f"vit_kernels::{name}", backward, setup_context=setup_context)

    def function_forward(ctx, *args):
        ctx.set_materialize_grads(False)  # an output without a gradient gives None, not a tensor of zeros
        output = body(*args)
        setup_context(ctx, args, output)
        return output

    # named after the op, so that autograd nodes, profiles and errors say which op
    Function = type(
        f"{name}_function",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(function_forward),
            "backward": staticmethod(backward if double_backward else once_differentiable(backward)),
        },
    )

    def call(*args: Any) -> Any:
        if tracing():
            return op(*args)
        if torch.is_grad_enabled():
            for a in args:  # _signature.needs_grad's test, inline: no frame on every op's call
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    return Function.apply(*args)
        return body(*args)

    call.__name__ = name
    return call
