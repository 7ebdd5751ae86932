"""The RL-loop table: what an RL trainer's inference engine does every step, in the configuration a user gets.

The reference workload through CuMemAllocator (on the simulated device: a simulated core Allocator), the weights
filled like trained bf16 weights and a KV-cache tensor beside them that every sleep discards (vLLM's level 1).
Per fraction of the weights (--fractions, default 100,50,10,1 % of the 2 MiB chunks, chosen at random over every
tensor) and per mode, side by side in one run:
- "compressed": the default configuration (compression as the environment has it: on where nvCOMP is found;
  retained backups on; no host budget; host tier), the weights' tag policy cleared;
- "raw": the same with `compress="off"` for the weights tag;
- "compressed, verify off": the first fraction once more, compressed, with the wake's own check of the restored
  bytes against the sleep's fingerprints switched off (`set_verify_wakes(False)`; the bench's checksums still
  run): the cost of verified wakes in the default configuration (`verify_wake_cost`).
A block starts from no host memory (`trim_host`) with one sleep of the freshly written weights (cycle 0: the
first sleep, apart), then --cycles cycles (default 5) of: the weights parked 1 s (GPU), wake (timed), verify
every weight bit-identical (checksums on the device), rewrite the fraction with fresh `normal_() * 0.02` values,
sleep (timed), read the host memory held (in use + cached, from the allocator's stats) against the raw bytes of
the weights. Sleeps and wakes are ratios to the link: the pinned device->host / host->device copy of the same bytes
measured in the same run (link time / call time: above 1 is faster than a plain copy).

On the simulated device (at scale 1/4096 unless --scale says otherwise) the times are of a host emulation (memcpy,
zstd on this machine's cores) and say nothing of speed; the table then checks that the loop runs, restores every
byte and what host memory it holds.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..workload import MiB, WEIGHTS_TAG, TorchWorkload, reference_workload, sim_granularity, total_bytes
from . import config, rl_report
from .common import Context, fmt_bytes, say, timed
from .limits import limit
from .rl_data import GpuRlWeights, SimRlWeights
from .subjects import release_tensors, sim_allocator

DEFAULT_CYCLES = 5
DEFAULT_FRACTIONS = (1.0, 0.5, 0.1, 0.01)
GPU_CHUNK = 2 * MiB
#: Seconds the weights stay asleep before each wake on the GPU (a wake right after a large release waits on the
#: driver; an engine parked for a training step is asleep for seconds).
PARK_S = 1.0
MODES = ("compressed", "raw")
#: One more block, of the first fraction, compressed with the wake's own verification off
#: (`set_verify_wakes(False)`): what the verified wake costs in the default configuration, in the same run.
VERIFY_OFF = rl_report.VERIFY_OFF
#: The simulated device's scale without --scale: the smallest at which every tensor keeps a row (the embedding's
#: 128256 / 4096): the table there checks behaviour, not speed, and 8 blocks of cycles stay quick.
SIM_SCALE = 4096


def parse_fractions(text: str) -> list[float]:
    """An argparse type: percents of the chunks, e.g. "100,50,10,1", each in (0, 100]; fractions of 1."""
    out = []
    for part in (x.strip() for x in text.split(",")):
        try:
            pct = float(part.rstrip("%"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--fractions: {part!r} is not a number (percent of the chunks)")
        if not 0 < pct <= 100:
            raise argparse.ArgumentTypeError(f"--fractions: {part!r} is not a percent in (0, 100]")
        out.append(pct / 100)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fractions", type=parse_fractions, default=list(DEFAULT_FRACTIONS), metavar="PCT[,PCT...]",
                   help="the rl_loop table's fractions of the weights' chunks rewritten between wake and sleep, in "
                        "percent (default " + ",".join(f"{f * 100:g}" for f in DEFAULT_FRACTIONS) + ")")


@dataclass
class Rig:
    """What a block drives: the core allocator (policies, stats), the calls a user makes, the weights."""

    alloc: Any
    sleep: Callable[[], Any]
    wake: Callable[[], Any]
    weights: Any
    sync: Callable[[], None]
    park_s: float


def host_held(alloc: Any) -> dict[str, int]:
    """Host memory the allocator holds, from its stats: arenas backups lie in (`host_backup_bytes`) plus cached
    ones kept for the next sleep (`host_cached_bytes`); and `host_bytes()` (which also counts memory the
    pin-ahead worker is pinning) beside it."""
    s = alloc.stats()
    in_use, cached = int(s["host_backup_bytes"]), int(s["host_cached_bytes"])
    return dict(in_use=in_use, cached=cached, held=in_use + cached, host_bytes=int(alloc.host_bytes()))


def set_mode(alloc: Any, mode: str) -> None:
    """The weights' compress policy for `mode` ("auto" or "off"), the rest of their policy kept."""
    p = alloc.tag_policy(WEIGHTS_TAG)
    alloc.set_tag_policy(WEIGHTS_TAG, backup=p.get("backup"), wake_fill=p.get("wake_fill", "undefined"),
                         backup_tier=p.get("backup_tier", "auto"), compress="off" if mode == "raw" else "auto")


