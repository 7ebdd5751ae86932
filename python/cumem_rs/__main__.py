"""Command line: `python -m cumem_rs {info,demo,bench}` (also installed as `cumem-rs`).

info   what this machine offers: the CUDA backend (devices, memory, granularity) and the simulated device.
demo   the main job (cumem_rs.demo): the reference workload (Llama-3-8B bf16 weights + KV cache) put to sleep and
       woken up for three cycles, every wake verified, against the link measured in the same run; on the GPU
       through CuMemAllocator, else scaled down on the simulated device (what was checked, no rates).
bench  the benchmark tables (first the RL loop in the default configuration, compressed and raw; then sleep/wake,
       retained backups, wall time, allocation count, malloc, the peer)
       against the copy limit and raw driver calls, each selectable with --only (see cumem_rs.bench).
"""

from __future__ import annotations

import argparse
import platform
import sys
from typing import Any, Optional

from . import bench, demo
from .bench import multi as bench_multi


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

    d = sub.add_parser("demo", help="the product's story: sleep/wake of the reference workload, verified",
                       description=(demo.__doc__ or "").strip(), formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(d)
    d.set_defaults(func=demo.run)

    b = sub.add_parser("bench", help="the RL-loop table first (default configuration, compressed and raw), then sleep/wake, retained-backup, allocation-count and malloc benchmarks",
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
