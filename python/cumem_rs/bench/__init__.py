"""Sleep/wake benchmark on the reference workload (see workload.py), every figure a ratio of a reference measured
in the same run. One table per measured thing; --only picks some (default: all of them):

  rl_loop      printed first: what an RL loop does in the configuration a user gets (compression as the
               environment has it, retained backups on, no budget, host tier), compressed and raw side by side:
               --cycles cycles (default 5) of wake -> rewrite --fractions of the weights' chunks (default
               100,50,10,1 %) -> sleep, with a KV cache discarded at each sleep; per cycle sleep and wake against
               the link, host memory held against the raw bytes, every wake verified
  sleep_wake   the copy path (retained backups off): one cold first cycle, then the median of --cycles steady
               cycles, against the pinned-copy limit, with the core's own time beside the wall time; host RAM
               held after wake under each keep_host_memory policy; discard of the KV cache alone against raw
               cuMemUnmap+cuMemRelease (and its re-map against cuMemCreate+cuMemMap)
  retained     retained backups on and off: sleep with the weights unchanged since the wake (with its
               breakdown), with 1% of the chunks rewritten in place, with all rewritten; wake; through the core
               Allocator and CuMemAllocator
  wall         CuMemAllocator.sleep / wake_up / discard wall time against the core's time and the copy limit
  pin_ahead    the first sleep with pinning ahead off, at once and 2 s after the weights pool closed, against
               the copy limit; a matmul loop while the background worker pins, against the loop alone
  alloc_count  12 GiB as 16 / 128 / 1024 / 6144 allocations (--alloc-counts): steady sleep and wake against
               the copy of 12 GiB, core Allocator and CuMemAllocator
  malloc       500 allocations of 1-64 MiB: torch.empty in use_memory_pool and Allocator.malloc/free, against
               raw driver calls (ctypes on libcuda)
  file_tier    the file system's own sequential write/read rate in the spill directory (--spill-dir), then
               sleep to spill files and wake from them against it (weights all in files; the 4 GiB budget
               reference case), and the host memory held while backups sit in files against ring + budget
  compress     compression on and off (nvCOMP on the GPU): sleep and wake of bf16-like and fp8-like weights
               against the copy limit, and the host memory their backup holds against the raw bytes; retained
               compressed backups (unchanged weights against the copy time; the wake with and without a
               pause after it), random bytes against the raw path, 1024 x 12 MiB allocations, the first sleep
               with pinning ahead, a matmul loop on another tag during a compressed pause against the loop alone
  swap         two processes on one GPU, A sleeps while B wakes, compression off and on: aggregate bytes per
               second, one after the other and at once, against a bidirectional pinned copy
  peer         torch_memory_saver when installed, in a child process (run first, while the GPU is empty): its
               pause/resume, and the retained table's three pauses with retain_cpu_backup off and on

Every row says the configuration it ran in where it is not the default (compress / retain / budget / tier).
Data is verified after every wake. On the simulated device (no GPU) every table runs at a small scale with a host
memcpy as the limit (the torch-layer and peer rows are skipped), so CI can smoke-run the whole benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from ..workload import (
    DEFAULT_KV_GIB,
    KV_TAG,
    WEIGHTS_TAG,
    VerificationError,
    add_workload_arguments,
    reference_workload,
    sim_granularity,
    total_bytes,
)
from . import (alloc_count, compress, file_tier, malloc, peer_tms, pin_ahead, plot, retained, rl_loop, sleep_wake, swap,
               wall)
from .common import Context, Results, fmt_bytes, fmt_seconds, print_table, say, timed
from .limits import copy_limit, memcpy_gbps
from .malloc import DEFAULT_MALLOC_COUNT, RawDriver, malloc_sizes
from .sleep_wake import host_policy_rows, sleep_wake_cycles

__all__ = [
    "DEFAULT_CYCLES", "DEFAULT_MALLOC_COUNT", "DEFAULT_SIM_SCALE", "TABLES", "Context", "RawDriver", "Results",
    "add_arguments", "copy_limit", "fmt_bytes", "fmt_seconds", "host_policy_rows", "main", "malloc_sizes",
    "memcpy_gbps", "print_table", "publish", "resolve_backend", "run", "say", "sleep_wake_cycles", "timed",
]

DEFAULT_SIM_SCALE = 256
DEFAULT_CYCLES = 3

#: Table name -> module with run(ctx), in the order they run. The peer goes first: its child process needs the
#: GPU memory the other tables take (it prints nothing then: its rows come last, from peer_tms.finish). So the
#: RL loop is the first table printed.
TABLES = {
    "peer": peer_tms,
    "rl_loop": rl_loop,
    "sleep_wake": sleep_wake,
    "retained": retained,
    "wall": wall,
    "pin_ahead": pin_ahead,
    "alloc_count": alloc_count,
    "malloc": malloc,
    "file_tier": file_tier,
    "compress": compress,
    "swap": swap,
}


def _table_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in TABLES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown table(s) {', '.join(unknown) or repr(text)}; choose from "
                                         f"{', '.join(TABLES)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p, sim_scale=DEFAULT_SIM_SCALE, kv_gib=DEFAULT_KV_GIB, cycles=None,
                           cycles_help=f"steady cycles per measured row, after the warm-up or cold one (default "
                                       f"{DEFAULT_CYCLES}; the rl_loop table's cycles per block: default "
                                       f"{rl_loop.DEFAULT_CYCLES})")
    p.add_argument("--only", type=_table_list, default=list(TABLES), metavar="TABLE[,TABLE...]",
                   help=f"run only these tables ({', '.join(TABLES)}; default all)")
    rl_loop.add_arguments(p)
    p.add_argument("--malloc-count", type=int, default=DEFAULT_MALLOC_COUNT,
                   help=f"allocations of 1-64 MiB in the malloc table (default {DEFAULT_MALLOC_COUNT})")
    p.add_argument("--alloc-counts", type=alloc_count.parse_counts, default=alloc_count.COUNTS, metavar="N[,N...]",
                   help="allocation counts of the alloc_count table (default "
                        f"{','.join(map(str, alloc_count.COUNTS))})")
    p.add_argument("--spill-dir", type=file_tier.spill_dir_arg, default=None, metavar="DIR",
                   help="the file_tier table's spill directory (default: a fresh temporary directory)")
    p.add_argument("--no-tms", dest="tms", action="store_false",
                   help="skip the torch_memory_saver (peer) table even when it is installed")
    p.add_argument("--json", metavar="PATH", help="also write every number to PATH as JSON (after each table)")
    p.add_argument("--plot", metavar="PATH", type=plot.plot_path_arg,
                   help="also draw each table's ratios against its limit into the PNG file PATH (needs matplotlib)")
    p.add_argument("--from-json", metavar="JSON",
                   help="run nothing: print the tables of JSON (written by --json) again, and draw them with --plot")
    p.add_argument("--tms-child", choices=["preload", "torch"], help=argparse.SUPPRESS)


def resolve_backend(requested: str) -> str:
    """"cuda" or "sim"; raises SystemExit with a message when cuda is requested but unusable."""
    from .. import cuda_available

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


def _describe(ctx: Context) -> None:
    """The run's common metrics and its first line."""
    specs = reference_workload(ctx.scale, ctx.args.kv_gib)
    wbytes, kvbytes = total_bytes(specs, WEIGHTS_TAG), total_bytes(specs, KV_TAG)
    m = ctx.res.metrics
    m.update(backend=ctx.backend, scale=ctx.scale, weights_bytes=wbytes, kv_bytes=kvbytes, tensors=len(specs),
             tables=list(ctx.args.only))
    if not ctx.gpu:
        m["granularity"] = sim_granularity(ctx.scale)
        say(f"simulated device: scale 1/{ctx.scale}, {len(specs)} tensors, weights {fmt_bytes(wbytes)}, "
            f"granularity {fmt_bytes(m['granularity'])}; tables {', '.join(ctx.args.only)}")
        return
    torch = ctx.torch
    m.update(device=torch.cuda.get_device_name(ctx.device), torch=torch.__version__)
    free, total = torch.cuda.mem_get_info(ctx.device)
    say(f"{m['device']}: scale 1/{ctx.scale}, {len(specs)} tensors, weights {fmt_bytes(wbytes)}, kv_cache "
        f"{fmt_bytes(kvbytes)}, GPU free {fmt_bytes(free)} of {fmt_bytes(total)}; tables {', '.join(ctx.args.only)}")


