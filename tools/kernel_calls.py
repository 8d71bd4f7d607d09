"""python -m tools.kernel_calls: calls of a ``@triton.jit`` function pass at most 8 arguments by
position, the rest by keyword (``make lint``): in a positional run of a dozen strides and flags, one
argument out of place still compiles and computes something else."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_POSITIONAL = 8
KERNELS = Path(__file__).resolve().parents[1] / "vit_kernels" / "kernels"


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit"


def jit_functions(trees: dict[Path, ast.Module]) -> set[str]:
    """The names of every ``@triton.jit`` function defined in ``trees``."""
    return {
        node.name
        for tree in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list)
    }


def violations(folder: Path = KERNELS) -> list[str]:
    """``file:line: name(...)`` for each call of a jit function with more than MAX_POSITIONAL
    positional arguments."""
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in sorted(folder.glob("*.py"))}
    names = jit_functions(trees)
    return [
        f"{path}:{node.lineno}: {node.func.id}(...) passes {len(node.args)} arguments by position, "
        f"at most {MAX_POSITIONAL}: pass the rest by keyword"
        for path, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in names
        and len(node.args) > MAX_POSITIONAL
    ]


def main() -> int:
    found = violations()
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
