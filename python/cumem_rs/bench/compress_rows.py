"""The compress table's further rows (issue 23's targets), each against a reference measured in the same run:

- retained compressed backups: the sleep of weights unchanged since the wake against the raw copy time (target
  <= 0.2x), and the wake right after that sleep and 1 s after it, against the host->device limit;
- random bytes (`compress="auto"` on incompressible data, which the codec stores raw) against the same bytes
  with `compress="off"` (today's raw path), sleep and wake (target >= 0.95x);
- 1024 allocations of 12 MiB (divided by --scale) of bf16-like data, compress off and auto, against the copy
  limit of the same bytes;
- the first sleep, compressed, with pinning ahead off (cold) and 2 s after the weights pool closed (the
  `pin_ahead` table's measurement), against the device->host limit (target >= 1.2x).
Every wake is verified. Rows run on the simulated device too (its host codec, tiny sizes): there they check the
paths run and restore every byte, their ratios say nothing of nvCOMP.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

from ..workload import MiB, WEIGHTS_TAG, TorchWorkload, reference_workload, total_bytes
from . import config
from .common import Context, fmt_bytes, say, timed
from .compress_data import GpuWeights, SimWeights, fill_tensors
from .limits import limit
from .subjects import equal_specs, release_tensors, sim_allocator

#: Seconds between a sleep and its wake in rows that do not measure the pause itself (the wake right after a
#: large release waits on the driver; see the compress table).
PAUSE_S = 1.0
MANY_COUNT = 1024
MANY_EACH = 12 * MiB
#: (row key, label, pin ahead, seconds between the weights pool closing and the sleep on the GPU, target)
FIRST_SLEEP_CASES = (
    ("compress_first_sleep_cold", "first sleep, compressed, pin ahead off (cold)", False, 0.0, ""),
    ("compress_first_sleep_pin_ahead_2s", "first sleep, compressed, 2 s after the weights pool closed", True, 2.0,
     ">= 1.2x"),
)
#: The sim has no pool to close: its background pinning gets this long before the sleep.
SIM_PIN_DELAY_S = 0.2


def accept(core: Any, mode: str) -> bool:
    """Set the weights' compress policy to `mode`; False where the allocator has no such policy."""
    try:
        core.set_tag_policy(WEIGHTS_TAG, compress=mode)
        return True
    except (TypeError, ValueError):
        return False


def _target(ctx: Context, text: str) -> str:
    return f" (target {text})" if text and ctx.gpu else ""


def warm_up(ctx: Context, core: Any, verify: Callable[[], None]) -> None:
    """One sleep and wake of the weights, verified, before the measured cycles: the first sleep of a setting pins
    its host memory (seconds), which the first-sleep rows measure apart."""
    timed(lambda: core.sleep(WEIGHTS_TAG), ctx.sync)
    timed(lambda: core.wake_up(None), ctx.sync)
    verify()


def steady(n: int) -> str:
    """How a steady row's median is taken (`warm_up` first)."""
    return f"(median of {n} after a warm-up)"


def _sleep_wake(ctx: Context, core: Any, w: Any, n: int) -> dict[str, float]:
    """`n` cycles: sleep, the pause, wake, verify; medians of sleep_s, wake_s and the host bytes held asleep.
    Starts from no cached host memory, so that what is held is this setting's backup alone, and with one warm-up
    cycle (the first sleep pins that memory: the first-sleep rows measure it apart)."""
    core.trim_host()
    warm_up(ctx, core, w.verify)
    recs = []
    for _ in range(n):
        _, ts = timed(lambda: core.sleep(WEIGHTS_TAG), ctx.sync)
        held = core.host_bytes()
        time.sleep(PAUSE_S if ctx.gpu else 0.0)
        _, tw = timed(lambda: core.wake_up(None), ctx.sync)
        w.verify()
        recs.append(dict(sleep_s=ts, wake_s=tw, held=held))
    return {f: statistics.median(r[f] for r in recs) for f in recs[0]}


def _pause_note(ctx: Context) -> str:
    return f"{PAUSE_S:g} s after the sleep" if ctx.gpu else "after the sleep"


