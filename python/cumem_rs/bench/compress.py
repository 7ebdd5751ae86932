"""Compressed backups: sleep and wake of the reference weights with compression on and off, against the pinned
copy limit measured in the same run.

The weights are views of core `Allocator.cuda()` allocations filled like trained bf16 weights (`normal_() * 0.02`:
random bits, as the other tables use, do not compress). Retained backups are off, so every sleep compresses and
copies every byte. Per setting (`compress="off"`, then `"auto"`; `--cycles` cycles, medians):
- sleep as a ratio of the device->host limit and wake (1 s after the sleep, and right after it) as a ratio of the
  host->device limit, both of the raw bytes (targets with compression: wake >= 1.35x, sleep >= 1.3x);
- the pinned host memory the backup holds while asleep against the raw bytes (target <= 0.70x);
then the same with fp8-like weights (`float8_e4m3fn` from `randn`), under the fp8 mode where the policy names one.
Every wake is verified bit-identical. Only the public API is used; where the allocator has no `compress=` policy
or no codec (no nvCOMP on the GPU) the rows say so and are skipped. Then the rows of `compress_rows` (retained
compressed backups, random bytes, 1024 allocations, the first sleep with pinning ahead) and `compress_pause` (a
matmul loop during a compressed pause).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

from ..workload import WEIGHTS_TAG, reference_workload, sim_granularity, total_bytes
from . import compress_rows, config
from .common import Context, fmt_bytes, retain_default, say, timed
from .limits import limit
from .subjects import CoreTensors, SimSubject, TensorSubject, sim_allocator

SECTION = "compress: backups compressed on the GPU (nvCOMP ANS) against raw copies"
#: Seconds between a sleep and its wake for the main wake row (the issue's measurement; a wake right after a large
#: release waits on the driver).
PAUSE_S = 1.0
#: Policy names tried for fp8 data, first accepted wins ("auto" codes it as 16-bit: correct, a worse ratio).
FP8_MODES = ("fp8", "bits8", "auto")


def run(ctx: Context) -> None:
    specs = reference_workload(ctx.scale, kv_gib=0)
    wbytes = total_bytes(specs, WEIGHTS_TAG)
    h2d, d2h = limit(ctx, wbytes)
    res = ctx.res
    res.section(SECTION)
    if not ctx.gpu:
        _sim(ctx, specs, wbytes, h2d, d2h)
        return
    from .. import Allocator, _native

    ctx.check_fits(wbytes)
    core = Allocator.cuda()
    views = CoreTensors(core, specs, ctx.device)
    views.allocate()
    try:
        active, text = _native.cuda_codec_status()
        say(f"codec: {'active: ' if active else 'none: '}{text}")
        if not active:
            res.skipped("compressed sleep/wake", f"no codec ({text})")
            return
        subject = TensorSubject(views)
        torch = ctx.torch
        _fill_bf16(torch, views)
        subject.remember()
        _settings(ctx, core, subject, wbytes, h2d, d2h, "bf16 normal_()*0.02", ("off", "auto"))
        _fill_fp8(torch, views)
        subject.remember()
        mode = _first_accepted(core, FP8_MODES)
        if mode is None:
            res.skipped("fp8-like weights", "the allocator has no compress= policy")
        else:
            _settings(ctx, core, subject, wbytes, h2d, d2h, f"fp8 e4m3 from randn, compress={mode!r}", (mode,))
        compress_rows.gpu_rows(ctx, core, views, wbytes, h2d, d2h)
    finally:
        _reset(core)
        views.release()
    try:
        compress_rows.gpu_own_rows(ctx, core)
    finally:
        _reset(core)
    ctx.add_errors(core.errors())


def _fill_bf16(torch: Any, views: CoreTensors) -> None:
    gen = torch.Generator(device=torch.device("cuda", views.device)).manual_seed(0)
    for spec, t in zip(views.specs, views.tensors):
        if spec.tag == WEIGHTS_TAG:
            t.view(torch.bfloat16).normal_(generator=gen).mul_(0.02)


def _fill_fp8(torch: Any, views: CoreTensors) -> None:
    """e4m3 values of a normal distribution spread over the format's range (sigma 80 of +-448), as quantized
    weights are; in slices, so the float32 temporaries stay small next to the weights."""
    gen = torch.Generator(device=torch.device("cuda", views.device)).manual_seed(1)
    step = 1 << 26
    for spec, t in zip(views.specs, views.tensors):
        if spec.tag == WEIGHTS_TAG:
            for lo in range(0, t.numel(), step):
                part = t[lo:lo + step]
                x = torch.randn(part.numel(), device=t.device, generator=gen).mul_(80).clamp_(-448, 448)
                part.copy_(x.to(torch.float8_e4m3fn).view(torch.uint8))
                del x


def _first_accepted(core: Any, modes: tuple[str, ...]) -> Optional[str]:
    for mode in modes:
        try:
            core.set_tag_policy(WEIGHTS_TAG, compress=mode)
            return mode
        except (TypeError, ValueError):
            continue
    return None


def _reset(core: Any) -> None:
    core.wake_up(None)
    try:
        core.set_tag_policy(WEIGHTS_TAG)
    except Exception:  # noqa: BLE001 - leave what can be left; the run reports the allocator's errors
        pass
    core.set_retain_backups(retain_default())
    core.trim_host()


def _settings(ctx: Context, core: Any, subject: Any, wbytes: int, h2d: float, d2h: float, data: str,
              modes: tuple[str, ...]) -> None:
    """Cycles of the weights under each `compress=` mode, their rows."""
    res = ctx.res
    core.set_retain_backups(False)  # every sleep compresses and copies every byte
    n = max(1, ctx.cycles)
    for mode in modes:
        if _first_accepted(core, (mode,)) is None:
            res.skipped(f"{data}, compress={mode!r}", "the allocator has no compress= policy")
            continue
        res.configure(config.short(core))
        recs = _cycles(ctx, core, subject, n)
        label = f"{data}, compress={mode!r}"
        on = mode != "off"
        t = (lambda s: f" (target {s})") if on and ctx.gpu else (lambda s: "")
        key = f"compress_{'bf16' if data.startswith('bf16') else 'fp8'}_{mode}"
        med = {f: statistics.median(r[f] for r in recs) for f in recs[0]}
        res.bandwidth(f"{key}_sleep", f"sleep, {label} {compress_rows.steady(n)}", wbytes, med["sleep_s"], d2h,
                      "device->host copy of the raw bytes" + t(">= 1.3x"))
        pause = f"{PAUSE_S:g} s after the sleep" if ctx.gpu else "after the sleep (no pause on the sim)"
        res.bandwidth(f"{key}_wake", f"wake {pause}, {label}", wbytes, med["wake_s"], h2d,
                      "host->device copy of the raw bytes" + t(">= 1.35x"))
        res.bandwidth(f"{key}_wake_at_once", f"wake right after the sleep, {label}", wbytes, med["wake_now_s"],
                      h2d, "host->device copy of the raw bytes")
        held = int(med["held"])
        stored = int(med["stored"])
        res.value(f"{key}_host_bytes", f"    host memory of the backup while asleep, {label}", held,
                  f"{held / wbytes:.3f}x of the raw {fmt_bytes(wbytes)}" + t("<= 0.70x")
                  + f"; of which the backups {stored / wbytes:.3f}x")
        res.metrics[f"{key}_backup_ratio"] = stored / wbytes
        res.metrics[f"{key}_stored_ratio"] = held / wbytes
        res.metrics[f"{key}_cycles"] = recs


def _cycles(ctx: Context, core: Any, subject: Any, n: int) -> list[dict]:
    """`n` pairs of cycles: sleep, pause, wake (verified); sleep, wake at once (verified), after `warm_up` (counted
    in, the first sleep that pins the arena was one of the three sleeps a median of 3 was taken over)."""
    sleep: Callable[[], Any] = lambda: core.sleep(WEIGHTS_TAG)  # noqa: E731
    wake: Callable[[], Any] = lambda: core.wake_up(None)  # noqa: E731
    compress_rows.warm_up(ctx, core, subject.verify)
    recs = []
    for _ in range(n):
        rep, ts = timed(sleep, ctx.sync)
        held = core.host_bytes()
        stored = rep["stored_bytes"] + (rep["copied_bytes"] - rep["raw_bytes"])  # blobs + raw copies
        time.sleep(PAUSE_S if ctx.gpu else 0.0)
        _, tw = timed(wake, ctx.sync)
        subject.verify()
        timed(sleep, ctx.sync)
        _, tw_now = timed(wake, ctx.sync)
        subject.verify()
        recs.append(dict(sleep_s=ts, wake_s=tw, wake_now_s=tw_now, held=held, stored=stored))
    return recs


def _sim(ctx: Context, specs: list, wbytes: int, h2d: float, d2h: float) -> None:
    """The same rows on the simulated device (its host codec), at the run's scale, so CI smoke-runs the table.
    The simulated allocation holds the workload's pattern bytes (random: they stay raw), so the ratios there say
    nothing of nvCOMP; they check the path runs and restores every byte."""
    alloc = sim_allocator(ctx.scale, (s.nbytes for s in specs), compress=True)
    try:
        subject = SimSubject(alloc, specs)
        subject.allocate()
        if _first_accepted(alloc, ("auto",)) is None:
            ctx.res.skipped("compressed sleep/wake (simulated)", "the allocator has no compress= policy")
        else:
            _settings(ctx, alloc, subject, wbytes, h2d, d2h, f"bf16 pattern bytes (sim, granularity "
                      f"{fmt_bytes(sim_granularity(ctx.scale))})", ("off", "auto"))
        subject.release()
        ctx.add_errors(alloc.errors())
    finally:
        alloc.close()
    compress_rows.sim_rows(ctx, specs, wbytes, h2d, d2h, sim_granularity(ctx.scale))

