"""python -m tests.cuda_sim.coverage_report --out FILE [--cpu-suite DATA]: the simulated CUDA stage's
coverage of the runtime modules of ``vit_kernels``, as markdown, with every line it left unrun and why.

The reason of an unrun line is read off the code around it: a Triton kernel's body (compiled, not
run by Python), a fake implementation, the branch it sits in (CPU tensors, the interpreter, triton
absent, tracing), a refusal of bad input, error handling; else, given the coverage data of the CPU
suite (``--cpu-suite``), that ``make test`` runs it. A line none of these explains is listed as
"unexplained": run neither on the simulated device nor on the CPU.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import coverage
from coverage.parser import PythonParser

RULES = (  # (text in the enclosing condition or statement, reason)
    ("interpreted(", "interpreter branch (CPU tensors under TRITON_INTERPRET=1): run by make test"),
    ('type == "cpu"', "CPU branch: run by make test"),
    ('type != "cuda"', "CPU branch: run by make test"),
    ("HAS_TRITON", "triton not installed: run where it is absent"),
    ("tracing()", "tracing branch (torch.compile, export): run by tests/test_compile.py"),
    ("is_compiling", "tracing branch (torch.compile, export): run by tests/test_compile.py"),
    ("recording", "launch recording of the compile gate and block_traffic: run by make check-gpu"),
    ('type == "meta"', "meta tensors: run by make check-gpu and benchmarks.block_traffic"),
    (
        "problem is not None",
        "a candidate failing validation: on the simulated device every value reads 0 and every "
        "candidate passes; the CPU suite injects wrong tiles and outputs",
    ),
)


FUNCTION_RULES = (  # (text in a decorator of an enclosing function, reason)
    (
        "triton.jit",
        "Triton kernel code: compiled for sm_80 and sm_90 by the stage (and make check-gpu), "
        "executed by Triton (the interpreter in make test), never by Python on a GPU",
    ),
    ("register_fake", "fake implementation: run while torch.compile traces (tests/test_compile.py)"),
)
NAME_RULES = {  # enclosing function name -> reason
    "tile_report": "the tile tables of make gpu-report (a GPU's measured choices)",
    "pin": "tooling: the compile gate pins each candidate (make check-gpu)",
    "traced_key": "runs while torch.compile traces (Dynamo evaluates it, coverage.py does not see it): "
    "tests/test_compile.py",
}
MODULE_RULES = (  # (path suffix, reason)
    (
        "integrations/timm.py",
        "timm's model classes: make test-integration (a patched timm ViT on the simulated device there)",
    ),
    ("integrations/huggingface.py", "transformers' model classes: make test-integration"),
    ("integrations/torchvision.py", "torchvision's model classes: make test-integration"),
)


def _enclosing_functions(tree_parents: dict, node: ast.AST):
    current = node
    while current is not None:
        if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield current
        current = tree_parents.get(current)


def _reason(tree_parents: dict, node: ast.AST, source: str) -> str:
    for function in _enclosing_functions(tree_parents, node):
        decorators = " ".join(ast.get_source_segment(source, d) or "" for d in function.decorator_list)
        for needle, reason in FUNCTION_RULES:
            if needle in decorators:
                return reason
        if function.name in NAME_RULES:
            return NAME_RULES[function.name]
    if isinstance(node, ast.Raise):
        return "refusal (bad input, limits, no right candidate): run by tests/test_bad_input.py and the CPU suite"
    current = node
    while current is not None:
        parent = tree_parents.get(current)
        if isinstance(parent, ast.ExceptHandler) or isinstance(current, ast.ExceptHandler):
            return "error handling: run by the CPU suite's failure tests"
        if isinstance(parent, (ast.If, ast.IfExp, ast.While)) and current is not parent.test:
            text = ast.get_source_segment(source, parent.test) or ""
            for needle, reason in RULES:
                if needle in text:
                    return reason
        current = parent
    return "unexplained"


def _in_package(filename: str) -> str:
    """``vit_kernels/...`` of a module's path, wherever the package lies."""
    parts = Path(filename).parts
    return "/".join(parts[len(parts) - 1 - parts[::-1].index("vit_kernels") :])


def statement_lines(parser: PythonParser, measured: Optional[list[int]]) -> set[int]:
    """The statements (by first line, as ``missing`` names them) of ``measured``, the lines another
    run's data holds for ``parser``'s file: a condition spread over several lines is recorded at the
    line that ran, not at its statement's first."""
    return set(parser.first_lines(measured)) if measured else set()