def retained_rows(ctx: Context, core: Any, w: Any, wbytes: int, h2d: float, d2h: float) -> None:
    """Retained compressed backups: sleeps of bf16 weights unchanged since the wake, and the wakes after them."""
    res = ctx.res
    label = "retained compressed backups, bf16, weights unchanged since the wake"
    if not accept(core, "auto"):
        res.skipped(label, "the allocator has no compress= policy")
        return
    core.set_retain_backups(True)
    res.configure(config.short(core))
    try:
        w.fill("bf16")
        timed(lambda: core.sleep(WEIGHTS_TAG), ctx.sync)  # copies and compresses everything
        timed(lambda: core.wake_up(None), ctx.sync)  # binds the backups to their allocations
        w.verify()
        if not core.retains_backups():
            res.skipped(label, "retains_backups() is False (fingerprint kernel or host memory policy)")
            return
        recs = []
        for _ in range(max(1, ctx.cycles)):
            r1, s1 = timed(lambda: core.sleep(WEIGHTS_TAG), ctx.sync)
            _, now = timed(lambda: core.wake_up(None), ctx.sync)
            w.verify()
            r2, s2 = timed(lambda: core.sleep(WEIGHTS_TAG), ctx.sync)
            time.sleep(PAUSE_S if ctx.gpu else 0.0)
            _, later = timed(lambda: core.wake_up(None), ctx.sync)
            w.verify()
            for r, s in ((r1, s1), (r2, s2)):
                recs.append(dict(sleep_s=s, copied=r.get("copied_bytes", 0), skipped=r.get("skipped_bytes", 0)))
            recs[-1].update(wake_now_s=now, wake_s=later)
    finally:
        core.set_retain_backups(False)
    key = "compress_bf16_auto_retained"
    sleeps = [r["sleep_s"] for r in recs]
    copied = statistics.median(r["copied"] for r in recs)
    skipped = statistics.median(r["skipped"] for r in recs)
    res.latency(f"{key}_sleep_unchanged", f"sleep, {label} (median of {len(sleeps)})", statistics.median(sleeps),
                wbytes / d2h / 1e9, "device->host copy time of the raw bytes" + _target(ctx, "<= 0.2x") +
                f"; copied {fmt_bytes(copied)}, skipped {fmt_bytes(skipped)}", nbytes=wbytes)
    wakes = [r for r in recs if "wake_s" in r]
    res.bandwidth(f"{key}_wake_at_once", "    wake with no pause after that sleep", wbytes,
                  statistics.median(r["wake_now_s"] for r in wakes), h2d, "host->device copy of the raw bytes")
    res.bandwidth(f"{key}_wake", f"    wake {_pause_note(ctx)}", wbytes, statistics.median(r["wake_s"] for r in wakes),
                  h2d, "host->device copy of the raw bytes")
    res.metrics[f"{key}_cycles"] = recs


def random_rows(ctx: Context, core: Any, w: Any, wbytes: int, h2d: float, d2h: float) -> None:
    """Incompressible bytes: compress="off" (the raw path), then "auto" against it."""
    res = ctx.res
    core.set_retain_backups(False)  # every sleep tries to compress every byte
    w.fill("random")
    n = max(1, ctx.cycles)
    med: dict[str, dict[str, float]] = {}
    labels: dict[str, str] = {}
    for mode in ("off", "auto"):
        if not accept(core, mode):
            res.skipped(f"random bytes, compress={mode!r}", "the allocator has no compress= policy")
            return
        labels[mode] = config.short(core)
        med[mode] = _sleep_wake(ctx, core, w, n)
    off, auto = med["off"], med["auto"]
    label = "random bytes (torch.randint 0-255)"
    raw = "compress='off' on the same bytes in this run (today's raw path)"
    res.configure(labels["off"])
    sleep_off = res.bandwidth("compress_random_off_sleep", f"sleep, {label}, compress='off' {steady(n)}", wbytes,
                              off["sleep_s"], d2h, "device->host copy of the raw bytes")
    wake_off = res.bandwidth("compress_random_off_wake", f"wake {_pause_note(ctx)}, {label}, compress='off'", wbytes,
                             off["wake_s"], h2d, "host->device copy of the raw bytes")
    res.configure(labels["auto"])
    res.bandwidth("compress_random_auto_sleep", f"sleep, {label}, compress='auto' {steady(n)}", wbytes,
                  auto["sleep_s"], sleep_off, raw + _target(ctx, ">= 0.95x"))
    res.bandwidth("compress_random_auto_wake", f"wake {_pause_note(ctx)}, {label}, compress='auto'", wbytes,
                  auto["wake_s"], wake_off, raw + _target(ctx, ">= 0.95x"))
    held = int(auto["held"])
    res.value("compress_random_auto_host_bytes", f"    host memory of the backup while asleep, {label}, 'auto'", held,
              f"{held / wbytes:.3f}x of the raw {fmt_bytes(wbytes)} (stored raw: about 1x)")


