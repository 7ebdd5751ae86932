"""Retained backups: a sleep after a wake copies only the chunks whose GPU fingerprint changed in between.

Reference workload, sleep offloading the weights and discarding the KV cache, steady cycles after one warm-up
cycle, each sleep preceded by one of three in-place changes made on the device (torch kernels on the tensors; core
writes on the simulated device): none, 1% of the weights' chunks at random, all weights. Measured with
`set_retain_backups(True)` and, for comparison, `False`, through the core `Allocator` and through CuMemAllocator
(torch tensors; GPU only). Ratios against the pinned copy of the weights measured in the same run:
- sleep, weights unchanged: time as a fraction of the copy time (target <= 0.2), with its breakdown: the
  fingerprints (the report's fingerprint_seconds), the rest of the core (compare, copies of changed chunks,
  release), and the time outside the core (the wall time minus the report's);
- sleep, 1% of the chunks rewritten: fraction of the copy time (target <= 0.25);
- sleep, all weights rewritten: bandwidth as a ratio of the copy limit (target >= 0.95);
- wake (it fingerprints the restored chunks under its copies): ratio of the copy limit (target >= 0.95).
The weights are verified after every wake against their last writes.
"""

from __future__ import annotations

import random
import statistics
from typing import Any, Callable

from ..workload import (
    WEIGHTS_TAG,
    MiB,
    TorchWorkload,
    VerificationError,
    reference_workload,
    sim_granularity,
    total_bytes,
)
from . import config
from .common import Context, fmt_bytes, fmt_seconds, retain_default, say, timed
from .limits import limit
from .subjects import CoreTensors, SimSubject, TensorSubject, choose_chunks, release_tensors, sim_allocator

SECTION = "retained backups: sleep after a wake, by what changed in between"
REWRITE_FRACTION = 0.01
GPU_CHUNK = 2 * MiB
COPY_TIME = "device->host copy time"
#: (key, what happens between the wake and the next sleep)
KINDS = (("unchanged", "weights unchanged since wake"),
         ("one_percent", f"{REWRITE_FRACTION:.0%} of chunks rewritten"),
         ("all", "all weights rewritten"))


def rewrite_cycles(subject: Any, sleep: Callable[[], Any], wake: Callable[[], Any], cycles: dict[str, int],
                   chunk: int, sync: Callable[[], None], seed: int = 0,
                   after_sleep: Callable[[], None] = lambda: None) -> dict[str, list[dict]]:
    """For each kind of KINDS, `cycles[kind]` times: change the weights that way (outside the timing), then a
    timed sleep and a timed wake, then verify. Returns per kind one record per cycle: sleep_s, wake_s and the
    sleep's report (None when `sleep` returns none)."""
    rng = random.Random(seed)
    out: dict[str, list[dict]] = {}
    for kind, _ in KINDS:
        recs = []
        for _ in range(cycles.get(kind, 0)):
            if kind == "one_percent":
                subject.rewrite(choose_chunks(subject.spans(), chunk, REWRITE_FRACTION, rng))
                subject.remember()
            elif kind == "all":
                subject.rewrite(subject.spans())
                subject.remember()
            rs, ts = timed(sleep, sync)
            after_sleep()
            _, tw = timed(wake, sync)
            subject.verify()
            recs.append(dict(sleep_s=ts, wake_s=tw, report=rs if isinstance(rs, dict) else None))
        out[kind] = recs
    return out


def _median(recs: list[dict], field: str) -> float:
    return statistics.median(r["report"][field] if field in r["report"] else 0 for r in recs)


def add_rows(ctx: Context, key: str, label: str, recs: dict[str, list[dict]], wbytes: int,
             h2d: float, d2h: float, targets: bool, outside: str = "", verbs: tuple[str, str] = ("sleep", "wake")
             ) -> None:
    """The rows of one set of rewrite_cycles: sleeps as a fraction of the copy time (unchanged, 1%) or a ratio
    of the copy limit (all), wakes as a ratio of the copy limit. With reports, the copied/skipped bytes and the
    breakdown of the unchanged sleep (`outside` names what the wall time adds to the core's). `verbs` name the
    two calls in the rows (a peer pauses and resumes)."""
    res = ctx.res
    copy_s = wbytes / d2h / 1e9
    t = (lambda s: f" (target {s})") if targets else (lambda s: "")
    frac_note = {"unchanged": t("<= 0.2"), "one_percent": t("<= 0.25")}
    for kind, what in KINDS:
        rs = recs.get(kind) or []
        if not rs:
            continue
        wall = statistics.median(r["sleep_s"] for r in rs)
        name = f"{label}: {verbs[0]}, {what} (median of {len(rs)})"
        detail = ""
        with_reports = all(r["report"] is not None for r in rs)
        if with_reports:
            detail = f"; copied {fmt_bytes(_median(rs, 'copied_bytes'))}"
            if _median(rs, "chunks_checked"):
                detail += (f", skipped {fmt_bytes(_median(rs, 'skipped_bytes'))}, fingerprints "
                           f"{fmt_seconds(_median(rs, 'fingerprint_seconds'))}")
        if kind == "all":
            res.bandwidth(f"{key}_sleep_{kind}", name, wbytes, wall, d2h, "device->host copy" + t(">= 0.95") + detail)
        else:
            res.latency(f"{key}_sleep_{kind}", name, wall, copy_s, COPY_TIME + frac_note[kind] + detail,
                        nbytes=wbytes)
        if kind == "unchanged" and with_reports:
            fp, core = _median(rs, "fingerprint_seconds"), _median(rs, "seconds")
            res.latency(f"{key}_sleep_unchanged_fingerprint", "    of which fingerprints (report)", fp, copy_s,
                        COPY_TIME)
            res.latency(f"{key}_sleep_unchanged_rest", "    of which the rest of the core (compare, release)",
                        max(0.0, core - fp), copy_s, COPY_TIME)
            res.latency(f"{key}_sleep_unchanged_outside", "    of which outside the core (wall - report)",
                        max(0.0, wall - core), copy_s, COPY_TIME + outside)
    wakes = [r["wake_s"] for rs in recs.values() for r in rs]
    if wakes:
        res.bandwidth(f"{key}_wake", f"{label}: {verbs[1]} (median of {len(wakes)})", wbytes, statistics.median(wakes),
                      h2d, "host->device copy" + t(">= 0.95"))
    res.metrics[f"{key}_cycles"] = recs