CPU_SUITE = "run by make test on the CPU (the interpreter, the C++ kernels, tracing, bad input, the cache)"
INTEGRATION = "run by make test-integration (the adapters on the real timm, transformers and torchvision)"


def unrun_lines(
    path: Path, missing: list[int], cpu_run: set[int], integration_run: frozenset = frozenset()
) -> list[tuple[int, str, str]]:
    """(line, code, reason) for each missing line of ``path``; ``cpu_run``, ``integration_run``: the
    lines the CPU suite and the integration tests ran."""
    for suffix, reason in MODULE_RULES:
        if str(path).endswith(suffix):
            lines = path.read_text().splitlines()
            return [(n, lines[n - 1].strip(), reason) for n in missing]
    source = path.read_text()
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    statements = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.stmt, ast.ExceptHandler)):
            statements.setdefault(node.lineno, node)
    lines = source.splitlines()
    rows = []
    for n in missing:
        reason = _reason(parents, statements[n], source) if n in statements else "unexplained"
        if reason == "unexplained" and n in cpu_run:
            reason = CPU_SUITE
        elif reason == "unexplained" and n in integration_run:
            reason = INTEGRATION
        rows.append((n, lines[n - 1].strip(), reason))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.cuda_sim.coverage_report", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, help="markdown file to write")
    parser.add_argument("--cpu-suite", default=None, help="coverage data file of make test's CPU suite")
    parser.add_argument("--integration", default=None, help="coverage data file of make test-integration")
    args = parser.parse_args(argv)
    cov = coverage.Coverage()
    cov.load()
    cpu = integration = None
    if args.cpu_suite:
        cpu = coverage.CoverageData(basename=args.cpu_suite)
        cpu.read()
    if args.integration:
        integration = coverage.CoverageData(basename=args.integration)
        integration.read()
    # the integration tests run the package as installed in their own environment: its files are
    # matched to this tree's by their path from the package folder on
    installed = {_in_package(f): f for f in integration.measured_files()} if integration is not None else {}

    def installed_lines(module: str) -> Optional[list[int]]:
        return integration.lines(installed[module]) if module in installed else None

    root = Path.cwd()
    rows, details, unexplained = [], [], 0
    total_statements = total_missing = 0
    for filename in sorted(cov.get_data().measured_files()):
        path = Path(filename)
        _, statements, _, missing, _ = cov.analysis2(filename)
        relative = path.relative_to(root) if path.is_relative_to(root) else path
        total_statements += len(statements)
        total_missing += len(missing)
        rows.append(
            f"| `{relative}` | {len(statements)} | {len(missing)} | "
            f"{100 * (len(statements) - len(missing)) / max(1, len(statements)):.0f}% |"
        )
        parser = PythonParser(filename=str(path))
        parser.parse_source()
        unrun = unrun_lines(
            path,
            missing,
            statement_lines(parser, cpu.lines(filename) if cpu is not None else None),
            frozenset(statement_lines(parser, installed_lines(_in_package(filename)))),
        )
        unexplained += sum(reason == "unexplained" for *_, reason in unrun)
        if unrun:
            details.append(
                f"\n### `{relative}`\n\n| line | code | why the simulated device does not run it |\n| --- | --- | --- |"
            )
            details += [f"| {n} | `{code.replace('|', '/')[:90]}` | {reason} |" for n, code, reason in unrun]
    covered = 100 * (total_statements - total_missing) / max(1, total_statements)
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:  # no git: the report still says what it measured
        commit = ""
    text = "\n".join(
        [
            "# Coverage of the runtime modules under the simulated CUDA device (`make test-cuda-sim`)",
            "",
            f"Measured at commit {commit or 'unknown'}.",
            f"{total_statements} statements, {total_missing} not run ({covered:.1f}% run); "
            f"{unexplained} unrun lines have no reason: run neither here nor by the CPU suite.",
            "The test tooling (`selftest`, `op_specs`, the GPU test runner) lives in `tools/`, outside the runtime. "
            + (
                f"Lines run by the CPU suite: from `{args.cpu_suite}`."
                if args.cpu_suite
                else "No CPU-suite data given."
            )
            + (
                f" Lines run by the integration tests: from `{args.integration}`." if args.integration else ""
            ),
            "",
            "| module | statements | not run | run |",
            "| --- | --- | --- | --- |",
            *rows,
            "",
            "## Lines not run, and why",
            *details,
            "",
        ]
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_suffix(out.suffix + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, out)
    print(
        f"coverage of the runtime under the simulated CUDA device: {covered:.1f}%, {unexplained} unexplained lines; "
        f"report in {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