def run(args: argparse.Namespace) -> int:
    # No --cycles: each table's own default (the RL loop's is longer: its cycles are the measurement).
    args.rl_cycles = rl_loop.DEFAULT_CYCLES if args.cycles is None else args.cycles
    if args.cycles is None:
        args.cycles = DEFAULT_CYCLES
    if args.scale is not None and args.scale < 1:
        raise SystemExit("error: --scale must be >= 1")
    if args.cycles < 0 or args.malloc_count < 1 or args.kv_gib < 0:
        raise SystemExit("error: --cycles and --kv-gib must be >= 0 and --malloc-count >= 1")
    if args.from_json:
        metrics, rows = plot.load_json(args.from_json)
        rl_loop.show(metrics)
        Results.from_rows(rows).print(f"cumem_rs benchmark ({args.from_json})")
        if args.plot:
            plot.plot_file(rows, args.plot, f"cumem_rs benchmark ({os.path.basename(args.from_json)})",
                           metrics.get("rl_loop"))
        return 0
    if args.tms_child:
        out = peer_tms.tms_child(args)
        with open(args.json, "w") as f:
            json.dump(out, f)
        return 0
    if not args.tms:
        args.only = [t for t in args.only if t != "peer"]
    backend = resolve_backend(args.backend)
    ctx = Context(args, backend, Results(), args.scale or (1 if backend == "cuda" else DEFAULT_SIM_SCALE))
    _describe(ctx)
    seconds = ctx.res.metrics["table_seconds"] = {}
    title = f"cumem_rs sleep/wake benchmark ({backend}, scale 1/{ctx.res.metrics['scale']}, " \
            f"{ctx.res.metrics['tensors']} tensors)"
    try:
        for name, table in TABLES.items():
            if name in args.only:
                t0 = time.perf_counter()
                first_row = len(ctx.res.rows)
                table.run(ctx)
                seconds[name] = time.perf_counter() - t0
                say(f"table {name}: {seconds[name]:.1f} s")
                # Each table as soon as it is done, and the JSON so far: a run cut short keeps what it measured.
                if name == "rl_loop":
                    rl_loop.show(ctx.res.metrics)
                ctx.res.print(title, ctx.res.rows[first_row:])
                if args.json:
                    _write_json(ctx.res, args.json, partial=True)
        if "peer" in args.only:
            peer_tms.finish(ctx)
    except VerificationError as e:
        print(f"error: verification failed: {e}", file=sys.stderr)
        return 1
    if ctx.gpu:
        from .. import Allocator

        ctx.add_errors(Allocator.cuda().errors())
    m = ctx.res.metrics
    m["errors"] = ctx.errors
    publish(ctx.res, title, args.json)
    if args.plot:
        plot.plot_file(ctx.res.rows, args.plot, title, ctx.res.metrics.get("rl_loop"))
    return 0


def publish(res: Results, title: str, json_path: Optional[str]) -> None:
    """Print the tables (the RL loop's first) and the allocator's recorded errors; write every number to
    `json_path` when given."""
    rl_loop.show(res.metrics)
    res.print(title)
    if res.metrics.get("errors"):
        print(f"allocator recorded errors: {res.metrics['errors']}")
    if json_path:
        _write_json(res, json_path, partial=False)
        print(f"wrote {json_path}")


def _write_json(res: Results, path: str, partial: bool) -> None:
    with open(path, "w") as f:
        json.dump({"metrics": res.metrics, "rows": res.rows, "partial": partial}, f, indent=1)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cumem_rs.bench", description=(__doc__ or "").splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))
