"""Shared fixtures: a per-test seed, the backend restored after each test, dispatch kept
deterministic and off the user's cache, each backend on each device."""

import contextlib
import os
import sys
import zlib

import pytest  # noqa: E402
import torch  # noqa: E402

import vit_kernels as vk  # noqa: E402
from tests.covering import mark_uncovered_slow  # noqa: E402
from tests.helpers import FUZZ_SEED, device_backends, exact_float32, skip_unless_offered  # noqa: E402
from vit_kernels import _tiles, backend  # noqa: E402


@pytest.fixture(autouse=True)
def seed(request) -> int:
    """Seed torch from the test's id: every test is reproducible, and no two share their data."""
    value = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(value)
    return value


def pytest_collectstart(collector):
    """Seed torch from each test module's id before it is imported: the data a module draws at
    import is the same whatever other modules were collected before it."""
    if isinstance(collector, pytest.Module):
        torch.manual_seed(zlib.crc32(collector.nodeid.encode()))


@pytest.fixture(autouse=True)
def tuned_decisions_stay_with_their_test(monkeypatch):
    """Each test's tuned decisions and tiles stay its own, and no test leaves searching on."""
    monkeypatch.setattr(backend, "TUNED", {})
    monkeypatch.setattr(_tiles, "TUNED", {})
    monkeypatch.setattr(backend, "searcher", None)
    _tiles.forget()


@pytest.fixture(autouse=True)
def cuda_faults_stay_with_their_test(request):
    """On a real GPU, wait for the test's kernels before the next test starts: a kernel's fault (an
    illegal or misaligned address) is reported at the next synchronising call, and would otherwise
    fail a later test instead of the one that launched it. Such a fault leaves the process's CUDA
    context unusable, so every later test of the process would fail in its setup: a pytest-xdist
    worker ends at once (xdist reports this test as the one that crashed it and starts a fresh
    worker for the rest), a plain run stops, naming this test."""
    yield
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    try:
        torch.cuda.synchronize()
    except RuntimeError as fault:  # torch.AcceleratorError is a RuntimeError
        message = f"{request.node.nodeid} left a CUDA fault; this process's CUDA context is lost: {fault}"
        if os.environ.get("PYTEST_XDIST_WORKER"):
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
            os._exit(1)
        pytest.exit(message, returncode=1)


@pytest.fixture(autouse=True)
def restore_backend():
    previous = vk.get_backend()
    yield
    vk.set_backend(previous)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Before ``-m`` selects: a ``pairwise`` test's CPU cases outside its covering subset become
    ``slow`` (tests/covering.py)."""
    mark_uncovered_slow(items)


def pytest_terminal_summary(terminalreporter):
    """After a run that ran fuzz tests (in this process or on pytest-xdist's workers): their seed."""
    reports = (r for kind in ("passed", "failed") for r in terminalreporter.stats.get(kind, ()))
    if any(getattr(r, "nodeid", "").startswith("tests/test_fuzz.py") for r in reports):
        terminalreporter.write_line(
            f"fuzz seed: {FUZZ_SEED} (the day's; VIT_KERNELS_FUZZ_SEED={FUZZ_SEED} draws this run's cases again)"
        )


def pytest_runtest_logreport(report):
    """With VIT_KERNELS_TEST_LOG_DIR set (``make gpu-session``), each test's outcome as it ends, one
    line per phase that did not simply pass, to outcomes.txt, and each failure in full to
    failures.txt: a run stopped by its time limit, or by a CUDA fault, still tells which tests ran
    and why each failed. Written by the controlling process only (pytest-xdist's workers report to it)."""
    folder = os.environ.get("VIT_KERNELS_TEST_LOG_DIR")
    if not folder or os.environ.get("PYTEST_XDIST_WORKER") or (report.passed and report.when != "call"):
        return
    with open(os.path.join(folder, "outcomes.txt"), "a") as log:
        log.write(f"{report.outcome} {report.when} {report.nodeid} {report.duration:.2f}\n")
    if report.failed:
        with open(os.path.join(folder, "failures.txt"), "a") as log:
            log.write(f"===== {report.when} {report.nodeid}\n{report.longreprtext}\n")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, so fixtures can see whether the body ran."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


@pytest.fixture(params=[pytest.param(p.values, marks=p.marks, id=p.id) for p in device_backends()])
def on_backend(request):
    """Run the test body with each backend that can run CPU tensors here, and on CUDA with every
    backend (``gpu`` cases: CUDA is then the default device of the body's factory calls, and float32
    convolutions and matmuls run without TF32, as the body's fixed float32 tolerances assume),
    strictly (a call the backend cannot take raises, naming the limit), and check through
    ``vk.explain()`` that the backend named is the one that ran every op of the body. A module whose
    tests are of one op names it in ``OP``: a backend that does not offer that op on the device (the
    extension's attention on CUDA) is skipped with its reason."""
    device, name = request.param
    op = getattr(request.module, "OP", None)  # a module of one op's tests names it
    if op is not None:
        skip_unless_offered(op, name, device)
    backend.clear_decisions()
    on_device = torch.device(device) if device != "cpu" else contextlib.nullcontext()
    with on_device, exact_float32(device), vk.use_backend(name, strict=True):
        yield name
    report = getattr(request.node, "report_call", None)
    if report is None or not report.passed:
        return
    rows = [r for r in vk.explain() if r.requested == name]
    assert rows, f"no op ran under use_backend({name!r})"
    assert {r.backend for r in rows} == {name}, f"asked for {name}, but:\n{vk.explain()}"


@pytest.fixture(autouse=True)
def named_backend_ran(request):
    """For tests parametrized by ``backend_name``: every op the test ran under
    ``use_backend(backend_name)`` must show in ``vk.explain()`` as run by that backend (no fallback)."""
    callspec = getattr(request.node, "callspec", None)
    name = callspec.params.get("backend_name") if callspec is not None else None
    if name is None:
        yield
        return
    backend.clear_decisions()
    yield
    wrong = [r for r in vk.explain() if r.requested == name and r.backend != name]
    assert not wrong, f"asked for {name}, but:\n{vk.explain()}"
