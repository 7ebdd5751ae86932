"""Command line: `python -m cumem_rs {info,demo,bench}` (also installed as `cumem-rs`).

info   what this machine offers: the CUDA backend (devices, memory, granularity) and the simulated device.
demo   the main job: the reference workload (Llama-3-8B weights + KV cache) put to sleep and woken up, with its
       data and addresses verified; on the GPU through CuMemAllocator, else scaled down on the simulated device.
bench  the benchmark tables (sleep/wake, retained backups, wall time, allocation count, malloc, the peer)
       against the copy limit and raw driver calls, each selectable with --only (see cumem_rs.bench).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
from typing import Any, Callable, Iterator, Optional

from . import bench
from .bench import multi as bench_multi
from .workload import (
    add_workload_arguments,
    DEFAULT_KV_GIB,
    KV_TAG,
    WEIGHTS_TAG,
    AllocatorWorkload,
    TensorSpec,
    TorchWorkload,
    VerificationError,
    reference_workload,
    round_up,
    sim_granularity,
    total_bytes,
)

DEFAULT_DEMO_SIM_SCALE = 256


# ---------------------------------------------------------------------------------------------------------------
# info


def cmd_info(args: argparse.Namespace) -> int:
    from . import Allocator, __version__, _native, cuda_available

    print(f"cumem_rs {__version__} (extension {_native.__file__})")
    print(f"python {platform.python_version()} on {platform.system()} {platform.machine()}")
    try:
        import torch

        print(f"torch {torch.__version__}, torch.cuda.is_available() = {torch.cuda.is_available()}")
    except ImportError:
        print("torch not installed (only the core Allocator is usable)")

    if cuda_available():
        print("cuda backend: available")
        try:
            a = Allocator.cuda()
            for d in range(a.device_count()):
                free, total = a.mem_info(d)
                print(f"  device {d}: {bench.fmt_bytes(free)} free of {bench.fmt_bytes(total)}, "
                      f"granularity {bench.fmt_bytes(a.granularity(d))}")
        except Exception as e:  # available but unusable (e.g. no VMM support): say why, keep going
            print(f"  error: {type(e).__name__}: {e}")
    else:
        print("cuda backend: not available (no libcuda or no device); the simulated device still works")

    from ._nvcomp import status_lines

    for line in status_lines():
        print(line)

    sim = Allocator.simulated()
    try:
        for d in range(sim.device_count()):
            free, total = sim.mem_info(d)
            print(f"sim backend: device {d}: {bench.fmt_bytes(free)} free of {bench.fmt_bytes(total)}, "
                  f"granularity {bench.fmt_bytes(sim.granularity(d))} (defaults of Allocator.simulated())")
    finally:
        sim.close()
    return 0


# ---------------------------------------------------------------------------------------------------------------
# demo


@contextlib.contextmanager
def _progress(description: str, total: int) -> Iterator[Callable[[], None]]:
    """A rich progress bar on a terminal; silent when piped or when rich is missing."""
    try:
        from rich.console import Console
        from rich.progress import Progress
    except ImportError:
        yield lambda: None
        return
    if not Console().is_terminal:
        yield lambda: None
        return
    with Progress(transient=True) as p:
        task = p.add_task(description, total=total)
        yield lambda: p.advance(task)


class _Steps:
    """Rows of the summary table: step, bytes, seconds, GB/s."""

    def __init__(self) -> None:
        self.rows: list[list[str]] = []

    def add(self, name: str, nbytes: Optional[int], seconds: float) -> None:
        gbps = f"{nbytes / seconds / 1e9:.2f}" if nbytes and seconds > 0 else ""
        self.rows.append([name, bench.fmt_bytes(nbytes), bench.fmt_seconds(seconds), gbps])
        bench.say(f"{name}: {bench.fmt_seconds(seconds)}")

    def finish(self, title: str, errors: list, ok_line: str) -> int:
        """Print the table, then the allocator's recorded errors (exit status 1) or `ok_line` (0)."""
        bench.print_table(title, ["step", "bytes", "time", "GB/s"], self.rows)
        if errors:
            print(f"allocator recorded errors: {errors}", file=sys.stderr)
            return 1
        print(ok_line)
        return 0


def _check_asleep(mapped_after_sleep: int) -> None:
    # sleep releases the physical memory of every awake allocation, whatever its tag.
    if mapped_after_sleep != 0:
        raise VerificationError(f"{mapped_after_sleep} bytes still mapped after sleep")


