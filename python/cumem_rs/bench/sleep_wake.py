"""Sleep/wake of the reference workload on the copy path (retained backups off: every sleep copies every byte).

One cold first cycle, then the median of --cycles steady cycles, as GB/s of the offloaded bytes and as a ratio of
the copy limit, with the core's own time from its report beside the wall time; data verified every cycle. Then the
steady wake with the wake's own verification off (`set_verify_wakes(False)`), what that verification costs; then
host RAM held after wake under each `set_keep_host_memory` policy, and the discard of the KV cache alone (and its
re-map) against raw cuMemUnmap+cuMemRelease (cuMemCreate+cuMemMap).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Optional

from ..workload import (
    KV_TAG,
    WEIGHTS_TAG,
    AllocatorWorkload,
    TorchWorkload,
    VerificationError,
    reference_workload,
    total_bytes,
)
from . import config
from .common import Context, Results, fmt_bytes, fmt_seconds, report_seconds, say, timed
from .limits import limit
from .malloc import raw_kv_baseline
from .subjects import release_tensors, sim_allocator

SECTION = "sleep/wake, copy path (retained backups off)"


def sleep_wake_cycles(res: Results, sleep: Callable[[], Any], wake: Callable[[], Any], verify: Callable[[], Any],
                      mapped: Callable[[], int], cycles: int, wbytes: int, d2h: float, h2d: float,
                      sync: Callable[[], None] = lambda: None, gpu: bool = True) -> None:
    """One cold cycle, then `cycles` steady ones; every cycle checks that sleep left nothing mapped and that the
    weights came back bit-identical. The design targets are shown on the GPU only (the sim has no such target).
    Steady sleeps that skipped unchanged chunks (retained backups on) say so in their row."""
    down, up = ("device->host copy", "host->device copy") if gpu else ("memcpy", "memcpy")
    cold, steady = (" (target >= 0.6)", " (target >= 0.95)") if gpu else ("", "")
    sleeps: list[float] = []
    wakes: list[float] = []
    core_sleeps: list[Optional[float]] = []
    core_wakes: list[Optional[float]] = []
    skipped: list[int] = []
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
        core_sleeps.append(report_seconds(rs))
        core_wakes.append(report_seconds(rw))
        skipped.append(int(rs.get("skipped_bytes", 0)) if isinstance(rs, dict) else 0)
        say(f"cycle {i}: sleep {fmt_seconds(ts)}, wake {fmt_seconds(tw)}, weights verified")
    res.bandwidth("sleep_cold", "sleep, cold first (offload weights, discard kv)", wbytes, sleeps[0], d2h,
                  down + cold)
    res.bandwidth("wake_cold", "wake, first", wbytes, wakes[0], h2d, up)
    if cycles:
        note = ""
        if any(skipped[1:]):
            note = f"; {fmt_bytes(statistics.median(skipped[1:]))} skipped as unchanged (retained backups)"
        res.bandwidth("sleep", f"sleep, steady (median of {cycles})", wbytes, statistics.median(sleeps[1:]), d2h,
                      down + steady + note)
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
                       wake_core_all_s=core_wakes, sleep_skipped_all_bytes=skipped)


def verify_cost_rows(res: Results, core: Any, cycle: Callable[[], tuple[float, float]], cycles: int, wbytes: int,
                     h2d: float, gpu: bool = True) -> None:
    """The steady wake again with verification off (`set_verify_wakes(False)`), in the same run: what the wake's
    fingerprint pass over the restored bytes costs, against the verified steady wake above (target <= 5%)."""
    if not core.verifies_wakes():
        res.skipped("wake, steady, verification off", "verification is off (CUMEM_RS_VERIFY_WAKE=0)")
        return
    wakes: list[float] = []
    core.set_verify_wakes(False)
    config_before = res.current_config
    res.configure(config.short(core))
    try:
        for _ in range(max(cycles, 1)):
            wakes.append(cycle()[1])
    finally:
        core.set_verify_wakes(True)
    off = statistics.median(wakes)
    verified = res.metrics.get("wake_all_s", [])[1:]
    note = "host->device copy" if gpu else "memcpy"
    if verified:
        on = statistics.median(verified)
        cost = (on - off) / on if on > 0 else 0.0
        res.metrics["verify_wake_cost"] = cost
        note += (f"; verification is {100 * cost:+.1f}% of the verified steady wake's time"
                 + (" (target <= 5%)" if gpu else ""))
    res.bandwidth("wake_unverified", f"wake, steady, verification off (median of {len(wakes)})", wbytes, off, h2d,
                  note)
    res.configure(config_before)
    res.metrics["wake_unverified_all_s"] = wakes


def host_policy_rows(res: Results, core: Any, cycle: Callable[[], tuple[float, float]]) -> None:
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


def run(ctx: Context) -> None:
    specs = reference_workload(ctx.scale, ctx.args.kv_gib)
    wbytes = total_bytes(specs, WEIGHTS_TAG)
    h2d, d2h = limit(ctx, wbytes)
    ctx.res.section(SECTION)
    if ctx.gpu:
        _cuda(ctx, specs, wbytes, h2d, d2h)
    else:
        _sim(ctx, specs, wbytes, h2d)


def _sim(ctx: Context, specs: list, wbytes: int, limit_gbps: float) -> None:
    res = ctx.res
    alloc = sim_allocator(ctx.scale, (s.nbytes for s in specs))
    try:
        alloc.set_retain_backups(False)
        res.configure(config.short(alloc))
        wl = AllocatorWorkload(alloc, specs)
        wl.allocate()
        wl.fill(WEIGHTS_TAG)
        addrs = list(wl.addresses)

        def verify() -> None:
            wl.verify(WEIGHTS_TAG, addrs)

        sleep_wake_cycles(res, lambda: alloc.sleep(WEIGHTS_TAG), alloc.wake_up, verify, alloc.usage, ctx.cycles,
                          wbytes, limit_gbps, limit_gbps, gpu=False)

        def one_cycle() -> tuple[float, float]:
            _, ts = timed(lambda: alloc.sleep(WEIGHTS_TAG))
            _, tw = timed(alloc.wake_up)
            verify()
            return ts, tw

        verify_cost_rows(res, alloc, one_cycle, ctx.cycles, wbytes, limit_gbps, gpu=False)
        host_policy_rows(res, alloc, one_cycle)

        kv = total_bytes(specs, KV_TAG)
        if kv:
            _, td = timed(lambda: alloc.discard(KV_TAG))
            res.latency("discard_kv", "discard kv_cache only (unmap + release)", td, nbytes=kv)
            _, tw = timed(lambda: alloc.wake_up(KV_TAG))
            res.latency("wake_kv", "wake discarded kv_cache (map, no copy)", tw, nbytes=kv)
            verify()
            raw_kv_baseline(ctx, kv)
        wl.free()
        ctx.add_errors(alloc.errors())
    finally:
        alloc.close()


def _cuda(ctx: Context, specs: list, wbytes: int, h2d: float, d2h: float) -> None:
    from .. import Allocator
    from ..allocator import CuMemAllocator

    res, sync = ctx.res, ctx.sync
    kvbytes = total_bytes(specs, KV_TAG)
    ctx.check_fits(wbytes + kvbytes)
    cumem = CuMemAllocator.get_instance()
    core = Allocator.cuda()
    core.set_retain_backups(False)
    res.configure(config.short(core))
    wl = TorchWorkload(specs, device=ctx.device)
    # The cold row measures a sleep that pins its arena itself (the pin_ahead table measures pinning ahead).
    previous, cumem.pin_ahead = cumem.pin_ahead, False
    try:
        _, t = timed(lambda: wl.allocate(cumem), sync)
    finally:
        cumem.pin_ahead = previous
    say(f"allocated {len(specs)} tensors in {fmt_seconds(t)}")
    try:
        wl.fill(WEIGHTS_TAG)
        wl.checksum(WEIGHTS_TAG)
        sync()

        def verify() -> None:
            wl.verify(WEIGHTS_TAG)

        sleep_wake_cycles(res, lambda: cumem.sleep(offload_tags=WEIGHTS_TAG), cumem.wake_up, verify,
                          lambda: core.usage(ctx.device), ctx.cycles, wbytes, d2h, h2d, sync)

        def one_cycle() -> tuple[float, float]:
            _, ts = timed(lambda: cumem.sleep(offload_tags=WEIGHTS_TAG), sync)
            _, tw = timed(cumem.wake_up, sync)
            verify()
            return ts, tw

        verify_cost_rows(res, core, one_cycle, ctx.cycles, wbytes, h2d)
        host_policy_rows(res, core, one_cycle)

        if kvbytes:
            _, td = timed(lambda: cumem.discard(KV_TAG), sync)
            # Measured while the KV cache is discarded: its 48 GiB are free for the raw allocation.
            raw = raw_kv_baseline(ctx, kvbytes)
            tc, tu = raw if raw is not None else (None, None)
            _, tw = timed(lambda: cumem.wake_up(tags=[KV_TAG]), sync)
            res.latency("discard_kv", "discard kv_cache only (CuMemAllocator.discard)", td, tu,
                        "raw cuMemUnmap+cuMemRelease", nbytes=kvbytes)
            res.latency("wake_kv", "wake discarded kv_cache (map, no copy)", tw, tc,
                        "raw cuMemCreate+cuMemMap+cuMemSetAccess", nbytes=kvbytes)
            verify()
    finally:
        release_tensors(ctx, wl)
