"""Loading the compiled extension: never built stays quiet, built but unloadable warns once at import
with the reason and the command that rebuilds it. Each case is a fresh interpreter (the extension is
loaded once per process), with the loading of ``vit_kernels._C`` replaced before ``vit_kernels`` is
imported: by a file that is not a shared library (what the dynamic loader refuses, as it refuses an
extension linked against another torch), or by nothing at all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from vit_kernels import _ext

ROOT = Path(__file__).resolve().parents[1]

# A meta-path finder that answers for vit_kernels._C with the standard extension loader pointed at
# BROKEN_SO: the real dlopen path, failing as a stale build fails.
BROKEN = """
import importlib.machinery, importlib.util, sys
class _Broken:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "vit_kernels._C":
            return None
        return importlib.util.spec_from_file_location(
            name, BROKEN_SO, loader=importlib.machinery.ExtensionFileLoader(name, BROKEN_SO))
sys.meta_path.insert(0, _Broken)
"""
# A None entry in sys.modules is how Python marks a module as absent: find_spec answers None.
ABSENT = 'import sys; sys.modules["vit_kernels._C"] = None\n'
REPORT = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import vit_kernels
    from vit_kernels import _ext
    import importlib; importlib.import_module("vit_kernels._ext")  # a second import must not warn again
print(json.dumps({"warnings": [[w.category.__name__, str(w.message)] for w in caught],
                  "reason": _ext.extension_unavailable_reason(), "loaded": _ext.LOADED,
                  "backends": vit_kernels.available_backends()}))
"""


def _import_with(prelude: str, tmp_path: Path) -> dict:
    broken = tmp_path / "_C.cpython-311-x86_64-linux-gnu.so"
    broken.write_bytes(b"not an ELF file\n" * 8)
    code = f"BROKEN_SO = {str(broken)!r}\n" + prelude + REPORT
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _load_warnings(found: dict) -> list[str]:
    return [message for category, message in found["warnings"] if category == "ExtensionLoadWarning"]


def test_a_built_extension_that_fails_to_load_warns_once_with_the_rebuild_command(tmp_path):
    found = _import_with(BROKEN, tmp_path)
    messages = _load_warnings(found)
    assert len(messages) == 1, found["warnings"]
    message = messages[0]
    assert str(tmp_path / "_C.cpython-311-x86_64-linux-gnu.so") in message, message
    assert "failed to load (ImportError:" in message, message
    assert f"-m pip install --no-build-isolation --no-deps -e {ROOT}" in message, message
    assert not found["loaded"] and "failed to load" in found["reason"]
    assert all(why == found["reason"] for why in found["backends"]["extension"].values()), found["backends"]


def test_an_extension_never_built_does_not_warn(tmp_path):
    found = _import_with(ABSENT, tmp_path)
    assert _load_warnings(found) == [], found["warnings"]
    assert not found["loaded"] and "is not built" in found["reason"]
    assert all(why == found["reason"] for why in found["backends"]["extension"].values()), found["backends"]


def test_the_warning_is_shown_by_default_at_import(tmp_path):
    """Python's default filters show a UserWarning subclass: nothing has to opt in to see it."""
    broken = tmp_path / "_C.so"
    broken.write_bytes(b"\0" * 64)
    code = f"BROKEN_SO = {str(broken)!r}\n" + BROKEN + "import vit_kernels\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    shown = [line for line in done.stderr.splitlines() if "ExtensionLoadWarning" in line]
    assert len(shown) == 1, done.stderr


def test_rebuild_command_names_this_interpreter_and_the_checkout(tmp_path):
    assert (
        _ext.rebuild_command() == f"{sys.executable} -m pip install --no-build-isolation --no-deps -e {ROOT}"
    )
    installed = tmp_path / "site-packages" / "vit_kernels"  # a wheel install: no setup.py beside the package
    installed.mkdir(parents=True)
    assert "--force-reinstall" in _ext.rebuild_command(installed) and " -e " not in _ext.rebuild_command(
        installed
    )