def demo_sim(args: argparse.Namespace) -> int:
    from . import Allocator

    scale = args.scale or DEFAULT_DEMO_SIM_SCALE
    specs = reference_workload(scale, args.kv_gib)
    gran = sim_granularity(scale)
    capacity = sum(round_up(s.nbytes, gran) for s in specs) + 16 * gran
    wbytes, kvbytes = total_bytes(specs, WEIGHTS_TAG), total_bytes(specs, KV_TAG)
    print(f"simulated device (no GPU used): reference workload at 1/{scale} scale: {len(specs)} tensors, "
          f"weights {bench.fmt_bytes(wbytes)}, kv_cache {bench.fmt_bytes(kvbytes)}, "
          f"granularity {bench.fmt_bytes(gran)}")
    steps = _Steps()
    alloc = Allocator.simulated(capacity=capacity, granularity=gran)
    try:
        wl = AllocatorWorkload(alloc, specs, seed=args.seed)
        _, t = bench.timed(wl.allocate)
        steps.add(f"malloc {len(specs)} tensors (tags weights, kv_cache)", wbytes + kvbytes, t)
        written, t = bench.timed(lambda: wl.fill(WEIGHTS_TAG))
        steps.add("write weights (random bytes)", written, t)
        addrs = list(wl.addresses)
        kv_addr = wl.addresses[-1] if kvbytes else None
        kv_head = b"\x5a" * min(4096, kvbytes)
        if kv_addr is not None:
            alloc.write(kv_addr, kv_head)

        for c in range(1, args.cycles + 1):
            used_before = alloc.usage()
            report, t = bench.timed(lambda: alloc.sleep(WEIGHTS_TAG))
            used_asleep = alloc.usage()
            _check_asleep(used_asleep)
            steps.add(f"sleep #{c} (offload weights, discard kv_cache)", wbytes, t)
            # Backed up = copied now + retained from the last wake and unchanged since (not copied again).
            copied, skipped = report["copied_bytes"], report["skipped_bytes"]
            print(f"  device memory mapped: {bench.fmt_bytes(used_before)} -> {bench.fmt_bytes(used_asleep)} "
                  f"asleep (freed {bench.fmt_bytes(used_before - used_asleep)}); host backup "
                  f"{bench.fmt_bytes(alloc.host_bytes())}; backed up {bench.fmt_bytes(copied + skipped)} "
                  f"({bench.fmt_bytes(copied)} copied, {bench.fmt_bytes(skipped)} unchanged since the wake), "
                  f"discarded {bench.fmt_bytes(report['discarded_bytes'])}")
            _, t = bench.timed(alloc.wake_up)
            steps.add(f"wake_up #{c}", wbytes, t)
            checked, t = bench.timed(lambda: wl.verify(WEIGHTS_TAG, addrs))
            steps.add(f"verify #{c}: weights bit-identical, same addresses", checked, t)
            if kv_addr is not None:
                kept = alloc.read(kv_addr, len(kv_head)) == kv_head
                print(f"  kv_cache after wake: {'still holds' if kept else 'no longer holds'} the bytes written "
                      f"before sleep (discarded: contents undefined)")
                alloc.write(kv_addr, kv_head)
        _, t = bench.timed(wl.free)
        steps.add("free all", None, t)
        errors = alloc.errors()
    finally:
        alloc.close()
    return steps.finish(f"cumem_rs demo: simulated device, scale 1/{scale}", errors,
                        f"OK: {args.cycles} sleep/wake cycle(s), weights verified bit-identical at unchanged addresses")


