"""python -m tools.kernel_calls: the kernels' shape rules (``make lint``).

- A call of a ``@triton.jit`` function passes at most 8 arguments by position, the rest by keyword:
  in a positional run of a dozen strides and flags, one argument out of place still compiles and
  computes something else.
- A ``@triton.jit`` function is at most 100 lines (its signature and docstring included): a kernel
  longer than a screen or two is split into named passes (helpers Triton inlines).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_POSITIONAL = 8
MAX_LINES = 100
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
    """``file:line: ...`` for each call of a jit function with more than MAX_POSITIONAL positional
    arguments and each jit function over MAX_LINES lines."""
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in sorted(folder.glob("*.py"))}
    names = jit_functions(trees)
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in names
                and len(node.args) > MAX_POSITIONAL
            ):
                found.append(
                    f"{path}:{node.lineno}: {node.func.id}(...) passes {len(node.args)} arguments by "
                    f"position, at most {MAX_POSITIONAL}: pass the rest by keyword"
                )
            elif isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    found.append(
                        f"{path}:{node.lineno}: {node.name} is {lines} lines, at most {MAX_LINES}: "
                        "split it into named passes"
                    )
    return found


def main() -> int:
    found = violations()
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