def _record(rig: Rig, fraction: float, mode: str, cfg: str, cycle: int, report: Any, sleep_s: float,
            wake: Optional[tuple[Any, float]], rewritten: int, wbytes: int, link_d2h_s: float,
            link_h2d_s: float) -> dict:
    held = host_held(rig.alloc)
    rep = report if isinstance(report, dict) else {}
    wake_rep = wake[0] if wake is not None and isinstance(wake[0], dict) else {}
    wake_s = None if wake is None else wake[1]
    stats = rig.alloc.stats()
    return dict(
        fraction=fraction, mode=mode, config=cfg, cycle=cycle, sleep_s=sleep_s, sleep_ratio=link_d2h_s / sleep_s,
        wake_s=wake_s, wake_ratio=None if wake_s is None else link_h2d_s / wake_s,
        rewritten_bytes=rewritten, copied_bytes=int(rep.get("copied_bytes", 0)),
        skipped_bytes=int(rep.get("skipped_bytes", 0)), discarded_bytes=int(rep.get("discarded_bytes", 0)),
        compression_ratio=float(stats["compression_ratio"]), held_ratio=held["held"] / wbytes,
        verified=wake_s is not None, wake_verified_bytes=int(wake_rep.get("verified_bytes", 0)), **held)


def block(rig: Rig, fraction: float, mode: str, n: int, rng: random.Random, wbytes: int,
          h2d: float, d2h: float) -> list[dict]:
    """One fraction in one mode: from no host memory, the first sleep (cycle 0), then `n` cycles of park, wake,
    verify, rewrite, sleep; then a last wake, verified. Records per cycle (see `_record`)."""
    link_d2h_s, link_h2d_s = wbytes / d2h / 1e9, wbytes / h2d / 1e9
    set_mode(rig.alloc, mode)
    rig.alloc.trim_host()  # no backups or cached memory of the block before: each block stands alone
    cfg = config.describe(rig.alloc)  # what the block runs in, read back from the allocator
    rig.weights.fill()
    report, ts = timed(rig.sleep, rig.sync)
    recs = [_record(rig, fraction, mode, cfg, 0, report, ts, None, wbytes, wbytes, link_d2h_s, link_h2d_s)]
    for cycle in range(1, n + 1):
        time.sleep(rig.park_s)
        wake = timed(rig.wake, rig.sync)
        rig.weights.verify()
        rewritten = rig.weights.rewrite(fraction, rng)
        rig.sync()
        report, ts = timed(rig.sleep, rig.sync)
        recs.append(_record(rig, fraction, mode, cfg, cycle, report, ts, wake, rewritten, wbytes, link_d2h_s,
                            link_h2d_s))
    time.sleep(rig.park_s)
    rig.wake()
    rig.weights.verify()
    return recs


def measure(rig: Rig, fractions: list[float], n: int, wbytes: int, h2d: float, d2h: float,
            seed: int = 0) -> tuple[list[dict], dict[str, str]]:
    """Every fraction, compressed then raw; returns the records and each mode's configuration as read back from
    the allocator (`config.describe`) while it ran."""
    rng = random.Random(seed)
    recs: list[dict] = []
    labels: dict[str, str] = {}
    before = rig.alloc.tag_policy(WEIGHTS_TAG)
    try:
        for fraction in fractions:
            for mode in MODES:
                say(f"rl_loop: {fraction:.0%} rewritten, {mode}: {n} cycles")
                got = block(rig, fraction, mode, n, rng, wbytes, h2d, d2h)
                labels.setdefault(mode, got[0]["config"])
                recs += got
        if fractions and rig.alloc.verifies_wakes():
            say(f"rl_loop: {fractions[0]:.0%} rewritten, {VERIFY_OFF}: {n} cycles")
            rig.alloc.set_verify_wakes(False)
            try:
                got = block(rig, fractions[0], VERIFY_OFF, n, rng, wbytes, h2d, d2h)
            finally:
                rig.alloc.set_verify_wakes(True)
            labels[VERIFY_OFF] = got[0]["config"]
            recs += got
    finally:
        rig.alloc.set_tag_policy(WEIGHTS_TAG, backup=before.get("backup"),
                                 wake_fill=before.get("wake_fill", "undefined"),
                                 backup_tier=before.get("backup_tier", "auto"), compress=before.get("compress", "auto"))
        rig.alloc.trim_host()
    return recs, labels


