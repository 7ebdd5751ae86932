"""Allocation count: 12 GiB (divided by --scale) as 16 / 128 / 1024 / 6144 allocations of one size, steady sleep
and wake on the copy path (retained backups off) as ratios of the pinned copy of the same bytes in the same
process. Through the core `Allocator` (its malloc; torch views for fill and checksums on the GPU) and through
CuMemAllocator (torch.empty in a `use_memory_pool` block: torch packs tensors under 10 MiB into shared segments,
so the row names the number of segments our allocator saw). The per-allocation driver work is what this exposes.
The largest count is measured once more with wake groups off (every allocation on its own handle), the reference
for what grouping neighbours buys.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

from ..workload import GiB, WEIGHTS_TAG, TorchWorkload, VerificationError, sim_granularity
from . import config
from .common import Context, fmt_bytes, fmt_seconds, report_seconds, say, timed
from .limits import limit
from .subjects import CoreTensors, SimSubject, TensorSubject, equal_specs, release_tensors, sim_allocator

TOTAL_BYTES = 12 * GiB
COUNTS = (16, 128, 1024, 6144)


def parse_counts(text: str) -> tuple[int, ...]:
    """`--alloc-counts`: comma-separated positive ints."""
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        import argparse

        raise argparse.ArgumentTypeError(f"expected comma-separated positive counts, got {text!r}")
    return counts


def _targets(count: int, what: str, core: bool) -> str:
    """The targets of sleep and wake at each count (GPU only)."""
    if count <= 128:
        return " (target >= 0.97)"
    if count >= 6144:
        return " (target >= 0.9)"
    if what == "wake":
        return " (target >= 0.95)"
    return " (target >= 0.97)" if core else ""


def run(ctx: Context) -> None:
    counts: tuple[int, ...] = ctx.args.alloc_counts
    gran = _granularity(ctx)
    layers = ("core", "torch") if ctx.gpu else ("core",)
    ctx.res.section(f"allocation count: {fmt_bytes(TOTAL_BYTES // ctx.scale)} in allocations of one size, steady "
                    "(retained backups off)")
    def size_of(n: int) -> int:
        # One size per row, a multiple of the granularity; the copy limit is measured over the same total.
        return max(gran, (TOTAL_BYTES // ctx.scale // n) // gran * gran)

    rows = [("core", n, True) for n in counts]
    # The largest count once more with wake groups off (what grouping neighbours on one handle buys, in this
    # run), before the torch rows: their pool keeps segments cached that a later sleep would move too.
    rows.append(("core", max(counts), False))
    rows += [(layer, n, True) for layer in layers[1:] for n in counts]
    for layer, n, groups in rows:
        size = size_of(n)
        h2d, d2h = limit(ctx, n * size, key=f"_{(n * size) >> 20}mib")
        _row(ctx, layer, n, size, h2d, d2h, groups)
    if not ctx.gpu:
        ctx.res.skipped("allocation count via CuMemAllocator (torch tensors)", "no GPU")


def _granularity(ctx: Context) -> int:
    if not ctx.gpu:
        return sim_granularity(ctx.scale)
    from .. import Allocator

    return Allocator.cuda().granularity(ctx.device)


def _row(ctx: Context, layer: str, n: int, size: int, h2d: float, d2h: float, groups: bool = True) -> None:
    specs = equal_specs(n, size)
    total = n * size
    off = "" if groups else ", wake groups off"
    key_off = "" if groups else "_nogroups"
    if not ctx.gpu:
        alloc = sim_allocator(ctx.scale, [total])
        try:
            if not groups:
                alloc.set_wake_group_bytes(0)
            sim = SimSubject(alloc, specs)
            sim.allocate()
            _cycles(ctx, alloc, f"alloc_count_core_{n}{key_off}", f"{n} x {fmt_bytes(size)}, core Allocator{off}",
                    sim, lambda: alloc.sleep(WEIGHTS_TAG), alloc.wake_up, total, h2d, d2h, "", n, True)
            sim.release()
            ctx.add_errors(alloc.errors())
        finally:
            alloc.close()
        return

    from .. import Allocator

    core = Allocator.cuda()
    ctx.check_fits(total)
    group_bytes = core.wake_group_bytes
    core.set_wake_group_bytes(group_bytes if groups else 0)
    try:
        _gpu_row(ctx, core, layer, n, size, specs, total, h2d, d2h, off, key_off)
    finally:
        core.set_wake_group_bytes(group_bytes)


def _gpu_row(ctx: Context, core: Any, layer: str, n: int, size: int, specs: Any, total: int, h2d: float,
             d2h: float, off: str, key_off: str) -> None:
    from ..allocator import CuMemAllocator

    before = len(core.allocations())
    wl: TorchWorkload
    if layer == "core":
        wl = CoreTensors(core, specs, ctx.device)
        try:
            _, t = timed(wl.allocate, ctx.sync)
        except Exception as e:  # a torch without CUDA array interface views: the other rows still count
            ctx.res.skipped(f"{n} allocations, core Allocator", f"no torch view of a core allocation: {e}")
            return
        sleep, wake = (lambda: core.sleep(WEIGHTS_TAG)), core.wake_up
        label, extra = f"{n} x {fmt_bytes(size)}, core Allocator{off}", ""
    else:
        cumem = CuMemAllocator.get_instance()
        wl = TorchWorkload(specs, device=ctx.device)
        _, t = timed(lambda: wl.allocate(cumem), ctx.sync)
        sleep, wake = (lambda: cumem.sleep(offload_tags=WEIGHTS_TAG)), cumem.wake_up
        segments = len(core.allocations()) - before
        label, extra = f"{n} x {fmt_bytes(size)}, CuMemAllocator ({segments} segments)", "; wall time"
    say(f"{label}: allocated in {fmt_seconds(t)}")
    try:
        wl.fill(WEIGHTS_TAG)
        subject = TensorSubject(wl)
        subject.remember()
        _cycles(ctx, core, f"alloc_count_{layer}_{n}{key_off}", label, subject, sleep, wake, total, h2d, d2h, extra, n,
                layer == "core")
    finally:
        release_tensors(ctx, wl)
    left = len(core.allocations()) - before
    if left:
        ctx.res.skipped(f"{label}: release", f"{left} allocations still live after release")


def _cycles(ctx: Context, core: Any, key: str, label: str, subject: Any, sleep: Callable[[], Any],
            wake: Callable[[], Any], total: int, h2d: float, d2h: float, extra: str, n: int, is_core: bool) -> None:
    """One warm-up cycle, then --cycles steady ones (at least one), every one verified; rows of the medians."""
    core.set_retain_backups(False)
    ctx.res.configure(config.short(core))
    sleeps, wakes, core_sleeps = [], [], []
    for i in range(max(1, ctx.cycles) + 1):
        rs, ts = timed(sleep, ctx.sync)
        left = core.usage()
        if left:
            raise VerificationError(f"{label}: sleep left {left} bytes mapped")
        _, tw = timed(wake, ctx.sync)
        subject.verify()
        if i:
            sleeps.append(ts)
            wakes.append(tw)
            core_s = report_seconds(rs)
            core_sleeps.append(ts if core_s is None else core_s)
    gpu = ctx.gpu
    ts, tw, tc = statistics.median(sleeps), statistics.median(wakes), statistics.median(core_sleeps)
    note = f"; core's own time {total / tc / 1e9 / d2h:.3f}x" if extra else ""
    res = ctx.res
    res.bandwidth(f"{key}_sleep", f"{label}: sleep (median of {len(sleeps)})", total, ts, d2h,
                  "device->host copy" + (_targets(n, "sleep", is_core) if gpu else "") + extra + note)
    res.bandwidth(f"{key}_wake", f"{label}: wake (median of {len(wakes)})", total, tw, h2d,
                  "host->device copy" + (_targets(n, "wake", is_core) if gpu else ""))
    res.metrics[f"{key}_sleep_core_s"] = tc