def demo_cuda(args: argparse.Namespace) -> int:
    import torch

    from . import Allocator
    from .allocator import CuMemAllocator

    scale = args.scale or 1
    device = torch.cuda.current_device()
    specs: list[TensorSpec] = reference_workload(scale, args.kv_gib)
    wbytes, kvbytes = total_bytes(specs, WEIGHTS_TAG), total_bytes(specs, KV_TAG)
    free, total = torch.cuda.mem_get_info(device)
    print(f"{torch.cuda.get_device_name(device)}: reference workload at 1/{scale} scale: {len(specs)} tensors, "
          f"weights {bench.fmt_bytes(wbytes)}, kv_cache {bench.fmt_bytes(kvbytes)}; GPU free "
          f"{bench.fmt_bytes(free)} of {bench.fmt_bytes(total)}")
    if wbytes + kvbytes > free:
        print(f"error: the workload needs {bench.fmt_bytes(wbytes + kvbytes)} of GPU memory; use --scale or "
              f"--kv-gib", file=sys.stderr)
        return 1
    sync = torch.cuda.synchronize
    steps = _Steps()
    cumem = CuMemAllocator.get_instance()
    core = Allocator.cuda()
    wl = TorchWorkload(specs, device=device, seed=args.seed)
    with _progress("allocating", len(specs)) as advance:
        _, t = bench.timed(lambda: wl.allocate(cumem, advance), sync)
    steps.add(f"torch.empty {len(specs)} tensors in use_memory_pool (weights, kv_cache)", wbytes + kvbytes, t)
    written, t = bench.timed(lambda: wl.fill(WEIGHTS_TAG), sync)
    steps.add("fill weights (random bits)", written, t)
    _, t = bench.timed(lambda: wl.checksum(WEIGHTS_TAG), sync)
    steps.add("checksum weights (per 2 MiB)", wbytes, t)

    for c in range(1, args.cycles + 1):
        free_before = torch.cuda.mem_get_info(device)[0]
        mapped_before = core.usage(device)
        _, t = bench.timed(lambda: cumem.sleep(offload_tags=WEIGHTS_TAG), sync)
        mapped_asleep = core.usage(device)
        _check_asleep(mapped_asleep)
        free_asleep = torch.cuda.mem_get_info(device)[0]
        steps.add(f"sleep #{c} (offload weights, discard kv_cache)", wbytes, t)
        print(f"  GPU free {bench.fmt_bytes(free_before)} -> {bench.fmt_bytes(free_asleep)} "
              f"(freed {bench.fmt_bytes(free_asleep - free_before)}); mapped by cumem_rs "
              f"{bench.fmt_bytes(mapped_before)} -> {bench.fmt_bytes(mapped_asleep)}; "
              f"host backup {bench.fmt_bytes(core.host_bytes())}")
        _, t = bench.timed(cumem.wake_up, sync)
        steps.add(f"wake_up #{c}", wbytes, t)
        checked, t = bench.timed(lambda: wl.verify(WEIGHTS_TAG), sync)
        steps.add(f"verify #{c}: checksums and data_ptrs unchanged", checked, t)
    errors = core.errors()
    wl.release()
    return steps.finish(f"cumem_rs demo: {torch.cuda.get_device_name(device)}, scale 1/{scale}", errors,
                        f"OK: {args.cycles} sleep/wake cycle(s), weights verified bit-identical at unchanged data_ptrs")


def cmd_demo(args: argparse.Namespace) -> int:
    if args.scale is not None and args.scale < 1:
        raise SystemExit("error: --scale must be >= 1")
    if args.cycles < 1:
        raise SystemExit("error: --cycles must be >= 1")
    backend = bench.resolve_backend(args.backend)
    try:
        return demo_cuda(args) if backend == "cuda" else demo_sim(args)
    except VerificationError as e:
        print(f"error: verification failed: {e}", file=sys.stderr)
        return 1


# ---------------------------------------------------------------------------------------------------------------
# parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cumem-rs",
        description="Put PyTorch GPU memory to sleep and wake it up at the same virtual addresses.",
        epilog="Run `cumem-rs COMMAND --help` for the options of a command.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = sub.add_parser("info", help="backends, devices, memory and granularity",
                          description="Show the CUDA backend (devices, free/total memory, granularity) and the "
                                      "simulated device.")
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser("demo", help="sleep/wake the reference workload and verify it",
                          description="Allocate the reference workload (Llama-3-8B bf16 weights under 'weights', a "
                                      "KV cache under 'kv_cache'), fill the weights, sleep (offload weights, discard "
                                      "the KV cache), wake up, and verify data and addresses. Exit code 1 when "
                                      "verification fails.")
    add_workload_arguments(demo, sim_scale=DEFAULT_DEMO_SIM_SCALE, kv_gib=DEFAULT_KV_GIB, cycles=1,
                           cycles_help="sleep/wake cycles")
    demo.add_argument("--seed", type=int, default=0, help="seed of the weights' random content")
    demo.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="sleep/wake, retained-backup, allocation-count and malloc benchmarks",
                       description=(bench.__doc__ or "").strip(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(b)
    b.set_defaults(func=bench.run)

    bm = sub.add_parser("bench-multi", help="aggregate sleep/wake bandwidth of several GPUs in one process",
                        description=(bench_multi.__doc__ or "").strip(),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_multi.add_arguments(bm)
    bm.set_defaults(func=bench_multi.run)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from . import CumemError

    try:
        rc: Any = args.func(args)
    except CumemError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
