"""Sleep/wake benchmark on the reference workload (see workload.py), every figure measured in one run.

On a GPU (backend "cuda"):
- the physical limit: torch `copy_` between a pinned host tensor and device memory, each way, same total bytes;
- sleep (offload "weights", discard "kv_cache") and wake: one cold first cycle, then the median of --cycles
  steady cycles, as GB/s of the offloaded bytes and as a ratio of the copy limit; data verified every cycle;
- host RAM held after wake under each `set_keep_host_memory` policy;
- discard of the KV cache alone (and its re-map) against raw cuMemUnmap+cuMemRelease (cuMemCreate+cuMemMap);
- 500 allocations of 1-64 MiB: torch.empty inside `use_memory_pool`, `Allocator.malloc`/`free` directly,
  all against raw driver calls (ctypes on libcuda: no extra dependency, and no caching layer in between);
- the same sleep/wake rows for torch_memory_saver when it is installed, in a child process (its default hook
  mode needs LD_PRELOAD, and it must not share the process with our pools).

On the simulated device (no GPU) the same sleep/wake, discard, host-policy and malloc rows run at a small scale
with a host memcpy as the limit, so CI can smoke-run the whole benchmark.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

from .workload import (
    add_workload_arguments,
    DEFAULT_KV_GIB,
    KV_TAG,
    MiB,
    WEIGHTS_TAG,
    AllocatorWorkload,
    TorchWorkload,
    VerificationError,
    reference_workload,
    round_up,
    sim_granularity,
    total_bytes,
)

DEFAULT_SIM_SCALE = 256
DEFAULT_CYCLES = 3
DEFAULT_MALLOC_COUNT = 500


# ---------------------------------------------------------------------------------------------------------------
# Formatting, shared with the demo.


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return ""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: Optional[float]) -> str:
    if s is None:
        return ""
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """A rich Table when rich is installed (it is an optional dependency), else aligned plain text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
        print(title)
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
        for r in rows:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
        return
    console = Console()
    if not console.is_terminal:
        # Piped output gets 80 columns by default, which would wrap the numbers.
        console = Console(width=160)
    table = Table(title=title)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 or i == len(columns) - 1 else "right")
    for r in rows:
        table.add_row(*r)
    console.print(table)


