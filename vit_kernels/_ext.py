"""Loads the compiled extension ``vit_kernels._C`` when it was built, and says why when it was not.

The package works without it: the ``extension`` backend then reports itself unavailable and
``auto`` never picks it.
"""

from __future__ import annotations

import importlib
from typing import Optional

from vit_kernels import backend

_C = None
_load_error: Optional[str] = None

try:
    _C = importlib.import_module("vit_kernels._C")
except ImportError as error:  # not built (VIT_KERNELS_SKIP_EXT=1, no compiler) or built for another torch
    _load_error = f"the compiled extension vit_kernels._C is not built or failed to load ({error})"


def extension_unavailable_reason() -> Optional[str]:
    """None when ``vit_kernels._C`` is loaded, else why it is not."""
    return _load_error


backend.register_backend_check("extension", extension_unavailable_reason)
