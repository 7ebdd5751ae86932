"""Does the way host memory is pinned limit host->device copies when several GPUs copy at once?

torch `copy_` (no cumem_rs involved) from two kinds of page-locked host memory into every visible GPU, first one
GPU alone, then all GPUs at once:
- "driver": `torch.empty(pin_memory=True)` (cudaHostAlloc), what the benchmarks call the limit;
- "registered": anonymous mmap + MADV_HUGEPAGE + first touch + cudaHostRegister, the way cumem_rs pins its
  host backups (see rust/src/host/).
Also prints how much of the registered memory the kernel backed with huge pages (AnonHugePages).

Run on a GPU: python benches/probe_pinning.py [GiB per device]
"""

import mmap
import sys
import time

import torch

GiB = 1 << 30


def anon_huge_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


def registered(nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.fill_(1)  # first touch, on torch's CPU threads
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 1)  # cudaHostRegisterPortable
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {rc}")
    return t, m


def h2d_seconds(hosts: list[torch.Tensor], devs: list[torch.Tensor], reps: int = 3) -> float:
    streams = [torch.cuda.Stream(device=d.device) for d in devs]
    best = float("inf")
    for _ in range(reps):
        for d in devs:
            torch.cuda.synchronize(d.device)
        t0 = time.perf_counter()
        for h, d, s in zip(hosts, devs, streams):
            with torch.cuda.stream(s):
                d.copy_(h, non_blocking=True)
        for s in streams:
            s.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    nbytes = int(float(sys.argv[1]) * GiB) if len(sys.argv) > 1 else 8 * GiB
    n = torch.cuda.device_count()
    devs = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}") for i in range(n)]
    print(f"{n} GPU(s), {nbytes / GiB:.1f} GiB per device; AnonHugePages before: {anon_huge_bytes() / GiB:.2f} GiB")
    kinds = {}
    kinds["driver"] = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1) for _ in range(n)]
    keep = [registered(nbytes) for _ in range(n)]
    kinds["registered"] = [t for t, _ in keep]
    print(f"AnonHugePages with the registered buffers: {anon_huge_bytes() / GiB:.2f} GiB")
    for name, hosts in kinds.items():
        alone = h2d_seconds(hosts[:1], devs[:1])
        together = h2d_seconds(hosts, devs)
        print(f"{name:>10}: 1 GPU {nbytes / alone / 1e9:6.1f} GB/s, {n} GPUs at once "
              f"{n * nbytes / together / 1e9:6.1f} GB/s")
    for t, _ in keep:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


if __name__ == "__main__":
    main()