def run(ctx: Context) -> None:
    specs = reference_workload(ctx.scale, ctx.args.kv_gib)
    wbytes = total_bytes(specs, WEIGHTS_TAG)
    h2d, d2h = limit(ctx, wbytes)
    ctx.res.section(SECTION)
    n = max(1, ctx.cycles)
    cycles = {kind: n for kind, _ in KINDS}
    if not ctx.gpu:
        _sim(ctx, specs, cycles, wbytes, h2d)
        ctx.res.skipped("CuMemAllocator (torch tensors)", "no GPU")
        return
    from .. import Allocator
    from ..allocator import CuMemAllocator

    ctx.check_fits(total_bytes(specs))
    core = Allocator.cuda()
    core.set_fingerprint_chunk(GPU_CHUNK)
    # Core allocations, seen by torch through zero-copy views.
    views = CoreTensors(core, specs, ctx.device)
    try:
        views.allocate()
    except Exception as e:  # a torch without CUDA array interface views: the torch-layer rows still count
        ctx.res.skipped("core Allocator rows", f"no torch view of a core allocation: {e}")
    else:
        try:
            _layer(ctx, core, "core Allocator", "retained_core", views, lambda: core.sleep(WEIGHTS_TAG),
                   core.wake_up, cycles, wbytes, h2d, d2h, " (the Python call)")
        finally:
            views.release()
    cumem = CuMemAllocator.get_instance()
    wl = TorchWorkload(specs, device=ctx.device)
    try:
        wl.allocate(cumem)
        _layer(ctx, core, "CuMemAllocator", "retained_torch", wl, lambda: cumem.sleep(offload_tags=WEIGHTS_TAG),
               cumem.wake_up, cycles, wbytes, h2d, d2h, " (gc.collect, empty_cache, logging)")
    finally:
        release_tensors(ctx, wl)


def _layer(ctx: Context, core: Any, label: str, key: str, wl: Any, sleep: Callable[[], Any],
           wake: Callable[[], Any], cycles: dict[str, int], wbytes: int, h2d: float, d2h: float,
           outside: str) -> None:
    wl.fill(WEIGHTS_TAG)
    subject = TensorSubject(wl)
    subject.remember()
    _policies(ctx, core, label, key, subject, sleep, wake, cycles, GPU_CHUNK, wbytes, h2d, d2h, outside)


def _policies(ctx: Context, core: Any, label: str, key: str, subject: Any, sleep: Callable[[], Any],
              wake: Callable[[], Any], cycles: dict[str, int], chunk: int, wbytes: int, h2d: float, d2h: float,
              outside: str) -> None:
    """Retained backups on, then off, on the same allocations."""

    def nothing_mapped() -> None:
        left = core.usage()
        if left:
            raise VerificationError(f"sleep left {left} bytes mapped")

    for on in (True, False):
        state = "on" if on else "off"
        core.set_retain_backups(on)
        ctx.res.configure(config.short(core))
        # Warm-up: a copy-everything sleep, then the wake that binds the backups (retain on).
        timed(sleep, ctx.sync)
        nothing_mapped()
        timed(wake, ctx.sync)
        subject.verify()
        if on and not core.retains_backups():  # asked after a wake: it loads the fingerprint kernel
            ctx.res.skipped(f"{label}, retain on", "retains_backups() is False (fingerprint kernel or host "
                                                   "memory policy; see the allocator's log)")
            continue
        say(f"{label}, retain {state}: {sum(cycles.values())} cycles")
        recs = rewrite_cycles(subject, sleep, wake, cycles, chunk, ctx.sync, after_sleep=nothing_mapped)
        add_rows(ctx, f"{key}_{state}", f"{label}, retain {state}", recs, wbytes, h2d, d2h, ctx.gpu and on,
                 outside)
    core.set_retain_backups(retain_default())


def _sim(ctx: Context, specs: list, cycles: dict[str, int], wbytes: int, limit_gbps: float) -> None:
    gran = sim_granularity(ctx.scale)
    alloc = sim_allocator(ctx.scale, (s.nbytes for s in specs))
    try:
        # Chunks in proportion with the GPU's: one granularity, as 2 MiB is there.
        alloc.set_fingerprint_chunk(gran)
        subject = SimSubject(alloc, specs)
        subject.allocate()
        _policies(ctx, alloc, "core Allocator", "retained_core", subject, lambda: alloc.sleep(WEIGHTS_TAG),
                  alloc.wake_up, cycles, gran, wbytes, limit_gbps, limit_gbps, "")
        subject.release()
        ctx.add_errors(alloc.errors())
    finally:
        alloc.close()
