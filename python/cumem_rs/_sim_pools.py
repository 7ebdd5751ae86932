"""The part of `CuMemAllocator` that `cumem_rs.memory_saver` uses, over a simulated `Allocator`.

On a GPU the saver routes torch allocations through `CuMemAllocator.use_memory_pool`. Without one, this class
stands in for it over `Allocator.simulated()`: a region pushes its tag on the allocator's tag stack, so the
`Allocator.malloc` calls made inside are tagged as torch's allocations are on a GPU, and pause, resume, tag
policies, host memory and the file tier are the same engine calls. Used by the saver's CPU-only tests (and by
anyone testing pause/resume logic in CPU-only CI); torch tensors, `cuda_graph` and `disable` need a GPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Optional, Union

from ._native import Allocator
from ._pools import check_tag
from .results import BackupTier, Compress, Report, WakeFill


class SimulatedPools:
    """`CuMemAllocator`'s pool, policy and pause/resume calls over a simulated `Allocator`."""

    def __init__(self, native: Allocator) -> None:
        self._native = native

    @property
    def native(self) -> Allocator:
        return self._native

    @contextlib.contextmanager
    def use_memory_pool(self, tag: Optional[str] = None) -> Iterator[None]:
        self._native.push_tag("default" if tag is None else check_tag(tag))
        try:
            yield
        finally:
            self._native.pop_tag()

    def set_tag_policy(
        self,
        tag: str,
        backup: Optional[bool] = None,
        wake_fill: WakeFill = "undefined",
        backup_tier: BackupTier = "auto",
        compress: Compress = "auto",
    ) -> None:
        self._native.set_tag_policy(check_tag(tag), backup, wake_fill, backup_tier, compress)

    def pause(self, tags: Optional[list[str]] = None) -> Report:
        return self._native.pause(tags)

    def resume(self, tags: Optional[list[str]] = None) -> Report:
        return self._native.resume(tags)

    def set_spill_dir(self, path: Optional[Union[str, "os.PathLike[str]"]]) -> None:
        self._native.set_spill_dir(path)

    def set_staging_bytes(self, nbytes: int) -> None:
        self._native.set_staging_bytes(nbytes)
