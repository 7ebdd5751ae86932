"""torch_memory_saver's C-level configuration getters, over `cumem_rs.memory_saver`'s own state.

torch_memory_saver keeps, per thread, whether allocations are routed ("interesting region"), under which tag,
with or without CPU backup and with which backup backend, and its own tests read that state through
`torch_memory_saver._impl._binary_wrapper.cdll.tms_get_*()`. Here the same state lives in Python (the saver's
region stack per thread, `disable()`, TMS_INIT_ENABLE), so these getters read it from there: thin wrappers with the
names, arguments and return types (bool, bytes) that those callers use. Any other attribute of `cdll` is looked
up in the process's global symbol scope (the CUDA runtime that torch loaded, the preload library's `tms_pause`),
as on torch_memory_saver's library handle."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

#: torch_memory_saver's tag outside any region.
DEFAULT_TAG = "default"


@dataclass(frozen=True)
class RegionState:
    """What a region (or TMS_INIT_ENABLE outside regions) routes: the API's tag, backup and backend."""

    tag: str
    cpu_backup: bool
    backend: str


class ThreadStates(threading.local):
    """Per thread: the stack of active regions, and whether `disable()` is in force."""

    def __init__(self) -> None:
        self.regions: list[RegionState] = []
        self.disabled = 0


class CState:
    """The `cdll` of `_impl._binary_wrapper`: the getters as functions of no arguments."""

    def __init__(self, current: Callable[[], Optional[RegionState]], outside: Callable[[], RegionState]) -> None:
        self._current = current  # the routed state of this thread, None when nothing is routed
        self._outside = outside  # what this thread would have outside regions (tag and backend when not routed)
        self._global = ctypes.CDLL(None)

    def _state(self) -> tuple[bool, RegionState]:
        state = self._current()
        return (True, state) if state is not None else (False, self._outside())

    def tms_get_interesting_region(self) -> bool:
        return self._state()[0]

    def tms_get_enable_cpu_backup(self) -> bool:
        routed, state = self._state()
        return routed and state.cpu_backup

    def tms_get_current_tag(self) -> bytes:
        return self._state()[1].tag.encode()

    def tms_get_cpu_backup_backend(self) -> bytes:
        return self._state()[1].backend.encode()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._global, name)


class BinaryWrapper:
    def __init__(self, cdll: CState) -> None:
        self.cdll = cdll


class Impl:
    """`TorchMemorySaver._impl`: only the `_binary_wrapper.cdll` that torch_memory_saver's tests read."""

    def __init__(self, cdll: CState) -> None:
        self._binary_wrapper = BinaryWrapper(cdll)
