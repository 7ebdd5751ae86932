"""The file tier: sleep to files in a spill directory and wake from them, against the file system's own rate.

First the file system's sequential write and read rate over the bytes the sleeps write (fs_rate.py: plain
pwrite/pread of pinned memory, O_DIRECT where taken, in the spill directory). Then, through the core Allocator
(views of its allocations on the GPU, a simulated allocator otherwise), retained backups off so every sleep
writes every byte:
- the weights with `backup_tier="file"` (a host budget of 0 for them): sleep as a ratio of the write rate and
  wake as a ratio of the read rate, of the bytes on disk (targets >= 0.9), and the pinned host memory held while
  the backups sit in files (host_bytes() plus the staging ring) against ring size + budget;
- retained file backups (a warm-up cycle binds them): sleeps with the weights unchanged (nothing written) and
  with 1% of the chunks rewritten in place (only those written), against the file system's time to write them;
- the issue's reference case: the weights under "auto" with a 4 GiB host budget (scaled with --scale), 3 cycles
  (or --cycles when more), the rest in files: the same ratios, the host memory held, and the weights
  bit-identical after every wake.
Those rows write raw bytes (`compress="off"`: they measure the disk path). Last, the weights refilled as bf16
(`normal_() * 0.02`) with `backup_tier="file"` and compression on: the codec's blobs go to the file, so sleep and
wake move the raw bytes faster than the disk moves its own (ratios of raw bytes per second to the file system's
rate; above 1 is past the disk), with the bytes on disk against the raw bytes.
The staging ring is the default 256 MiB, scaled down with --scale on the simulated device. `--spill-dir` picks
the directory (default: a fresh temporary one, removed afterwards).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from typing import Any, Callable, Optional

from ..workload import WEIGHTS_TAG, MiB, VerificationError, reference_workload, sim_granularity, total_bytes
from . import config
from .common import Context, fmt_bytes, retain_default, say, timed
from .compress_data import fill_tensors, sim_bytes
from .fs_rate import IO_ALIGN, FsRate, measure
from .retained import GPU_CHUNK, rewrite_cycles
from .subjects import CoreTensors, SimSubject, TensorSubject, sim_allocator

SECTION = "file tier: sleep to spill files and wake from them"
DEFAULT_STAGING = 256 * MiB
#: The issue's reference case: a 4 GiB host budget for the 15 GiB of weights, at --scale 1.
REFERENCE_BUDGET = 4 << 30
REFERENCE_CYCLES = 3


def staging_for(scale: int) -> int:
    """The staging ring at this scale: the default on the GPU's scale 1, proportionally smaller below."""
    return max(8 * IO_ALIGN, DEFAULT_STAGING // scale // IO_ALIGN * IO_ALIGN)


def spill_dir_arg(text: str) -> str:
    import argparse
    import os

    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"--spill-dir {text!r} is not a directory")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"--spill-dir {text!r} is not writable")
    return text


def run(ctx: Context) -> None:
    res = ctx.res
    res.section(SECTION)
    given: Optional[str] = ctx.args.spill_dir
    directory = given if given is not None else tempfile.mkdtemp(prefix="cumem_rs_spill_")
    made = given is None
    try:
        _run(ctx, directory)
    finally:
        if made:
            shutil.rmtree(directory, ignore_errors=True)


def _run(ctx: Context, directory: str) -> None:
    specs = reference_workload(ctx.scale, kv_gib=0)
    wbytes = total_bytes(specs, WEIGHTS_TAG)
    staging = staging_for(ctx.scale)
    say(f"file tier in {directory}: weights {fmt_bytes(wbytes)}, staging ring {fmt_bytes(staging)}")
    if ctx.gpu:
        from .. import Allocator

        ctx.check_fits(wbytes)
        core = Allocator.cuda()
        subject: Any = None
        views = CoreTensors(core, specs, ctx.device)
        views.allocate()
        try:
            views.fill(WEIGHTS_TAG)
            subject = TensorSubject(views)
            subject.remember()

            def refill_bf16() -> None:
                fill_tensors(ctx.torch, [t for s, t in zip(views.specs, views.tensors) if s.tag == WEIGHTS_TAG],
                             "bf16")
                subject.remember()

            _tables(ctx, core, subject, directory, wbytes, staging, refill_bf16)
        finally:
            _reset(core)
            views.release()
        ctx.add_errors(core.errors())
        return
    alloc = sim_allocator(ctx.scale, (s.nbytes for s in specs))
    try:
        subject = SimSubject(alloc, specs)
        subject.allocate()
        _tables(ctx, alloc, subject, directory, wbytes, staging,
                lambda: subject.overwrite(lambda n, i: sim_bytes("bf16", n, i)))
        subject.release()
        ctx.add_errors(alloc.errors())
    finally:
        alloc.close()


