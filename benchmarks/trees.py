"""The source trees an A/B run compares: a git revision exported into a temporary folder, or the
working tree itself; and the harness (this ``benchmarks`` package) copied beside them, so that both
sides are timed by the same benchmark code whatever their own ``benchmarks/`` holds.

The compiled extension (``vit_kernels/_C*.so``) is not in git. An exported revision gets the
working tree's build when its ``csrc/`` is byte-identical to the working tree's; otherwise it runs
without the extension, and the run says so.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

WORKTREE = "worktree"


@dataclass(frozen=True)
class Tree:
    label: str  # what the user asked for, and the commit it resolved to
    root: Path  # the folder to put on sys.path
    note: Optional[str]  # about the compiled extension, when it is not this tree's own build


def _git(repo: Path, *args: str) -> bytes:
    try:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, check=True, timeout=120
        ).stdout
    except FileNotFoundError:
        raise SystemExit(
            "git is not installed: python -m benchmarks ab needs it to export revisions"
        ) from None
    except subprocess.CalledProcessError as error:
        said = " ".join(error.stderr.decode(errors="replace").split())  # git's several lines as one
        raise SystemExit(f"git {' '.join(args)} failed in {repo}: {said}") from None


def repo_root(start: Path) -> Path:
    """The top of the git working tree that holds ``start``."""
    return Path(_git(start, "rev-parse", "--show-toplevel").decode().strip())


def resolve(repo: Path, revision: str) -> str:
    """The full commit id of ``revision`` (a branch, tag, sha, HEAD~1, ...)."""
    if revision.startswith("-"):
        raise SystemExit(f"revision must be a git revision such as HEAD or main, got {revision!r}")
    try:
        return subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
            capture_output=True,
            check=True,
            text=True,
            timeout=60,
        ).stdout.strip()
    except subprocess.CalledProcessError:
        raise SystemExit(
            f"--baseline/--candidate: {revision!r} is not a commit in {repo} "
            f"(a shallow clone may lack it: fetch it first, e.g. git fetch --deepen=1)"
        ) from None


def _extensions(root: Path) -> list[Path]:
    return sorted((root / "vit_kernels").glob("_C*.so")) + sorted((root / "vit_kernels").glob("_C*.pyd"))


def _files(folder: Path) -> dict[str, bytes]:
    if not folder.is_dir():
        return {}
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def _provide_extension(tree: Path, repo: Path) -> str:
    built = _extensions(repo)
    if not built:
        return "no compiled extension in the working tree: this side runs without it"
    if _files(tree / "csrc") != _files(repo / "csrc"):
        return "csrc/ differs from the working tree's: this side runs without the compiled extension"
    for path in built:
        shutil.copy2(path, tree / "vit_kernels" / path.name)
    return f"compiled extension copied from the working tree (csrc/ identical): {', '.join(p.name for p in built)}"


def materialise(repo: Path, revision: str, into: Path) -> Tree:
    """``revision`` as a folder: the working tree itself for ``worktree``, else ``git archive`` of
    the commit extracted under ``into`` (nothing is written to the repository)."""
    if revision == WORKTREE:
        head = _git(repo, "rev-parse", "--short=12", "HEAD").decode().strip()
        changed = len(
            [
                line
                for line in _git(repo, "status", "--porcelain", "--untracked-files=no").decode().splitlines()
                if line
            ]
        )
        return Tree(
            f"worktree ({head}" + (f" + {changed} changed files)" if changed else ", clean)"), repo, None
        )
    commit = resolve(repo, revision)
    target = into / commit[:12]
    if not target.exists():
        archive = _git(repo, "archive", "--format=tar", commit)
        target.mkdir(parents=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(target, filter="data")
            else:  # Python < 3.11.4: git's own archive of our own repository
                tar.extractall(target)
    if not (target / "vit_kernels" / "__init__.py").is_file():
        raise SystemExit(f"{revision} ({commit[:12]}) has no vit_kernels/ package: nothing to benchmark")
    return Tree(f"{revision} ({commit[:12]})", target, _provide_extension(target, repo))


def copy_harness(into: Path) -> Path:
    """A copy of this ``benchmarks`` package (code only) and of the op specs it times
    (``vit_kernels/ops/specs.py``, as ``tools/op_specs.py``, the name the benchmarks import) under
    ``into``; returns the folder to put first on the workers' sys.path."""
    source = Path(__file__).resolve().parent
    target = into / "harness"
    shutil.copytree(
        source,
        target / "benchmarks",
        dirs_exist_ok=True,
        ignore=shutil.ignore_patterns("__pycache__", "results", "*.json", "*.md"),
    )
    (target / "tools").mkdir(exist_ok=True)
    shutil.copy(source.parent / "tools" / "__init__.py", target / "tools" / "__init__.py")
    shutil.copy(source.parent / "vit_kernels" / "ops" / "specs.py", target / "tools" / "op_specs.py")
    return target
