"""The environment variables the Python side reads, by name, and how: one place. The Rust side's are read in
`rust/src/env.rs`; torch_memory_saver's `TMS_*` variables in `_tms_env.py` (read as it reads them); torch's own
allocator settings in `_pools.py`. A switch is parsed by the Rust side's one parser (`_native.env_flag`), so that
a spelling (1/true/yes/on, 0/false/no/off, any case) means the same on both sides. docs/configuration.md lists
every CUMEM_RS_* name (tests/test_doc_blocks.py checks it against the code)."""

from __future__ import annotations

import os
from typing import Optional

#: Garbage collection before each CuMemAllocator sleep: "full", "young" (default) or "off".
SLEEP_GC = "CUMEM_RS_SLEEP_GC"
#: Pin the backups of the weights' tags ahead of the first sleep (a switch, default on).
PIN_AHEAD = "CUMEM_RS_PIN_AHEAD"
#: Compress host backups where nvCOMP is found (a switch, default on; the Rust side reads it too).
COMPRESS = "CUMEM_RS_COMPRESS"
#: The nvCOMP library to open instead of the installed wheel's (a path; the Rust side opens it).
NVCOMP_LIB = "CUMEM_RS_NVCOMP_LIB"
#: Retained backups (a switch, default on): read by the Rust side; the bench reads it to know the default.
RETAIN_BACKUPS = "CUMEM_RS_RETAIN_BACKUPS"
#: Route vLLM's sleep-mode allocator to cumem_rs (1) or never (0) whatever vLLM's config says; unset: the config.
VLLM = "CUMEM_RS_VLLM"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(name: str, default: bool) -> bool:
    """The switch `name` (unset, empty or unknown: `default`; an unknown spelling is logged by the Rust side)."""
    from . import _native  # the extension: imported when a switch is read, not with this module

    return _native.env_flag(name, default)


def text(name: str, default: str = "") -> str:
    """The value of `name` as it is set, else `default`."""
    return os.environ.get(name, default)


def choice(name: str, meaning: str) -> Optional[bool]:
    """A switch that may be left unset: None when unset or empty; ValueError naming `name` and what its values
    mean (`meaning`) for any other spelling than a switch's (a choice mistyped must not fall back silently)."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return None
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected {meaning}")
