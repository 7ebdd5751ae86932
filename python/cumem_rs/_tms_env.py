"""torch_memory_saver 0.0.10's environment variables, read as it reads them (for `cumem_rs.memory_saver`).

torch_memory_saver reads every `TMS_*` variable lazily, at its first use after import (its C++ singleton and
per-thread config are built on the first call into the library), never at import. `cumem_rs.memory_saver` reads
them once, when a saver initialises (`_ensure_initialized()`, the first call that needs the allocator), so a
script may still set them after `import`. One exception: with the preload hook library loaded, a valid
`TMS_INIT_ENABLE=1` already in the environment at the import of `cumem_rs.memory_saver` starts routing then, as
torch_memory_saver's hook routes from the first allocation. Values are checked: torch_memory_saver exits the
process on a bad boolean; here it is a `CumemValueError` naming the variable.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from ._native import CumemValueError

# torch_memory_saver's get_bool_env_var: exactly these spellings; anything else (even "") is an error there.
_TRUE = ("1", "true", "TRUE", "yes", "YES")
_FALSE = ("0", "false", "FALSE", "no", "NO")
CPU_BACKUP_BACKENDS = ("mmap", "pinned")
#: torch_memory_saver's disk staging chunk when TMS_DISK_BACKUP_CHUNK_MB is unset or 0.
DEFAULT_DISK_CHUNK_MB = 256
# A number is ASCII digits, as torch_memory_saver reads it: str.isdigit() (and \d) take other scripts' digits and
# superscripts too, which int() reads as a number nobody typed or rejects with a bare ValueError.
_ASCII_DIGITS = re.compile(r"[0-9]+", re.ASCII)
_ASCII_SPACE = " \t\n\r\f\v"

def _bool(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name)
    if value is None:
        return False
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise CumemValueError(f"{name} must be one of {_TRUE + _FALSE} (or unset), got {value!r}")


@dataclass(frozen=True)
class TmsEnv:
    """The `TMS_*` settings of one saver, with torch_memory_saver's defaults."""

    #: TMS_INIT_ENABLE: route every thread's allocations outside regions too, under the default tag (preload mode
    #: only: the hook library must be loaded in the process).
    init_enable: bool = False
    #: TMS_INIT_ENABLE_CPU_BACKUP / TMS_INIT_ENABLE_DISK_BACKUP: the backup of allocations outside regions, which
    #: only TMS_INIT_ENABLE routes (regions always say their own).
    init_enable_cpu_backup: bool = False
    init_enable_disk_backup: bool = False
    #: TMS_INIT_CPU_BACKUP_BACKEND: the backend of CPU-backup regions that do not name one ("pinned" when unset).
    init_cpu_backup_backend: str = "pinned"
    #: TMS_RETAIN_CPU_BACKUP: the initial `retain_cpu_backup`.
    retain_cpu_backup: bool = False
    #: TMS_DISK_BACKUP_DIR: the spill directory of disk-backup regions (None: the system temp directory).
    disk_backup_dir: Optional[str] = None
    #: TMS_DISK_BACKUP_CHUNK_MB: the file tier's staging ring size in MiB (None: unset, the allocator's own).
    disk_backup_chunk_mb: Optional[int] = None


def read_tms_env(env: Mapping[str, str]) -> TmsEnv:
    """Parse and check the `TMS_*` variables of `env` (os.environ). Raises CumemValueError naming a variable with a
    bad value."""
    backend = env.get("TMS_INIT_CPU_BACKUP_BACKEND") or "pinned"  # unset or empty: pinned, as there
    if backend not in CPU_BACKUP_BACKENDS:
        raise CumemValueError(f"TMS_INIT_CPU_BACKUP_BACKEND must be 'mmap' or 'pinned' (or unset), got {backend!r}")
    chunk: Optional[int] = None
    raw_chunk = env.get("TMS_DISK_BACKUP_CHUNK_MB")
    if raw_chunk is not None:
        text = raw_chunk.strip(_ASCII_SPACE)
        if _ASCII_DIGITS.fullmatch(text) is None:
            raise CumemValueError(
                f"TMS_DISK_BACKUP_CHUNK_MB must be a whole number of MiB (0: the default {DEFAULT_DISK_CHUNK_MB}), "
                f"got {raw_chunk!r}"
            )
        chunk = int(text) or DEFAULT_DISK_CHUNK_MB  # 0 means the default there too
    disk_dir = env.get("TMS_DISK_BACKUP_DIR")
    if disk_dir is not None and not disk_dir:
        raise CumemValueError("TMS_DISK_BACKUP_DIR must name a directory, got an empty string")
    parsed = TmsEnv(
        init_enable=_bool(env, "TMS_INIT_ENABLE"),
        init_enable_cpu_backup=_bool(env, "TMS_INIT_ENABLE_CPU_BACKUP"),
        init_enable_disk_backup=_bool(env, "TMS_INIT_ENABLE_DISK_BACKUP"),
        init_cpu_backup_backend=backend,
        retain_cpu_backup=_bool(env, "TMS_RETAIN_CPU_BACKUP"),
        disk_backup_dir=disk_dir,
        disk_backup_chunk_mb=chunk,
    )
    if parsed.init_enable_cpu_backup and parsed.init_enable_disk_backup:
        # torch_memory_saver refuses this pair at the first allocation; here at once.
        raise CumemValueError(
            "TMS_INIT_ENABLE_CPU_BACKUP and TMS_INIT_ENABLE_DISK_BACKUP are mutually exclusive; set at most one"
        )
    return parsed

