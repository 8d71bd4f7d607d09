"""make check-cuda's compile cache (tools/gpu_check/nvcc_cached.py): a compile runs once per content,
is read back in another checkout (other include paths), and runs again when its source changes or
when it failed, leaving no report behind."""

import sys

import pytest

pytest.importorskip("triton")

from tools.gpu_check import nvcc_cached  # noqa: E402

# Stands in for nvcc: counts its runs in the file named by its first argument, writes a ptxas-like
# report to stderr, and fails when the source holds "error".
FAKE_NVCC = (
    "import sys; open(sys.argv[1], 'a').write('x'); source = open(sys.argv[-1]).read(); "
    "sys.stderr.write('ptxas info : Used 32 registers ' + str(len(source))); "
    "sys.exit(1 if 'error' in source else 0)"
)


def test_a_compile_runs_once_per_content_and_not_per_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("VIT_KERNELS_COMPILED_CACHE", str(tmp_path / "cache"))
    source, runs, log = tmp_path / "kernel.cu", tmp_path / "runs", tmp_path / "build" / "kernel.ptxas.log"
    source.write_text("__global__ void k() {}")

    def compile_in(checkout: str) -> int:
        command = [sys.executable, "-c", FAKE_NVCC, str(runs), f"-I{checkout}/.venv/include", str(source)]
        return nvcc_cached.main([str(log), "--", *command])

    assert compile_in("/one") == 0 and runs.read_text() == "x"
    first = log.read_text()
    assert first.startswith("ptxas info")
    log.unlink()
    assert compile_in("/another") == 0 and runs.read_text() == "x", "a second checkout compiled again"
    assert log.read_text() == first
    source.write_text("__global__ void k() { int edited; }")
    assert compile_in("/another") == 0 and runs.read_text() == "xx", "an edited source was not compiled"
    source.write_text("error")
    assert compile_in("/one") == 1 and not log.exists(), "a failed compile left a report for make"
    assert compile_in("/one") == 1
    assert runs.read_text() == "xxxx", "a failed compile was kept"


def test_bad_usage_is_refused(capsys):
    assert nvcc_cached.main(["log"]) == 2
    assert "nvcc_cached LOG -- nvcc" in capsys.readouterr().err
