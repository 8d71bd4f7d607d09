"""The integration environment: the real libraries must be importable (a missing one is an error,
not a skip), every test runs on the float64 torch backend unless it says otherwise, and the largest
output and gradient difference per model family is printed at the end of the run."""

import importlib
import zlib
from collections import defaultdict

import pytest
import torch

import vit_kernels as vk

for _library in ("timm", "transformers", "torchvision"):
    try:
        importlib.import_module(_library)
    except ImportError as error:
        raise pytest.UsageError(
            f"the integration tests need {_library} (make test-integration installs tests/integration/requirements.txt): {error}"
        ) from error

_MAX_DIFFERENCE: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])


@pytest.fixture(autouse=True)
def seed_and_backend(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    previous = vk.get_backend()
    vk.set_backend("torch")
    yield
    vk.set_backend(previous)


@pytest.fixture
def record_difference():
    """record_difference(family, output_diff, grad_diff): keep the largest per family for the summary."""

    def record(family: str, output_diff: float, grad_diff: float) -> None:
        row = _MAX_DIFFERENCE[family]
        row[0], row[1] = max(row[0], output_diff), max(row[1], grad_diff)

    return record


def pytest_terminal_summary(terminalreporter):
    if not _MAX_DIFFERENCE:
        return
    terminalreporter.section(
        "largest difference from the original model (float64 on the torch backend unless named)"
    )
    for family, (out, grad) in sorted(_MAX_DIFFERENCE.items()):
        terminalreporter.write_line(f"{family:34s} output {out:.2e}   gradient {grad:.2e}")
