"""torch.compile backends for tests: each keeps the graphs it is given and runs them as traced, so a
test can read which ops a compiled model calls."""

from __future__ import annotations

import torch


def kernel_ops(graphs: list[torch.fx.GraphModule]) -> set[str]:
    """The vit_kernels ops that ``graphs`` call, without their namespace and overload."""
    return {
        str(node.target).removeprefix("vit_kernels.").removesuffix(".default")
        for gm in graphs
        for node in gm.graph.nodes
        if node.op == "call_function" and str(node.target).startswith("vit_kernels.")
    }


class GraphCapture:
    """A torch.compile backend that keeps every graph it is given and runs it as traced."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def ops(self, index: int = -1) -> set[str]:
        """The vit_kernels ops and the reference's key ops called by graph ``index``."""
        names = {
            str(node.target).removesuffix(".default")
            for node in self.graphs[index].graph.nodes
            if node.op == "call_function"
        }
        return {
            n for n in names if n.startswith("vit_kernels.") or "scaled_dot_product" in n or "layer_norm" in n
        }


class JointCapture:
    """A torch.compile backend (AOTAutograd) that keeps the forward and the backward graph of each
    compiled region and runs them as traced."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []

        def keep(graphs):
            return lambda gm, example_inputs: (graphs.append(gm), make_boxed_func(gm.forward))[1]

        self.backend = aot_autograd(fw_compiler=keep(self.forward), bw_compiler=keep(self.backward))