def _reset(core: Any) -> None:
    """Leave the (process-wide, on the GPU) allocator as a fresh one: no budget, no spill directory."""
    core.wake_up(None)
    core.set_tag_policy(WEIGHTS_TAG)
    core.set_host_budget(None)
    core.set_spill_dir(None)
    core.set_staging_bytes(DEFAULT_STAGING)
    core.set_retain_backups(retain_default())
    core.trim_host()


def _tables(ctx: Context, core: Any, subject: Any, directory: str, wbytes: int, staging: int,
            refill_bf16: Callable[[], None]) -> None:
    res = ctx.res
    core.set_retain_backups(False)  # every sleep writes every byte: the rate rows measure the disk path
    core.set_staging_bytes(staging)
    core.set_spill_dir(directory)
    ring_slot = staging // 8
    rate = measure(directory, wbytes, ring_slot, ctx.torch if ctx.gpu else None)
    how = "O_DIRECT" if rate.direct else "buffered (the file system refused O_DIRECT)"
    res.bandwidth("file_tier_fs_write", f"file system: sequential pwrite of pinned memory, {how}", rate.nbytes,
                  rate.write_s, None, f"{fmt_bytes(rate.block)} blocks, 4 in flight, median of 3 (the reference)")
    res.bandwidth("file_tier_fs_read", f"file system: sequential pread into pinned memory, {how}", rate.nbytes,
                  rate.read_s, None, f"{fmt_bytes(rate.block)} blocks, 4 in flight, median of 3 (the reference)")
    res.metrics["file_tier_fs_direct"] = rate.direct
    res.metrics["file_tier_staging_bytes"] = staging

    n = max(1, ctx.cycles)
    core.set_tag_policy(WEIGHTS_TAG, backup_tier="file", compress="off")
    core.set_host_budget(0)
    _cycles(ctx, core, subject, "file_tier_file", f"tier \"file\", budget 0 (median of {n})", n,
            rate, wbytes, staging, 0)
    _retained(ctx, core, subject, rate, wbytes)
    core.set_tag_policy(WEIGHTS_TAG, backup_tier="auto", compress="off")
    budget = min(wbytes, max(0, REFERENCE_BUDGET // ctx.scale // IO_ALIGN * IO_ALIGN))
    core.set_host_budget(budget)
    m = max(REFERENCE_CYCLES, ctx.cycles)
    _cycles(ctx, core, subject, "file_tier_auto",
            f"\"auto\", budget {fmt_bytes(budget)} (4 GiB at scale 1; median of {m})", m, rate,
            wbytes - budget, staging, budget)
    core.set_host_budget(0)
    _compressed(ctx, core, subject, rate, wbytes, refill_bf16)
    _reset(core)


def _compressed(ctx: Context, core: Any, subject: Any, rate: FsRate, wbytes: int,
                refill_bf16: Callable[[], None]) -> None:
    """bf16 weights to the file tier compressed (tier "file", budget 0, retained backups off): raw bytes per second
    of sleep and wake against the file system's write and read rate, and the bytes on disk."""
    res = ctx.res
    if core.stats()["codec"] is None:
        res.skipped("file tier, compressed", "no codec (nvCOMP not found, or CUMEM_RS_COMPRESS=0)")
        return
    refill_bf16()
    core.set_tag_policy(WEIGHTS_TAG, backup_tier="file", compress="auto")
    res.configure(config.short(core))
    n = max(1, ctx.cycles)
    recs: list[dict] = []
    for _ in range(n):
        rep, ts = timed(lambda: core.sleep(WEIGHTS_TAG), ctx.sync)
        st = core.stats()
        woke, tw = timed(lambda: core.wake_up(None), ctx.sync)
        subject.verify()
        core.settle_spill_files()
        recs.append(dict(sleep_s=ts, wake_s=tw, written=rep["written_bytes"], read=woke["read_bytes"],
                         raw=rep["raw_bytes"], on_disk=st["file_tier_stored_bytes"], report=rep, wake=woke))
    med = {k: statistics.median(r[k] for r in recs) for k in ("sleep_s", "wake_s", "written", "read", "raw",
                                                                  "on_disk")}
    if med["raw"] < wbytes:
        raise VerificationError(f"file tier, compressed: {med['raw']} of {wbytes} bytes went through the codec")
    t = " (above 1: past the disk)" if ctx.gpu else ""
    disk = med["on_disk"] / wbytes
    res.bandwidth("file_tier_compressed_sleep", f"sleep, tier \"file\", bf16 compressed (median of {n})", wbytes,
                  med["sleep_s"], rate.write_gbps,
                  f"file system write rate{t}; raw bytes; wrote {fmt_bytes(int(med['written']))}")
    res.bandwidth("file_tier_compressed_wake", f"wake, tier \"file\", bf16 compressed (median of {n})", wbytes,
                  med["wake_s"], rate.read_gbps,
                  f"file system read rate{t}; raw bytes; read {fmt_bytes(int(med['read']))}")
    res.value("file_tier_compressed_disk_bytes", "    bytes on disk while asleep", int(med["on_disk"]),
              f"{disk:.3f}x of the raw bytes")
    res.metrics["file_tier_compressed_disk_ratio"] = disk
    res.metrics["file_tier_compressed_cycles"] = recs
    say(f"file tier, compressed: {n} cycles verified bit-identical, {disk:.3f}x of the raw bytes on disk")


def _cycles(ctx: Context, core: Any, subject: Any, key: str, label: str, n: int, rate: FsRate, on_disk: int,
            staging: int, budget: int) -> None:
    """`n` sleep/wake cycles of the weights; each wake verified, the host memory held read while asleep."""
    res = ctx.res
    res.configure(config.short(core))  # the tier and budget the caller set
    recs: list[dict] = []
    sleep: Callable[[], Any] = lambda: core.sleep(WEIGHTS_TAG)  # noqa: E731
    for _ in range(n):
        rep, ts = timed(sleep, ctx.sync)
        st = core.stats()
        held = core.host_bytes() + st["staging_bytes"]
        woke, tw = timed(lambda: core.wake_up(None), ctx.sync)
        subject.verify()
        # The spill file's close ran on the reclaim thread meanwhile; what of it outlasted the verify.
        t0 = time.perf_counter()
        core.settle_spill_files()
        settle_s = time.perf_counter() - t0
        recs.append(dict(sleep_s=ts, wake_s=tw, written=rep["written_bytes"], read=woke["read_bytes"],
                         sleep_file_s=rep["file_seconds"], wake_file_s=woke["file_seconds"],
                         wake_read_wait_s=woke["file_read_wait_seconds"], wake_copy_s=woke["file_copy_seconds"],
                         wake_release_s=woke["release_seconds"], wake_core_s=woke["seconds"],
                         settle_s=settle_s,
                         file_bytes=st["file_tier_bytes"], host_tier_bytes=st["host_tier_bytes"], held=held,
                         report=rep))
    written = statistics.median(r["written"] for r in recs)
    read = statistics.median(r["read"] for r in recs)
    if written < on_disk or read < on_disk:
        raise VerificationError(f"{label}: wrote {written} and read {read} bytes, expected {on_disk} in files")
    sleep_s = statistics.median(r["sleep_s"] for r in recs)
    wake_s = statistics.median(r["wake_s"] for r in recs)
    t = " (target >= 0.9)" if ctx.gpu else ""
    res.bandwidth(f"{key}_sleep", f"sleep, {label}", int(written), sleep_s, rate.write_gbps,
                  f"file system write rate{t}; bytes written to files")
    res.bandwidth(f"{key}_sleep_pipeline", "    of which the file pipeline (report file_seconds)", int(written),
                  statistics.median(r["sleep_file_s"] for r in recs), rate.write_gbps, "file system write rate")
    # Where a wake's time went (medians, seconds): inside the file pipeline waiting for reads and on the ring's
    # device copies; outside it, giving back what the restored backups held (the spill file's close is handed to
    # the reclaim thread: the next sleep's space check waits for it) and the rest (maps, host copies, commit).
    med = {k: statistics.median(r[k] for r in recs)
           for k in ("wake_file_s", "wake_read_wait_s", "wake_copy_s", "wake_release_s", "wake_core_s",
                     "settle_s")}
    rest = max(0.0, med["wake_core_s"] - med["wake_file_s"] - med["wake_release_s"])
    res.bandwidth(f"{key}_wake", f"wake, {label}", int(read), wake_s, rate.read_gbps,
                  f"file system read rate{t}; bytes read from files; outside the pipeline: giving back the backups "
                  f"{med['wake_release_s'] * 1e3:.1f} ms, maps and the rest {rest * 1e3:.1f} ms; after it, the "
                  f"background close still ran {med['settle_s'] * 1e3:.1f} ms past the verify")
    res.bandwidth(f"{key}_wake_pipeline", "    of which the file pipeline (report file_seconds)", int(read),
                  med["wake_file_s"], rate.read_gbps,
                  f"file system read rate; waiting for reads {med['wake_read_wait_s'] * 1e3:.1f} ms, ring -> device "
                  f"copies {med['wake_copy_s'] * 1e3:.1f} ms")
    res.metrics[f"{key}_wake_phases_s"] = dict(med, rest=rest)
    held = max(r["held"] for r in recs)
    bound = staging + budget
    res.value(f"{key}_host_held_bytes", f"    pinned host memory held while asleep (most of {n})", held,
              f"{held / bound:.3f}x of ring + budget = {fmt_bytes(bound)} (target <= 1)")
    res.metrics[f"{key}_host_held_ratio"] = held / bound
    res.metrics[f"{key}_host_bound_bytes"] = bound
    res.metrics[f"{key}_cycles"] = recs
    if held > bound:
        raise VerificationError(f"{label}: {held} bytes of host memory held while asleep, more than ring + "
                                f"budget ({bound})")
    say(f"{label}: {n} cycles verified bit-identical, {fmt_bytes(written)} per sleep in files")


def _retained(ctx: Context, core: Any, subject: Any, rate: FsRate, wbytes: int) -> None:
    """Retained file backups (tier "file", budget 0): after a warm-up cycle that binds them, sleeps with the
    weights unchanged (nothing written) and with 1% of the chunks rewritten (only those written), each against
    the file system's time to write all the weights; wakes verified."""
    res = ctx.res
    chunk = GPU_CHUNK if ctx.gpu else sim_granularity(ctx.scale)
    core.set_retain_backups(True)
    core.set_fingerprint_chunk(chunk)
    sleep: Callable[[], Any] = lambda: core.sleep(WEIGHTS_TAG)  # noqa: E731
    wake: Callable[[], Any] = lambda: core.wake_up(None)  # noqa: E731
    timed(sleep, ctx.sync)
    timed(wake, ctx.sync)
    subject.verify()
    if not core.retains_backups():
        res.skipped("sleep, retained file backups", "retains_backups() is False (fingerprint kernel)")
        core.set_retain_backups(False)
        return
    n = max(1, ctx.cycles)
    res.configure(config.short(core))
    recs = rewrite_cycles(subject, sleep, wake, {"unchanged": n, "one_percent": n}, chunk, ctx.sync)
    write_s = wbytes / rate.write_gbps / 1e9
    for kind, what in (("unchanged", "weights unchanged since wake"), ("one_percent", "1% of chunks rewritten")):
        rs = recs[kind]
        written = statistics.median(r["report"]["written_bytes"] for r in rs)
        skipped = statistics.median(r["report"]["skipped_bytes"] for r in rs)
        res.latency(f"file_tier_retained_sleep_{kind}", f"sleep, retained file backups, {what} (median of {n})",
                    statistics.median(r["sleep_s"] for r in rs), write_s,
                    f"file system time to write the weights; wrote {fmt_bytes(written)}, skipped "
                    f"{fmt_bytes(skipped)}", nbytes=int(written))
    res.metrics["file_tier_retained_cycles"] = recs
    core.set_retain_backups(False)
