"""The file system's own sequential write and read rate, the reference of the file_tier table's ratios.

Plain `pwrite`/`pread` of pinned host memory (a pinned torch tensor on the GPU; page-aligned anonymous memory on
the simulated device, where nothing is pinned) into one file of the measured size in the spill directory, with
`O_DIRECT` where the file system takes it (buffered I/O otherwise, said in the row, with the page cache dropped
for the file before reading it back). The blocks are the staging ring's slots and as many are in flight as the
file tier keeps (one thread per block, consecutive offsets), so the reference asks the disk for what the file
tier asks of it, minus everything the allocator adds. Median of three runs.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

#: O_DIRECT wants buffer, length and offset aligned to the logical block size; 4 KiB covers the file systems in use.
IO_ALIGN = 4096
#: Blocks in flight: the file tier's I/O threads per pipeline (rust/src/backups/file_tier.rs).
IN_FLIGHT = 4


@dataclass
class FsRate:
    nbytes: int
    write_s: float
    read_s: float
    direct: bool
    block: int

    @property
    def write_gbps(self) -> float:
        return self.nbytes / self.write_s / 1e9

    @property
    def read_gbps(self) -> float:
        return self.nbytes / self.read_s / 1e9


class _Blocks:
    """`count` blocks of `size` page-aligned host bytes: pinned by torch on the GPU, else anonymous mmaps."""

    def __init__(self, count: int, size: int, torch: Any = None):
        self._keep: list[Any] = []
        self.views: list[memoryview] = []
        for _ in range(count):
            if torch is not None:
                t = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                if t.data_ptr() % IO_ALIGN:
                    raise RuntimeError("torch's pinned block is not page-aligned")
                self._keep.append(t)
                view = memoryview((ctypes.c_char * size).from_address(t.data_ptr())).cast("B")
            else:
                m = mmap.mmap(-1, size)
                self._keep.append(m)
                view = memoryview(m)
            view[:] = os.urandom(min(size, 1 << 20)) * (size // (1 << 20)) + os.urandom(size % (1 << 20))
            self.views.append(view)

    def close(self) -> None:
        for v in self.views:
            v.release()
        for k in self._keep:
            if isinstance(k, mmap.mmap):
                k.close()
        self.views, self._keep = [], []


def _open(directory: str) -> tuple[int, bool]:
    """An unlinked file in `directory`, opened with O_DIRECT when the file system takes it."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
    path = os.path.join(directory, f".cumem_rs_bench_{os.getpid()}_{threading.get_ident()}")
    direct = getattr(os, "O_DIRECT", 0)
    try:
        fd, used = os.open(path, flags | direct, 0o600), bool(direct)
    except OSError:
        fd, used = os.open(path, flags, 0o600), False
    os.unlink(path)
    return fd, used


def _io(fd: int, blocks: _Blocks, nbytes: int, block: int, write: bool) -> float:
    """Seconds to write (or read) `nbytes` sequentially, IN_FLIGHT blocks at a time on consecutive offsets."""
    offsets = list(range(0, nbytes, block))
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        view = blocks.views[k]
        try:
            for off in offsets[k::len(blocks.views)]:
                n = min(block, nbytes - off)
                done = 0
                while done < n:
                    part = view[done:n]
                    got = os.pwrite(fd, part, off + done) if write else os.preadv(fd, [part], off + done)
                    if got <= 0:
                        raise OSError(f"{'pwrite' if write else 'pread'} made no progress at offset {off + done}")
                    done += got
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(blocks.views))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return seconds


def measure(directory: str, nbytes: int, block: int, torch: Any = None, reps: int = 3) -> FsRate:
    """Write then read `nbytes` (rounded up to IO_ALIGN) in `block`-byte pieces in a fresh file in `directory`,
    `reps` times (a fresh file each): the median write and read times."""
    runs = [_measure_once(directory, nbytes, block, torch) for _ in range(max(1, reps))]
    return FsRate(runs[0].nbytes, statistics.median(r.write_s for r in runs),
                  statistics.median(r.read_s for r in runs), all(r.direct for r in runs), runs[0].block)


def _measure_once(directory: str, nbytes: int, block: int, torch: Any = None) -> FsRate:
    block = max(IO_ALIGN, block // IO_ALIGN * IO_ALIGN)
    nbytes = max(IO_ALIGN, -(-nbytes // IO_ALIGN) * IO_ALIGN)
    count = max(1, min(IN_FLIGHT, -(-nbytes // block)))
    blocks = _Blocks(count, block, torch)
    fd: Optional[int] = None
    try:
        fd, direct = _open(directory)
        # No fsync in the timing: the file tier does not sync either (its files die with the process).
        write_s = _io(fd, blocks, nbytes, block, write=True)
        if not direct:
            os.fsync(fd)  # then drop the cached pages, so that the read comes from the disk
            os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
        read_s = _io(fd, blocks, nbytes, block, write=False)
        return FsRate(nbytes, write_s, read_s, direct, block)
    finally:
        if fd is not None:
            os.close(fd)
        blocks.close()