def say(msg: str) -> None:
    print(f"· {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Results: every number goes both into a table row and into a flat metrics dict (for --json).


class Results:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.metrics: dict[str, Any] = {}

    def bandwidth(self, key: str, name: str, nbytes: int, seconds: float, limit_gbps: Optional[float],
                  vs: str = "") -> float:
        gbps = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
        ratio = gbps / limit_gbps if limit_gbps else None
        self.metrics.update({f"{key}_s": seconds, f"{key}_gbps": gbps})
        if ratio is not None:
            self.metrics[f"{key}_ratio"] = ratio
        self.rows.append(dict(name=name, bytes=nbytes, seconds=seconds, gbps=gbps, ratio=ratio, vs=vs))
        return gbps

    def latency(self, key: str, name: str, seconds_per_op: float, baseline: Optional[float] = None,
                vs: str = "", nbytes: Optional[int] = None) -> None:
        ratio = seconds_per_op / baseline if baseline else None
        self.metrics[f"{key}_s"] = seconds_per_op
        if ratio is not None:
            self.metrics[f"{key}_ratio"] = ratio
        self.rows.append(dict(name=name, bytes=nbytes, seconds=seconds_per_op, gbps=None, ratio=ratio, vs=vs))

    def value(self, key: str, name: str, nbytes: int, vs: str = "") -> None:
        self.metrics[key] = nbytes
        self.rows.append(dict(name=name, bytes=nbytes, seconds=None, gbps=None, ratio=None, vs=vs))

    def skipped(self, name: str, reason: str) -> None:
        self.rows.append(dict(name=name, bytes=None, seconds=None, gbps=None, ratio=None, vs=f"skipped: {reason}"))

    def print(self, title: str) -> None:
        cells = []
        for r in self.rows:
            cells.append([
                r["name"],
                fmt_bytes(r["bytes"]),
                fmt_seconds(r["seconds"]),
                f"{r['gbps']:.2f}" if r["gbps"] is not None else "",
                f"{r['ratio']:.3f}x" if r["ratio"] is not None else "",
                r["vs"],
            ])
        print_table(title, ["measurement", "bytes", "time", "GB/s", "ratio", "ratio of / note"], cells)


def timed(fn: Callable[[], Any], sync: Callable[[], None] = lambda: None) -> tuple[Any, float]:
    """Run `fn` between two synchronisations and return (result, wall seconds)."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def _each(fn: Callable[[Any], None], items: list) -> None:
    for x in items:
        fn(x)


def malloc_sizes(count: int, scale: int, seed: int = 1) -> list[int]:
    """`count` sizes uniform in [1, 64] MiB, divided by `scale` (what a model load requests)."""
    rng = random.Random(seed)
    return [max(1, rng.randint(1 * MiB, 64 * MiB) // scale) for _ in range(count)]


# ---------------------------------------------------------------------------------------------------------------
# Simulated device.


def _memcpy_gbps(nbytes: int, reps: int = 3) -> float:
    """Host memcpy bandwidth over `nbytes`, the physical limit of the simulated device's copies."""
    src = bytearray(os.urandom(min(nbytes, 1 << 16))) * (nbytes // (1 << 16) + 1)
    dst = bytearray(len(src))
    cs = (ctypes.c_char * len(src)).from_buffer(src)
    cd = (ctypes.c_char * len(dst)).from_buffer(dst)
    ctypes.memmove(cd, cs, nbytes)  # first touch of dst
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ctypes.memmove(cd, cs, nbytes)
        times.append(time.perf_counter() - t0)
    del cs, cd
    return nbytes / statistics.median(times) / 1e9


def _sleep_wake_cycles(res: Results, sleep: Callable[[], Any], wake: Callable[[], Any], verify: Callable[[], Any],
                       mapped: Callable[[], int], cycles: int, wbytes: int, d2h: float, h2d: float,
                       sync: Callable[[], None] = lambda: None, gpu: bool = True) -> None:
    """One cold cycle, then `cycles` steady ones; every cycle checks that sleep left nothing mapped and that the
    weights came back bit-identical. The design targets are shown on the GPU only (the sim has no such target)."""
    down, up = ("device->host copy", "host->device copy") if gpu else ("memcpy", "memcpy")
    cold, steady = (" (target >= 0.6)", " (target >= 0.95)") if gpu else ("", "")
    sleeps: list[float] = []
    wakes: list[float] = []
    core_sleeps: list[Optional[float]] = []
    core_wakes: list[Optional[float]] = []
    for i in range(cycles + 1):
        rs, ts = timed(sleep, sync)
        left = mapped()
        if left != 0:
            raise VerificationError(f"sleep left {left} bytes mapped")
        rw, tw = timed(wake, sync)
        verify()
        sleeps.append(ts)
        wakes.append(tw)
        # The core's own timing (its report), to tell the cost of the layers above it from the copies.
        core_sleeps.append(float(rs["seconds"]) if isinstance(rs, dict) and "seconds" in rs else None)
        core_wakes.append(float(rw["seconds"]) if isinstance(rw, dict) and "seconds" in rw else None)
        say(f"cycle {i}: sleep {fmt_seconds(ts)}, wake {fmt_seconds(tw)}, weights verified")
    res.bandwidth("sleep_cold", "sleep, cold first (offload weights, discard kv)", wbytes, sleeps[0], d2h,
                  down + cold)
    res.bandwidth("wake_cold", "wake, first", wbytes, wakes[0], h2d, up)
    if cycles:
        res.bandwidth("sleep", f"sleep, steady (median of {cycles})", wbytes, statistics.median(sleeps[1:]), d2h,
                      down + steady)
        res.bandwidth("wake", f"wake, steady (median of {cycles})", wbytes, statistics.median(wakes[1:]), h2d,
                      up + steady)
        cs = [x for x in core_sleeps[1:] if x is not None]
        cw = [x for x in core_wakes[1:] if x is not None]
        if len(cs) == len(cw) == cycles:
            res.bandwidth("sleep_core", "sleep, steady, time inside the core (its report)", wbytes,
                          statistics.median(cs), d2h, down)
            res.bandwidth("wake_core", "wake, steady, time inside the core (its report)", wbytes,
                          statistics.median(cw), h2d, up)
    res.metrics.update(sleep_all_s=sleeps, wake_all_s=wakes, sleep_core_all_s=core_sleeps,
                       wake_core_all_s=core_wakes)


def _host_policy_rows(res: Results, core: Any, cycle: Callable[[], tuple[float, float]]) -> None:
    """Host RAM held after wake with keep_host_memory True (the default), then one cycle with False."""
    res.value("host_bytes_after_wake_keep", "host RAM held after wake, keep_host_memory=True", core.host_bytes(),
              "cached for the next sleep")
    core.set_keep_host_memory(False)
    try:
        ts, _ = cycle()
        res.value("host_bytes_after_wake_nokeep", "host RAM held after wake, keep_host_memory=False",
                  core.host_bytes(), "returned to the OS")
        res.metrics["sleep_nokeep_s"] = ts
    finally:
        core.set_keep_host_memory(True)


def bench_sim(args: argparse.Namespace) -> Results:
    from . import Allocator

    scale = args.scale or DEFAULT_SIM_SCALE
    specs = reference_workload(scale, args.kv_gib)
    gran = sim_granularity(scale)
    sizes = malloc_sizes(args.malloc_count, scale)
    # Room for the workload and the malloc batch at once, each rounded as the device rounds it.
    capacity = sum(round_up(s.nbytes, gran) for s in specs) + sum(round_up(s, gran) for s in sizes) + 16 * gran
    wbytes = total_bytes(specs, WEIGHTS_TAG)
    res = Results()
    res.metrics.update(backend="sim", scale=scale, weights_bytes=wbytes, kv_bytes=total_bytes(specs, KV_TAG),
                       tensors=len(specs), granularity=gran)
    say(f"simulated device: scale 1/{scale}, {len(specs)} tensors, weights {fmt_bytes(wbytes)}, "
        f"granularity {fmt_bytes(gran)}, capacity {fmt_bytes(capacity)}")

    limit = _memcpy_gbps(wbytes)
    res.bandwidth("copy_limit", "host memcpy (the limit on the simulated device)", wbytes, wbytes / limit / 1e9,
                  None, "")
    alloc = Allocator.simulated(capacity=capacity, granularity=gran)
    try:
        wl = AllocatorWorkload(alloc, specs)
        wl.allocate()
        wl.fill(WEIGHTS_TAG)
        addrs = list(wl.addresses)

        def verify() -> None:
            wl.verify(WEIGHTS_TAG, addrs)

        _sleep_wake_cycles(res, lambda: alloc.sleep(WEIGHTS_TAG), alloc.wake_up, verify, alloc.usage,
                           args.cycles, wbytes, limit, limit, gpu=False)

        def one_cycle() -> tuple[float, float]:
            _, ts = timed(lambda: alloc.sleep(WEIGHTS_TAG))
            _, tw = timed(alloc.wake_up)
            verify()
            return ts, tw

        _host_policy_rows(res, alloc, one_cycle)

        kv = total_bytes(specs, KV_TAG)
        if kv:
            _, td = timed(lambda: alloc.discard(KV_TAG))
            res.latency("discard_kv", "discard kv_cache only (unmap + release)", td, nbytes=kv)
            _, tw = timed(lambda: alloc.wake_up(KV_TAG))
            res.latency("wake_kv", "wake discarded kv_cache (map, no copy)", tw, nbytes=kv)
            verify()
        res.skipped("raw driver unmap/release, create/map", "no GPU")

        batch, tm = timed(lambda: [alloc.malloc(s) for s in sizes])
        _, tf = timed(lambda: _each(alloc.free, batch))
        n = len(sizes)
        res.latency("malloc_ours", f"Allocator.malloc, {n} x 1-64 MiB/{scale}, per call", tm / n)
        res.latency("free_ours", "Allocator.free, per call", tf / n)
        res.skipped("torch pool, raw driver malloc/free", "no GPU")
        res.skipped("torch_memory_saver", "no GPU")
        wl.free()
        res.metrics["errors"] = alloc.errors()
    finally:
        alloc.close()
    return res


# ---------------------------------------------------------------------------------------------------------------
# Raw CUDA driver calls (the baseline of the malloc and discard rows).


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

    def create_map(self, ptr: int, size: int) -> int:
        h = ctypes.c_uint64()
        self._check(self.lib.cuMemCreate(ctypes.byref(h), size, ctypes.byref(self.prop), 0), "cuMemCreate")
        self._check(self.lib.cuMemMap(ptr, size, 0, h.value, 0), "cuMemMap")
        self._check(self.lib.cuMemSetAccess(ptr, size, ctypes.byref(self.access), 1), "cuMemSetAccess")
        return h.value

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


# ---------------------------------------------------------------------------------------------------------------
# GPU.


def _copy_limit(torch: Any, dev_buf: Any, nbytes: int, reps: int = 3) -> tuple[float, float]:
    """(host->device, device->host) GB/s of one `copy_` between a pinned host tensor and `dev_buf`, median of
    `reps` after a warm-up, timed with CUDA events."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = dev_buf[:nbytes]
    out = []
    for dst, src in ((dev, host), (host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out.append(nbytes / statistics.median(times) / 1e9)
    del host, dev
    # Give the pinned pages back now, so that they count neither against our host arena nor as held host RAM.
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
    return out[0], out[1]


def _malloc_rows_cuda(res: Results, torch: Any, cumem: Any, core: Any, sizes: list[int], device: int) -> None:
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
            _, tf = timed(lambda: _each(lambda a: raw.free(*a), allocs))
            raw_m, raw_f = tm / n, tf / n
        addrs, ours_m = timed(lambda: [core.malloc(s, device) for s in sizes])
        _, ours_f = timed(lambda: _each(core.free, addrs))
    if raw_m is not None and raw_f is not None:
        res.latency("malloc_raw", f"raw driver reserve+create+map+access, {label}, per call", raw_m)
        res.latency("free_raw", "raw driver unmap+release+address free, per call", raw_f)
    res.latency("malloc_ours", f"Allocator.malloc, {label}, per call", ours_m / n, raw_m,
                "raw driver (target <= 1.1)")
    res.latency("free_ours", "Allocator.free, per call", ours_f / n, raw_f, "raw driver (target <= 1.1)")

    # The path model loading takes: torch.empty inside use_memory_pool, whose MemPool is dropped at the end of the
    # block; the segments go back through my_free once their tensors die and torch empties its cache.
    before = len(core.allocations())
    sync = torch.cuda.synchronize

    def alloc_all() -> list:
        with cumem.use_memory_pool(tag="malloc_bench"):
            return [torch.empty(s, dtype=torch.uint8, device=device) for s in sizes]

    tensors, tm = timed(alloc_all, sync)
    segments = len(core.allocations()) - before

    def release() -> None:
        nonlocal tensors
        tensors = []
        gc.collect()
        torch.cuda.empty_cache()

    _, tf = timed(release, sync)
    left = len(core.allocations()) - before
    res.latency("malloc_torch_pool", f"torch.empty in use_memory_pool, {label}, per tensor", tm / n, raw_m,
                f"raw driver per call; {segments} my_malloc segments")
    res.latency("free_torch_pool", "del tensors + empty_cache, per tensor", tf / n, raw_f,
                "raw driver per call" + (f"; {left} segments NOT released" if left else ""))


def bench_cuda(args: argparse.Namespace) -> Results:
    import torch

    from . import Allocator
    from .allocator import CuMemAllocator

    scale = args.scale or 1
    device = torch.cuda.current_device()
    specs = reference_workload(scale, args.kv_gib)
    wbytes, kvbytes = total_bytes(specs, WEIGHTS_TAG), total_bytes(specs, KV_TAG)
    res = Results()
    res.metrics.update(backend="cuda", scale=scale, weights_bytes=wbytes, kv_bytes=kvbytes, tensors=len(specs),
                       device=torch.cuda.get_device_name(device), torch=torch.__version__)
    sync = torch.cuda.synchronize

    # torch_memory_saver first: its child process needs the GPU memory we are about to take.
    if args.tms:
        _tms_rows_from_child(res, args, scale)

    free, total = torch.cuda.mem_get_info(device)
    need = wbytes + kvbytes
    if need > free:
        raise SystemExit(f"error: the workload needs {fmt_bytes(need)} of GPU memory, {fmt_bytes(free)} is free; "
                         f"use --scale or --kv-gib")
    say(f"{res.metrics['device']}: scale 1/{scale}, {len(specs)} tensors, weights {fmt_bytes(wbytes)}, "
        f"kv_cache {fmt_bytes(kvbytes)}, GPU free {fmt_bytes(free)} of {fmt_bytes(total)}")

    cumem = CuMemAllocator.get_instance()
    core = Allocator.cuda()
    wl = TorchWorkload(specs, device=device)
    _, t = timed(lambda: wl.allocate(cumem), sync)
    say(f"allocated {len(specs)} tensors in {fmt_seconds(t)}")
    wl.fill(WEIGHTS_TAG)
    wl.checksum(WEIGHTS_TAG)
    sync()

    # The physical limit, measured against device memory of the kv cache when it is big enough.
    kv = wl.tensors[-1] if kvbytes >= wbytes else None
    dev_buf = (kv.reshape(-1).view(torch.uint8) if kv is not None
               else torch.empty(wbytes, dtype=torch.uint8, device=device))
    say(f"measuring pinned copy bandwidth over {fmt_bytes(wbytes)}")
    h2d, d2h = _copy_limit(torch, dev_buf, wbytes)
    del dev_buf
    res.bandwidth("copy_h2d", "torch copy_ pinned host -> device (the limit)", wbytes, wbytes / h2d / 1e9, None)
    res.bandwidth("copy_d2h", "torch copy_ device -> pinned host (the limit)", wbytes, wbytes / d2h / 1e9, None)

    def verify() -> None:
        wl.verify(WEIGHTS_TAG)

    _sleep_wake_cycles(res, lambda: cumem.sleep(offload_tags=WEIGHTS_TAG), cumem.wake_up, verify,
                       lambda: core.usage(device), args.cycles, wbytes, d2h, h2d, sync)

    def one_cycle() -> tuple[float, float]:
        _, ts = timed(lambda: cumem.sleep(offload_tags=WEIGHTS_TAG), sync)
        _, tw = timed(cumem.wake_up, sync)
        verify()
        return ts, tw

    _host_policy_rows(res, core, one_cycle)

    if kvbytes:
        _, td = timed(lambda: cumem.discard(KV_TAG), sync)
        tc: Optional[float] = None
        tu: Optional[float] = None
        try:
            raw = RawDriver(device)
            size = round_up(kvbytes, raw.granularity)
            ptr = raw.reserve(size)
            handle, tc = timed(lambda: raw.create_map(ptr, size), sync)
            _, tu = timed(lambda: raw.unmap_release(ptr, size, handle), sync)
            raw.address_free(ptr, size)
        except Exception as e:  # the rows of our own calls still count
            tc = tu = None
            res.skipped("raw cuMemUnmap+cuMemRelease", f"{e}")
        _, tw = timed(lambda: cumem.wake_up(tags=[KV_TAG]), sync)
        res.latency("discard_kv", "discard kv_cache only (CuMemAllocator.discard)", td, tu,
                    "raw cuMemUnmap+cuMemRelease", nbytes=kvbytes)
        res.latency("wake_kv", "wake discarded kv_cache (map, no copy)", tw, tc,
                    "raw cuMemCreate+cuMemMap+cuMemSetAccess", nbytes=kvbytes)
        if tu is not None:
            res.metrics.update(raw_unmap_release_kv_s=tu, raw_create_map_kv_s=tc)
        verify()

    say(f"malloc/free of {args.malloc_count} allocations")
    _malloc_rows_cuda(res, torch, cumem, core, malloc_sizes(args.malloc_count, scale), device)
    res.metrics["errors"] = core.errors()
    wl.release()
    gc.collect()
    return res


# ---------------------------------------------------------------------------------------------------------------
# torch_memory_saver, in a child process.


def _tms_rows_from_child(res: Results, args: argparse.Namespace, scale: int) -> None:
    import importlib.util

    if importlib.util.find_spec("torch_memory_saver") is None:
        res.skipped("torch_memory_saver", "not installed")
        return
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    last_err = ""
    for mode in ("preload", "torch"):
        try:
            env = tms_child_env(mode)
        except Exception as e:
            last_err = f"configure_subprocess: {e}"
            continue
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "tms.json")
            cmd = [sys.executable, "-m", "cumem_rs.bench", "--tms-child", mode, "--scale", str(scale),
                   "--kv-gib", str(args.kv_gib), "--cycles", str(args.cycles), "--json", out]
            say(f"torch_memory_saver ({mode} hook mode) in a child process")
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            if p.returncode == 0 and os.path.exists(out):
                with open(out) as f:
                    child = json.load(f)
                child["hook_mode"] = mode
                res.metrics["tms"] = child
                return
            tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or [f"exit code {p.returncode}"]
            last_err = f"{mode} mode: {tail[0]}"
    res.skipped("torch_memory_saver", last_err[:200])


def tms_child_env(mode: str) -> dict[str, str]:
    """The environment for a child process that runs torch_memory_saver in hook `mode`: its "preload" mode
    intercepts cudaMalloc through LD_PRELOAD, which only a new process gets. Raises when that cannot be set up."""
    env = dict(os.environ)
    if mode == "preload":
        import torch_memory_saver as tms_pkg

        with tms_pkg.configure_subprocess():
            env = dict(os.environ)
    return env


def _add_tms_rows(res: Results) -> None:
    """Rows of the child's numbers, as ratios of this run's copy limit."""
    tms = res.metrics.get("tms")
    if not tms:
        return
    m = res.metrics
    w = m["weights_bytes"]
    tag = f"tms {tms.get('version', '?')}"
    res.bandwidth("tms_sleep_cold", f"{tag}: pause, cold first (cpu backup weights)", w, tms["sleep_all_s"][0],
                  m.get("copy_d2h_gbps"), "device->host copy")
    if len(tms["sleep_all_s"]) > 1:
        res.bandwidth("tms_sleep", f"{tag}: pause, steady (median)", w, statistics.median(tms["sleep_all_s"][1:]),
                      m.get("copy_d2h_gbps"), "device->host copy")
        res.bandwidth("tms_wake", f"{tag}: resume, steady (median)", w, statistics.median(tms["wake_all_s"][1:]),
                      m.get("copy_h2d_gbps"), "host->device copy")
    if "discard_kv_s" in tms:
        res.latency("tms_discard_kv", f"{tag}: pause kv_cache only", tms["discard_kv_s"],
                    m.get("raw_unmap_release_kv_s"), "raw cuMemUnmap+cuMemRelease", nbytes=m["kv_bytes"])
    if "wake_kv_s" in tms:
        res.latency("tms_wake_kv", f"{tag}: resume kv_cache only", tms["wake_kv_s"],
                    m.get("raw_create_map_kv_s"), "raw cuMemCreate+cuMemMap+cuMemSetAccess", nbytes=m["kv_bytes"])
    res.value("tms_rss_after_wake", f"{tag}: host RSS growth after resume", tms["rss_growth_after_wake"],
              "RSS delta (not an exact count)")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _TmsPools:
    """torch_memory_saver regions in the place of use_memory_pool. Weights get a cpu backup, the kv cache none:
    what our sleep(offload_tags="weights") does."""

    def __init__(self, tms: Any):
        self.tms = tms

    def use_memory_pool(self, tag: str) -> Any:
        return self.tms.region(tag=tag, enable_cpu_backup=tag == WEIGHTS_TAG)


def tms_child(args: argparse.Namespace) -> dict:
    """Runs in the child: the reference workload through torch_memory_saver, same cycles and verification."""
    import torch
    import torch_memory_saver as tms_pkg

    tms = tms_pkg.torch_memory_saver
    if args.tms_child == "torch":
        tms.hook_mode = "torch"
    specs = reference_workload(args.scale, args.kv_gib)
    sync = torch.cuda.synchronize
    wl = TorchWorkload(specs)
    wl.allocate(_TmsPools(tms))
    wl.fill(WEIGHTS_TAG)
    wl.checksum(WEIGHTS_TAG)
    sync()
    rss0 = _rss_bytes()
    sleeps, wakes = [], []
    for _ in range(args.cycles + 1):
        _, ts = timed(tms.pause, sync)
        _, tw = timed(tms.resume, sync)
        wl.verify(WEIGHTS_TAG)
        sleeps.append(ts)
        wakes.append(tw)
    out: dict[str, Any] = dict(sleep_all_s=sleeps, wake_all_s=wakes, rss_growth_after_wake=_rss_bytes() - rss0)
    if total_bytes(specs, KV_TAG):
        _, out["discard_kv_s"] = timed(lambda: tms.pause(KV_TAG), sync)
        _, out["wake_kv_s"] = timed(lambda: tms.resume(KV_TAG), sync)
    try:
        from importlib.metadata import version

        out["version"] = version("torch_memory_saver")
    except Exception:
        pass
    return out


# ---------------------------------------------------------------------------------------------------------------
# Command line.


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p, sim_scale=DEFAULT_SIM_SCALE, kv_gib=DEFAULT_KV_GIB, cycles=DEFAULT_CYCLES,
                           cycles_help="steady sleep/wake cycles after the cold one")
    p.add_argument("--malloc-count", type=int, default=DEFAULT_MALLOC_COUNT,
                   help=f"allocations of 1-64 MiB in the malloc rows (default {DEFAULT_MALLOC_COUNT})")
    p.add_argument("--no-tms", dest="tms", action="store_false",
                   help="skip the torch_memory_saver rows even when it is installed")
    p.add_argument("--json", metavar="PATH", help="also write every number to PATH as JSON")
    p.add_argument("--tms-child", choices=["preload", "torch"], help=argparse.SUPPRESS)


def resolve_backend(requested: str) -> str:
    """"cuda" or "sim"; raises SystemExit with a message when cuda is requested but unusable."""
    from . import cuda_available

    if requested == "sim":
        return "sim"
    reason = ""
    if not cuda_available():
        reason = "cumem_rs found no CUDA driver or device"
    else:
        try:
            import torch

            if not torch.cuda.is_available():
                reason = f"torch {torch.__version__} has no CUDA"
        except ImportError:
            reason = "torch is not installed"
    if not reason:
        return "cuda"
    if requested == "cuda":
        raise SystemExit(f"error: --backend cuda: {reason}")
    return "sim"


def run(args: argparse.Namespace) -> int:
    if args.scale is not None and args.scale < 1:
        raise SystemExit("error: --scale must be >= 1")
    if args.cycles < 0 or args.malloc_count < 1:
        raise SystemExit("error: --cycles must be >= 0 and --malloc-count >= 1")
    if args.tms_child:
        out = tms_child(args)
        with open(args.json, "w") as f:
            json.dump(out, f)
        return 0
    backend = resolve_backend(args.backend)
    try:
        res = bench_cuda(args) if backend == "cuda" else bench_sim(args)
    except VerificationError as e:
        print(f"error: verification failed: {e}", file=sys.stderr)
        return 1
    _add_tms_rows(res)
    m = res.metrics
    publish(res, f"cumem_rs sleep/wake benchmark ({backend}, scale 1/{m['scale']}, {m['tensors']} tensors)", args.json)
    return 0


def publish(res: Results, title: str, json_path: Optional[str]) -> None:
    """Print the table and the allocator's recorded errors; write every number to `json_path` when given."""
    res.print(title)
    if res.metrics.get("errors"):
        print(f"allocator recorded errors: {res.metrics['errors']}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"metrics": res.metrics, "rows": res.rows}, f, indent=1)
        print(f"wrote {json_path}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cumem_rs.bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