def many_rows(ctx: Context, core: Any, make: Callable[[list], Any], granularity: int) -> None:
    """1024 allocations of 12 MiB / scale, bf16-like, compress off then auto, against the copy limit."""
    res = ctx.res
    size = max(granularity, (MANY_EACH // ctx.scale) // granularity * granularity)
    total = MANY_COUNT * size
    h2d, d2h = limit(ctx, total, key=f"_{total >> 20}mib")
    ctx.check_fits(total, f"{MANY_COUNT} allocations of {fmt_bytes(size)}")
    label = f"{MANY_COUNT} x {fmt_bytes(size)}, bf16"
    w = make(equal_specs(MANY_COUNT, size))
    w.allocate()
    try:
        w.fill("bf16")
        core.set_retain_backups(False)
        n = max(1, ctx.cycles)
        for mode in ("off", "auto"):
            if not accept(core, mode):
                res.skipped(f"{label}, compress={mode!r}", "the allocator has no compress= policy")
                continue
            res.configure(config.short(core))
            m = _sleep_wake(ctx, core, w, n)
            key = f"compress_many_{mode}"
            res.bandwidth(f"{key}_sleep", f"sleep, {label}, compress={mode!r} {steady(n)}", total, m["sleep_s"],
                          d2h, "device->host copy of the raw bytes" + _target(ctx, ">= 1.3x" if mode != "off" else ""))
            res.bandwidth(f"{key}_wake", f"wake {_pause_note(ctx)}, {label}, compress={mode!r}", total, m["wake_s"],
                          h2d, "host->device copy of the raw bytes" + _target(ctx, ">= 1.35x" if mode != "off" else ""))
            res.metrics[f"{key}_host_bytes"] = int(m["held"])
    finally:
        w.release()


def first_sleep_rows(ctx: Context, core: Any, sim_alloc: Optional[Any] = None) -> None:
    """The first sleep of freshly loaded bf16 weights, compressed, with nothing pinned before (cold) and with
    pinning ahead given time: on the GPU through CuMemAllocator (its weights pool closing starts the worker), on
    the sim through the same call CuMemAllocator makes (`reserve_host(backup_bytes_of(...), background=True)`)."""
    specs = reference_workload(ctx.scale, kv_gib=0)
    wbytes = total_bytes(specs, WEIGHTS_TAG)
    _, d2h = limit(ctx, wbytes)
    core.set_retain_backups(False)
    if not accept(core, "auto"):
        ctx.res.skipped("first sleep, compressed", "the allocator has no compress= policy")
        return
    ctx.res.configure(config.short(core))
    if ctx.gpu:
        _first_sleeps_gpu(ctx, core, specs, wbytes, d2h)
    else:
        _first_sleeps_sim(ctx, sim_alloc, specs, wbytes, d2h)


def _first_row(ctx: Context, key: str, label: str, wbytes: int, ts: float, d2h: float, target: str,
               status: dict) -> None:
    say(f"{label}: {ts:.3f} s (worker had pinned {status['pinned']} of {status['nbytes']} bytes)")
    ctx.res.metrics[f"{key}_pinned_ahead"] = status["pinned"]
    ctx.res.bandwidth(key, label, wbytes, ts, d2h, "device->host copy of the raw bytes" + _target(ctx, target) +
                      f"; pinned ahead {fmt_bytes(status['pinned'])} of {fmt_bytes(status['nbytes'])}")


def _first_sleeps_gpu(ctx: Context, core: Any, specs: list, wbytes: int, d2h: float) -> None:
    from ..allocator import CuMemAllocator

    ctx.check_fits(wbytes)
    cumem = CuMemAllocator.get_instance()
    previous = cumem.pin_ahead
    try:
        for key, label, on, delay, target in FIRST_SLEEP_CASES:
            core.trim_host()  # nothing cached: the first sleep starts from no pinned memory
            cumem.pin_ahead = on
            wl = TorchWorkload(specs, device=ctx.device)
            try:
                wl.allocate(cumem)  # the weights pool closes inside, starting the worker when on
                closed = time.perf_counter()
                fill_tensors(ctx.torch, wl.tensors, "bf16")
                wl.checksum(WEIGHTS_TAG)
                ctx.sync()
                time.sleep(max(0.0, delay - (time.perf_counter() - closed)))
                status = dict(core.pin_ahead_status())
                _, ts = timed(lambda: cumem.sleep(offload_tags=WEIGHTS_TAG), ctx.sync)
                cumem.wake_up()
                wl.verify(WEIGHTS_TAG)
                _first_row(ctx, key, label, wbytes, ts, d2h, target, status)
            finally:
                release_tensors(ctx, wl)
    finally:
        cumem.pin_ahead = previous
        core.trim_host()


def _first_sleeps_sim(ctx: Context, alloc: Any, specs: list, wbytes: int, d2h: float) -> None:
    for key, label, on, _, target in FIRST_SLEEP_CASES:
        label = label.replace("2 s after the weights pool closed", f"{SIM_PIN_DELAY_S:g} s after pinning ahead began")
        alloc.trim_host()
        w = SimWeights(alloc, specs)
        w.allocate()
        try:
            w.fill("bf16")
            if on:
                alloc.reserve_host(alloc.backup_bytes_of([WEIGHTS_TAG]), background=True)
                time.sleep(SIM_PIN_DELAY_S)
            status = dict(alloc.pin_ahead_status())
            _, ts = timed(lambda: alloc.sleep(WEIGHTS_TAG))
            alloc.wake_up(None)
            w.verify()
            _first_row(ctx, key, label, wbytes, ts, d2h, target, status)
        finally:
            w.release()
    alloc.trim_host()


def gpu_rows(ctx: Context, core: Any, views: Any, wbytes: int, h2d: float, d2h: float) -> None:
    """The rows over the compress table's reference weights (`views`, core allocations on the GPU)."""
    from .compress_pause import matmul_rows

    w = GpuWeights(ctx, core, views.specs, views=views)
    retained_rows(ctx, core, w, wbytes, h2d, d2h)
    random_rows(ctx, core, w, wbytes, h2d, d2h)
    matmul_rows(ctx, core, w, wbytes)


def gpu_own_rows(ctx: Context, core: Any) -> None:
    """The rows that allocate their own weights (run after the reference weights are released)."""
    many_rows(ctx, core, lambda specs: GpuWeights(ctx, core, specs), core.granularity(ctx.device))
    first_sleep_rows(ctx, core)


def sim_rows(ctx: Context, specs: list, wbytes: int, h2d: float, d2h: float, granularity: int) -> None:
    """Every row on a simulated device whose driver has its host codec."""
    from .compress_pause import matmul_rows

    # Room for the reference weights and the many allocations at once (simulated memory costs nothing unused).
    many = max(granularity, (MANY_EACH // ctx.scale) // granularity * granularity)
    alloc = sim_allocator(ctx.scale, [s.nbytes for s in specs] + [many] * MANY_COUNT, compress=True)
    try:
        w = SimWeights(alloc, specs)
        w.allocate()
        try:
            retained_rows(ctx, alloc, w, wbytes, h2d, d2h)
            random_rows(ctx, alloc, w, wbytes, h2d, d2h)
            matmul_rows(ctx, alloc, w, wbytes)
        finally:
            w.release()
        many_rows(ctx, alloc, lambda s: SimWeights(alloc, s), granularity)
        first_sleep_rows(ctx, alloc, alloc)
        ctx.add_errors(alloc.errors())
    finally:
        alloc.close()
