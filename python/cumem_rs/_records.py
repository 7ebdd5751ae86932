"""`CuMemAllocator.pointer_to_data`: vLLM's per-allocation records, read live from the core allocator.

vLLM's allocator keeps `pointer_to_data: dict[int, AllocationData]` and code written for it reads that dict: memory
breakdowns sum `data.handle[1]` per `data.tag`, vLLM's tests sum the mapped bytes of the records that are not
`is_asleep`. Here the records belong to the Rust core, so `AllocationRecords` is a read-only mapping that asks the
core at every access (a lookup for `records[ptr]` and `ptr in records`, one snapshot per `len()` or walk over
keys, values or items): it never goes stale, and the core copies its records out without the GIL, so a torch
thread waiting in `my_malloc` for the allocator's lock is never stuck behind Python.

An `AllocationData` is what the core said of one allocation when it was read, in vLLM's field names:

* `handle`: `(device, size, pointer, 0)`. `size` is the mapped size (the request rounded up to the granularity),
  as in vLLM. The 4th item, vLLM's driver handle, is always `NO_DRIVER_HANDLE` (0): the physical memory belongs to
  cumem_rs, changes at every wake, and is never handed out; 0 is never a valid `CUmemGenericAllocationHandle`, so
  code that releases `handle[3]` itself fails in the driver instead of releasing memory cumem_rs owns.
* `tag`, `is_asleep`; and `backed_up` (ours): asleep with a backup that the next wake restores.
* `cpu_backup_tensor`: None while awake (as in vLLM, where a wake drops it) and where there is no backup; for an
  asleep allocation whose backup is raw host memory, a CPU uint8 tensor of `size` bytes over that backup itself
  (no copy, like `get_cpu_backup(x, zero_copy=True)` of `cumem_rs.memory_saver`): writing it changes what the next
  wake restores, as in vLLM. None also where the backup is compressed or in a file (no raw host bytes exist:
  `backed_up` says it is there). Read at each access, never cached.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, Mapping, ValuesView
from typing import Final, Optional

import torch

from ._native import Allocator
from ._tms_backup import tensor_over

#: The 4th item of every `AllocationData.handle` (see the module doc).
NO_DRIVER_HANDLE = 0

# Fields of a core record tuple (`Allocator.records`).
_ADDRESS: Final = 0
_SIZE: Final = 1
_DEVICE: Final = 2
_TAG: Final = 3
_ASLEEP: Final = 4
_BACKED_UP: Final = 5


class AllocationData:
    """One allocation as the core allocator described it when read (vLLM's `AllocationData`, read-only)."""

    __slots__ = ("_native", "handle", "tag", "is_asleep", "backed_up")

    _native: Allocator
    handle: tuple[int, int, int, int]
    tag: str
    is_asleep: bool
    backed_up: bool

    def __init__(self, native: Allocator, record: tuple) -> None:
        init = object.__setattr__  # the fields are read-only (__setattr__)
        init(self, "_native", native)
        init(self, "handle", (record[_DEVICE], record[_SIZE], record[_ADDRESS], NO_DRIVER_HANDLE))
        init(self, "tag", record[_TAG])
        init(self, "is_asleep", record[_ASLEEP])
        init(self, "backed_up", record[_BACKED_UP])

    def __setattr__(self, name: str, value: object) -> None:
        # A write here would change nothing in the allocator: say so rather than let it pass silently.
        raise AttributeError(
            f"AllocationData is read-only ({name!r}): cumem_rs's records change only through the allocator's calls"
        )

    @property
    def cpu_backup_tensor(self) -> Optional[torch.Tensor]:
        """The raw host backup of this asleep allocation as a CPU uint8 tensor over it, or None (module doc)."""
        _, size, address, _ = self.handle
        now = self._native.records(address)  # the state now, not when this record was read
        if now is None or not now[_ASLEEP] or not now[_BACKED_UP]:
            return None
        view = self._native.view_backup(address, size, writable=True)
        return None if view is None else tensor_over(view, size, torch.uint8, (size,))

    def __repr__(self) -> str:
        state = "asleep" + (", backed up" if self.backed_up else "") if self.is_asleep else "awake"
        return f"AllocationData(handle={self.handle!r}, tag={self.tag!r}, {state})"


class _Values(ValuesView):
    def __init__(self, native: Allocator, records: "AllocationRecords") -> None:
        super().__init__(records)
        self._native = native

    def __iter__(self) -> Iterator[AllocationData]:
        native = self._native
        return (AllocationData(native, r) for r in native.records())


class _Items(ItemsView):
    def __init__(self, native: Allocator, records: "AllocationRecords") -> None:
        super().__init__(records)
        self._native = native

    def __iter__(self) -> Iterator[tuple[int, AllocationData]]:
        native = self._native
        return ((r[_ADDRESS], AllocationData(native, r)) for r in native.records())


class AllocationRecords(Mapping):
    """Read-only live mapping: pointer of each live allocation -> its `AllocationData` (module doc)."""

    __slots__ = ("_native",)

    def __init__(self, native: Allocator) -> None:
        self._native = native

    @property
    def native(self) -> Allocator:
        return self._native

    def _record(self, key: object) -> Optional[tuple]:
        # Anything that cannot be a pointer is simply not a key (a Mapping answers KeyError / False, not TypeError).
        if not isinstance(key, int) or isinstance(key, bool) or key < 0:
            return None
        return self._native.records(key)

    def __getitem__(self, key: object) -> AllocationData:
        record = self._record(key)
        if record is None:
            raise KeyError(key)
        return AllocationData(self._native, record)

    def __contains__(self, key: object) -> bool:
        return self._record(key) is not None

    def __iter__(self) -> Iterator[int]:
        return iter([r[_ADDRESS] for r in self._native.records()])

    def __len__(self) -> int:
        return len(self._native.records())

    # One snapshot per walk, not one lookup per key.
    def values(self) -> _Values:
        return _Values(self._native, self)

    def items(self) -> _Items:
        return _Items(self._native, self)

    def __repr__(self) -> str:
        return f"<cumem_rs pointer_to_data: {len(self)} allocations>"


__all__ = ["NO_DRIVER_HANDLE", "AllocationData", "AllocationRecords"]
