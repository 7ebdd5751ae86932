"""malloc/free per call: `Allocator.malloc`/`free` directly and `torch.empty` inside `use_memory_pool`, against raw
driver calls (ctypes on libcuda: no extra dependency, and no caching layer in between). The raw driver is also the
reference of the discard rows (unmap + release of the KV cache, create + map on its wake)."""

from __future__ import annotations

import ctypes
import gc
import random
from typing import Optional

from ..workload import MiB, round_up
from .common import Context, each, timed
from .subjects import sim_allocator

DEFAULT_MALLOC_COUNT = 500

# ---------------------------------------------------------------------------------------------------------------
# Raw CUDA driver calls.


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):
    # CUmemAllocationProp (unchanged since CUDA 11); the trailing pad is zeroes the driver never reads.
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Loc),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags),
                ("_pad", ctypes.c_ubyte * 32)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Loc), ("flags", ctypes.c_int)]


class RawDriver:
    """cuMemAddressReserve/Create/Map/SetAccess and their inverses, straight from libcuda.so.1."""

    def __init__(self, device: int):
        lib = ctypes.CDLL("libcuda.so.1")
        u64, sz, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
        sigs = {
            "cuCtxGetCurrent": [ctypes.POINTER(vp)],
            "cuCtxSetCurrent": [vp],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), ctypes.c_int],
            "cuMemGetAllocationGranularity": [ctypes.POINTER(sz), ctypes.POINTER(_Prop), ctypes.c_int],
            "cuMemAddressReserve": [ctypes.POINTER(u64), sz, sz, u64, ctypes.c_ulonglong],
            "cuMemAddressFree": [u64, sz],
            "cuMemCreate": [ctypes.POINTER(u64), sz, ctypes.POINTER(_Prop), ctypes.c_ulonglong],
            "cuMemRelease": [u64],
            "cuMemMap": [u64, sz, sz, u64, ctypes.c_ulonglong],
            "cuMemUnmap": [u64, sz],
            "cuMemSetAccess": [u64, sz, ctypes.POINTER(_AccessDesc), sz],
        }
        for name, argtypes in sigs.items():
            f = getattr(lib, name)
            f.argtypes = argtypes
            f.restype = ctypes.c_int
        self.lib = lib
        ctx = vp()
        self._check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            self._check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
            self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self._check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.prop = _Prop(type=1, requestedHandleTypes=0, location=_Loc(1, device))  # pinned, device memory
        self.access = _AccessDesc(location=_Loc(1, device), flags=3)  # read-write
        g = sz()
        self._check(lib.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(self.prop), 0), "granularity")
        self.granularity = g.value

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUresult {rc}")

    def reserve(self, size: int) -> int:
        p = ctypes.c_uint64()
        self._check(self.lib.cuMemAddressReserve(ctypes.byref(p), size, 0, 0, 0), "cuMemAddressReserve")
        return p.value

    def create(self, size: int) -> int:
        h = ctypes.c_uint64()
        self._check(self.lib.cuMemCreate(ctypes.byref(h), size, ctypes.byref(self.prop), 0), "cuMemCreate")
        return h.value

    def map(self, ptr: int, size: int, handle: int) -> None:
        self._check(self.lib.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")

    def set_access(self, ptr: int, size: int) -> None:
        self._check(self.lib.cuMemSetAccess(ptr, size, ctypes.byref(self.access), 1), "cuMemSetAccess")

    def create_map(self, ptr: int, size: int) -> int:
        h = self.create(size)
        self.map(ptr, size, h)
        self.set_access(ptr, size)
        return h

    def unmap_release(self, ptr: int, size: int, handle: int) -> None:
        self._check(self.lib.cuMemUnmap(ptr, size), "cuMemUnmap")
        self._check(self.lib.cuMemRelease(handle), "cuMemRelease")

    def address_free(self, ptr: int, size: int) -> None:
        self._check(self.lib.cuMemAddressFree(ptr, size), "cuMemAddressFree")

    def malloc(self, size: int) -> tuple[int, int, int]:
        size = round_up(size, self.granularity)
        ptr = self.reserve(size)
        return ptr, size, self.create_map(ptr, size)

    def free(self, ptr: int, size: int, handle: int) -> None:
        self.unmap_release(ptr, size, handle)
        self.address_free(ptr, size)


def raw_kv_baseline(ctx: Context, nbytes: int) -> Optional[tuple[float, float]]:
    """(create+map+access, unmap+release) seconds of one raw allocation of `nbytes`, measured once per run and
    size; None (with a skipped row) when the driver's symbols are not usable, or on the simulated device."""

    def measure() -> Optional[tuple[float, float]]:
        if not ctx.gpu:
            ctx.res.skipped("raw driver unmap/release, create/map", "no GPU")
            return None
        try:
            raw = RawDriver(ctx.device)
            size = round_up(nbytes, raw.granularity)
            ptr = raw.reserve(size)
            handle, tc = timed(lambda: raw.create_map(ptr, size), ctx.sync)
            _, tu = timed(lambda: raw.unmap_release(ptr, size, handle), ctx.sync)
            raw.address_free(ptr, size)
        except Exception as e:  # the rows of our own calls still count
            ctx.res.skipped("raw cuMemUnmap+cuMemRelease", f"{e}")
            return None
        ctx.res.metrics.update(raw_unmap_release_kv_s=tu, raw_create_map_kv_s=tc)
        return tc, tu

    return ctx.cached(("raw_kv", nbytes), measure)


# ---------------------------------------------------------------------------------------------------------------
# The table.


def malloc_sizes(count: int, scale: int, seed: int = 1) -> list[int]:
    """`count` sizes uniform in [1, 64] MiB, divided by `scale` (what a model load requests)."""
    rng = random.Random(seed)
    return [max(1, rng.randint(1 * MiB, 64 * MiB) // scale) for _ in range(count)]


def run(ctx: Context) -> None:
    ctx.res.section(f"malloc/free, {ctx.args.malloc_count} allocations of 1-64 MiB"
                    + (f" / {ctx.scale}" if ctx.scale > 1 else ""))
    sizes = malloc_sizes(ctx.args.malloc_count, ctx.scale)
    if ctx.gpu:
        _rows_cuda(ctx, sizes)
    else:
        _rows_sim(ctx, sizes)


def _rows_sim(ctx: Context, sizes: list[int]) -> None:
    res = ctx.res
    alloc = sim_allocator(ctx.scale, sizes)
    try:
        batch, tm = timed(lambda: [alloc.malloc(s) for s in sizes])
        _, tf = timed(lambda: each(alloc.free, batch))
        n = len(sizes)
        res.latency("malloc_ours", f"Allocator.malloc, {n} x 1-64 MiB/{ctx.scale}, per call", tm / n)
        res.latency("free_ours", "Allocator.free, per call", tf / n)
        res.skipped("torch pool, raw driver malloc/free", "no GPU")
        ctx.add_errors(alloc.errors())
    finally:
        alloc.close()


def _rows_cuda(ctx: Context, sizes: list[int]) -> None:
    from .. import Allocator
    from ..allocator import CuMemAllocator

    res, torch, device = ctx.res, ctx.torch, ctx.device
    cumem = CuMemAllocator.get_instance()
    core = Allocator.cuda()
    n = len(sizes)
    label = f"{n} x 1-64 MiB"
    raw: Optional[RawDriver]
    try:
        raw = RawDriver(device)
    except Exception as e:  # no libcuda symbols we need: keep the other rows
        raw = None
        res.skipped("raw driver reserve+create+map+access", f"{e}")
    raw_m: Optional[float] = None
    raw_f: Optional[float] = None
    # Two rounds, raw and ours in turn; the second counts (the first warms the driver's own pools up for both).
    for _ in range(2):
        if raw is not None:
            allocs, tm = timed(lambda: [raw.malloc(s) for s in sizes])
            _, tf = timed(lambda: each(lambda a: raw.free(*a), allocs))
            raw_m, raw_f = tm / n, tf / n
        addrs, ours_m = timed(lambda: [core.malloc(s, device) for s in sizes])
        _, ours_f = timed(lambda: each(core.free, addrs))
    if raw_m is not None and raw_f is not None:
        res.latency("malloc_raw", f"raw driver reserve+create+map+access, {label}, per call", raw_m)
        res.latency("free_raw", "raw driver unmap+release+address free, per call", raw_f)
    res.latency("malloc_ours", f"Allocator.malloc, {label}, per call", ours_m / n, raw_m,
                "raw driver (target <= 1.1)")
    res.latency("free_ours", "Allocator.free, per call", ours_f / n, raw_f, "raw driver (target <= 1.1)")

    # The path model loading takes: torch.empty inside use_memory_pool, whose MemPool is dropped at the end of the
    # block; the segments go back through my_free once their tensors die and torch empties its cache.
    before = len(core.allocations())

    def alloc_all() -> list:
        with cumem.use_memory_pool(tag="malloc_bench"):
            return [torch.empty(s, dtype=torch.uint8, device=device) for s in sizes]

    tensors, tm = timed(alloc_all, ctx.sync)
    segments = len(core.allocations()) - before

    def release() -> None:
        nonlocal tensors
        tensors = []
        gc.collect()
        torch.cuda.empty_cache()

    _, tf = timed(release, ctx.sync)
    left = len(core.allocations()) - before
    res.latency("malloc_torch_pool", f"torch.empty in use_memory_pool, {label}, per tensor", tm / n, raw_m,
                f"raw driver per call; {segments} my_malloc segments")
    res.latency("free_torch_pool", "del tensors + empty_cache, per tensor", tf / n, raw_f,
                "raw driver per call" + (f"; {left} segments NOT released" if left else ""))
