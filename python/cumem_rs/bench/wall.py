"""Wall time of `CuMemAllocator.sleep`, `wake_up` and `discard` against the core's own time (its report's
seconds) and against the copy limit, on the reference workload and the copy path (retained backups off): what the
torch layer adds around the core (gc.collect, torch.cuda.empty_cache, logging). gc.collect() and empty_cache()
are also timed alone, in the same process state. GPU only (the torch layer needs CUDA).
"""

from __future__ import annotations

import gc
import statistics
from typing import Any, Callable, Optional

from ..workload import KV_TAG, WEIGHTS_TAG, TorchWorkload, reference_workload, total_bytes
from . import config
from .common import Context, Results, report_seconds, say, timed
from .limits import limit
from .malloc import raw_kv_baseline
from .retained import COPY_TIME
from .subjects import release_tensors

SECTION = "CuMemAllocator wall time against the core's (copy path, retained backups off)"


def _call_rows(res: Results, key: str, name: str, walls: list[float], cores: list[float], nbytes: int,
               limit_gbps: Optional[float], limit_note: str, raw: Optional[float] = None) -> None:
    """Wall time and the core's time of one call, each against the copy limit (or a raw driver time), then the
    wall time as a multiple of the core's."""
    wall, core = statistics.median(walls), statistics.median(cores)
    label = f"{name} (median of {len(walls)})"
    if limit_gbps is not None:
        res.bandwidth(f"{key}_wall", f"{label}, wall", nbytes, wall, limit_gbps, limit_note)
        res.bandwidth(f"{key}_core", "    the core's own time (report)", nbytes, core, limit_gbps, limit_note)
    else:
        res.latency(f"{key}_wall", f"{label}, wall", wall, raw, limit_note, nbytes=nbytes)
        res.latency(f"{key}_core", "    the core's own time (report)", core, raw, limit_note, nbytes=nbytes)
    res.latency(f"{key}_wall_vs_core", "    wall time against the core's", wall, core,
                f"the core's time (outside it: {(wall - core) * 1e3:.1f} ms)")


def run(ctx: Context) -> None:
    res = ctx.res
    if not ctx.gpu:
        res.section(SECTION)
        res.skipped("CuMemAllocator sleep / wake_up / discard wall time", "no GPU")
        return
    from .. import Allocator
    from ..allocator import CuMemAllocator

    specs = reference_workload(ctx.scale, ctx.args.kv_gib)
    wbytes, kvbytes = total_bytes(specs, WEIGHTS_TAG), total_bytes(specs, KV_TAG)
    h2d, d2h = limit(ctx, wbytes)
    res.section(SECTION)
    ctx.check_fits(wbytes + kvbytes)
    sync = ctx.sync
    cumem = CuMemAllocator.get_instance()
    core = Allocator.cuda()
    core.set_retain_backups(False)
    res.configure(config.short(core))
    wl = TorchWorkload(specs, device=ctx.device)
    try:
        wl.allocate(cumem)
        wl.fill(WEIGHTS_TAG)
        wl.checksum(WEIGHTS_TAG)

        def call(fn: Callable[[], Any], walls: list[float], cores: list[float]) -> None:
            rep, t = timed(fn, sync)
            core_s = report_seconds(rep)
            walls.append(t)
            cores.append(t if core_s is None else core_s)

        call(lambda: cumem.sleep(offload_tags=WEIGHTS_TAG), [], [])  # warm-up: host memory pinned
        call(cumem.wake_up, [], [])
        wl.verify(WEIGHTS_TAG)
        n = max(1, ctx.cycles)
        say(f"CuMemAllocator wall time: {n} cycles")
        sleeps: tuple[list[float], list[float]] = ([], [])
        wakes: tuple[list[float], list[float]] = ([], [])
        discards: tuple[list[float], list[float]] = ([], [])
        gcs, caches = [], []
        raw: Optional[tuple[float, float]] = None
        for _ in range(n):
            call(lambda: cumem.sleep(offload_tags=WEIGHTS_TAG), *sleeps)
            call(cumem.wake_up, *wakes)
            wl.verify(WEIGHTS_TAG)
            if kvbytes:
                call(lambda: cumem.discard(KV_TAG), *discards)
                if raw is None:
                    raw = raw_kv_baseline(ctx, kvbytes)  # while the KV cache's memory is free
                timed(lambda: cumem.wake_up(tags=[KV_TAG]), sync)
            gcs.append(timed(gc.collect)[1])
            caches.append(timed(ctx.torch.cuda.empty_cache, sync)[1])
        _call_rows(res, "wall_sleep", "CuMemAllocator.sleep", *sleeps, wbytes, d2h,
                   "device->host copy (target >= 0.95)")
        _call_rows(res, "wall_wake", "CuMemAllocator.wake_up", *wakes, wbytes, h2d,
                   "host->device copy (target >= 0.95)")
        if kvbytes:
            _call_rows(res, "wall_discard", "CuMemAllocator.discard(kv_cache)", *discards, kvbytes, None,
                       "raw cuMemUnmap+cuMemRelease" if raw else "", raw[1] if raw else None)
        copy_s = wbytes / d2h / 1e9
        res.latency("wall_gc_collect", "gc.collect() alone, this process", statistics.median(gcs), copy_s,
                    COPY_TIME)
        res.latency("wall_empty_cache", "torch.cuda.empty_cache() alone", statistics.median(caches), copy_s,
                    COPY_TIME)
    finally:
        release_tensors(ctx, wl)
