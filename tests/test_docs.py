"""The documentation runs: every ```python block of README.md and docs/*.md executes as written, each
in a fresh namespace and a temporary working directory. A block that needs a GPU says so on the line
before it (``<!-- requires: cuda -->``) and is skipped only where CUDA is absent. Every fenced block
names its language, so a python block cannot go untested by having none, and every file the
documentation links to or names under benchmarks/results/ is in the repository, and the README links
every page of docs/."""

import re
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vit_kernels import backend

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python", "bash", "sh", "text", "yaml", "json", "toml"}
REQUIREMENTS = {"cuda": torch.cuda.is_available}
REQUIRES = re.compile(r"^<!--\s*requires:\s*(\S+)\s*-->$")
FENCE = re.compile(r"^\s*```(.*)$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the block's first line of code
    language: str
    source: str
    requires: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not FENCE.match(lines[end]):
            end += 1
        assert end < len(lines), f"{path.name}:{i + 1}: the fence is never closed"
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = REQUIRES.match(before)
        language = opening.group(1).strip().split(" ")[0]
        source = textwrap.dedent("\n".join(lines[i + 1 : end]) + "\n")  # a block inside a list is indented
        blocks.append(Block(path, i + 2, language, source, marker and marker.group(1)))
        i = end + 1
    return blocks


BLOCKS = [block for path in DOCS for block in fenced_blocks(path)]
PYTHON = [block for block in BLOCKS if block.language == "python"]


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The block's files go to a folder of its own; the backend is restored by conftest."""
    monkeypatch.chdir(tmp_path)
    backend.clear_decisions()
    yield tmp_path
    backend.clear_decisions()


def run_block(block: Block) -> dict:
    # Padding the source to its line in the file makes a traceback name the documentation's line.
    code = compile("\n" * (block.line - 1) + block.source, str(block.path), "exec")
    namespace = {"__name__": "__main__"}
    exec(code, namespace)
    return namespace


def test_there_are_python_blocks():
    assert len(PYTHON) >= 4, [block.name for block in PYTHON]


@pytest.mark.parametrize("block", PYTHON, ids=[block.name for block in PYTHON])
def test_python_block_runs_as_written(block, scratch):
    if block.requires is not None:
        assert block.requires in REQUIREMENTS, f"{block.name}: unknown requirement {block.requires!r}"
        if not REQUIREMENTS[block.requires]():
            pytest.skip(f"{block.name} requires {block.requires}, which this machine lacks")
    run_block(block)


def test_every_block_names_a_known_language():
    unnamed = [f"{b.name} ({b.language or 'none'})" for b in BLOCKS if b.language not in LANGUAGES]
    assert not unnamed, f"fenced blocks without a known language: {unnamed}"
    misplaced = [b.name for b in BLOCKS if b.requires is not None and b.language != "python"]
    assert not misplaced, f"a requirement marks a block that is not python: {misplaced}"


def test_a_broken_block_fails_at_its_own_line(scratch):
    """The runner is not vacuous: an error raises, and its traceback names the documentation line."""
    block = Block(ROOT / "README.md", 40, "python", "x = 1\nassert x == 2\n", None)
    with pytest.raises(AssertionError) as caught:
        run_block(block)
    frame = traceback.extract_tb(caught.value.__traceback__)[-1]
    assert (frame.filename, frame.lineno) == (str(block.path), 41)


def test_blocks_run_in_fresh_namespaces(scratch):
    first = run_block(Block(ROOT / "README.md", 1, "python", "leaked = 1\n", None))
    assert first["leaked"] == 1
    with pytest.raises(NameError):
        run_block(Block(ROOT / "README.md", 1, "python", "leaked\n", None))


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: lower case, punctuation dropped, spaces as -."""
    prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+\s+(.*)$", prose, re.M)
    }


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_cited_files_are_in_the_repository(path):
    """A clone has what the documentation cites: no path leads out of the repository, every relative
    link resolves (a #heading too), and every results file named (a glob, where it says cpu-*.md) exists."""
    text = path.read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    upward = re.findall(r"(?<![\w.])((?:\.\./)+[\w./*-]*)", prose)  # a docs page may cite ../csrc/README.md
    outside = [t for t in upward if not (path.parent / t).resolve().is_relative_to(ROOT.resolve())]
    assert not outside, f"{path.name} cites paths outside the repository: {outside}"
    links = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", text) if "://" not in t]
    missing = [t for t in links if not (path.parent / t).exists()]
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
        page = path.parent / target if target else path
        if (
            "://" not in target
            and page.suffix == ".md"
            and page.exists()
            and anchor not in heading_anchors(page)
        ):
            missing.append(f"{target}#{anchor}")
    results = [t.rstrip(".") for t in re.findall(r"benchmarks/results/[\w.*-]+", text)]
    missing += [t for t in results if not any(ROOT.glob(t))]
    assert results or path.name != "README.md", "README.md names no results file"
    assert not missing, f"{path.name} cites files that are not in the repository: {missing}"


def test_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages, "docs/ holds no pages"
    unlinked = [p.name for p in pages if f"](docs/{p.name})" not in readme]
    assert not unlinked, f"README.md does not link these docs pages: {unlinked}"