def run(ctx: Context) -> None:
    args = ctx.args
    n = args.rl_cycles
    fractions = list(args.fractions)
    scale = ctx.scale if ctx.gpu or args.scale else SIM_SCALE
    specs = reference_workload(scale, args.kv_gib)
    wbytes, kvbytes = total_bytes(specs, WEIGHTS_TAG), total_bytes(specs) - total_bytes(specs, WEIGHTS_TAG)
    h2d, d2h = limit(ctx, wbytes)
    m: dict[str, Any] = dict(backend=ctx.backend, scale=scale, tensors=sum(s.tag == WEIGHTS_TAG for s in specs),
                             weights_bytes=wbytes, kv_bytes=kvbytes, cycles=n, fractions=fractions,
                             link=dict(bytes=wbytes, d2h_gbps=d2h, h2d_gbps=h2d), times_meaningful=ctx.gpu)
    ctx.res.metrics["rl_loop"] = m
    if ctx.gpu:
        recs, labels, codec = _gpu(ctx, specs, fractions, n, wbytes, h2d, d2h, m)
    else:
        recs, labels, codec = _sim(ctx, scale, specs, fractions, n, wbytes, h2d, d2h, m)
    m.update(records=recs, configs=labels, codec=codec)
    m["verify_wake_cost"] = rl_report.verify_cost(m)


def _gpu(ctx: Context, specs: list, fractions: list[float], n: int, wbytes: int, h2d: float, d2h: float,
         m: dict) -> tuple[list[dict], dict[str, str], Optional[str]]:
    from ..allocator import CuMemAllocator

    ctx.check_fits(total_bytes(specs))
    cumem = CuMemAllocator.get_instance()
    core = cumem.native
    m.update(park_s=PARK_S, chunk=GPU_CHUNK)
    codec = core.stats()["codec"]
    say(f"rl_loop: codec {codec or 'none: backups raw (nvCOMP not found, or CUMEM_RS_COMPRESS=0)'}")
    wl = TorchWorkload(specs, device=ctx.device)
    try:
        wl.allocate(cumem)
        rig = Rig(core, lambda: cumem.sleep(offload_tags=WEIGHTS_TAG), cumem.wake_up,
                  GpuRlWeights(ctx.torch, wl, GPU_CHUNK), ctx.sync, PARK_S)
        recs, labels = measure(rig, fractions, n, wbytes, h2d, d2h)
    finally:
        release_tensors(ctx, wl)
    ctx.add_errors(core.errors())
    return recs, labels, codec


def _sim(ctx: Context, scale: int, specs: list, fractions: list[float], n: int, wbytes: int, h2d: float,
         d2h: float, m: dict) -> tuple[list[dict], dict[str, str], Optional[str]]:
    gran = sim_granularity(scale)
    alloc = sim_allocator(scale, (s.nbytes for s in specs), compress=True)
    # Chunks in proportion with the GPU's 2 MiB: one granularity (2 MiB / scale), as the retained table does.
    alloc.set_fingerprint_chunk(gran)
    m.update(park_s=0.0, chunk=gran)
    codec = alloc.stats()["codec"]
    say(f"rl_loop on the simulated device (scale 1/{scale}, chunks of {fmt_bytes(gran)}): times are of a host "
        "emulation and not meaningful; it checks every wake restores every byte and the host memory held")
    try:
        weights = SimRlWeights(alloc, specs, gran)
        weights.allocate()
        rig = Rig(alloc, lambda: alloc.sleep(WEIGHTS_TAG), alloc.wake_up, weights, lambda: None, 0.0)
        recs, labels = measure(rig, fractions, n, wbytes, h2d, d2h)
        weights.free()
        ctx.add_errors(alloc.errors())
    finally:
        alloc.close()
    return recs, labels, codec


def show(metrics: dict) -> None:
    """Print the table of a run's (or a JSON's) metrics."""
    if "rl_loop" in metrics and metrics["rl_loop"].get("records"):
        rl_report.show(metrics["rl_loop"])
