"""The package's on/off environment switches (``VIT_KERNELS_TUNE``, ``VIT_KERNELS_PROVE_TILES``,
``VIT_KERNELS_DIRECT_LAUNCH``), each read once at import, all the same way."""

from __future__ import annotations

import os

FALSE_WORDS = ("0", "false", "no", "off")
TRUE_WORDS = ("1", "true", "yes", "on")


def flag(name: str, default: bool) -> bool:
    """Environment variable ``name`` as a switch, case and surrounding spaces ignored: a switch on by
    default is off only for 0, false, no or off; one off by default is on only for 1, true, yes or
    on."""
    text = os.environ.get(name, "").strip().lower()
    return text not in FALSE_WORDS if default else text in TRUE_WORDS


# Set (to 1) only in the environment of a tile-proof child (``vit_kernels._proof``), which replays
# kernel launches: its ``import vit_kernels`` skips the public API and the op registrations.
PROOF_CHILD = "_VIT_KERNELS_PROOF_CHILD"
