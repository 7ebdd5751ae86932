"""Where do the fixed costs of sleep/wake go? Three probes on one GPU, printed as a small table:

1. cuMemCreate+cuMemMap+cuMemSetAccess of one large allocation (raw ctypes calls, with and without the
   GPUDirect RDMA flag) against the core allocator's malloc, discard and wake of the same size;
2. pinning host memory in one piece (`reserve_host`: mmap, parallel first touch, one cuMemHostRegister);
3. the torch-layer extras around the core sleep (gc.collect, torch.cuda.empty_cache).

Run on a GPU: python benches/probe_create.py [GiB]
"""

import gc
import sys
import time

import torch

import cumem_rs
from cumem_rs.bench import RawDriver


def ms(t: float) -> str:
    return f"{1e3 * t:9.2f} ms"


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 48.0
    torch.zeros(1, device="cuda")  # initialise the driver and the primary context
    raw = RawDriver(0)
    size = -(-int(gib * (1 << 30)) // raw.granularity) * raw.granularity
    ptr = raw.reserve(size)
    for rdma in (0, 1, 0, 1):
        raw.prop.allocFlags.gpuDirectRDMACapable = rdma
        t0 = time.perf_counter()
        handle = raw.create_map(ptr, size)
        t1 = time.perf_counter()
        raw.unmap_release(ptr, size, handle)
        t2 = time.perf_counter()
        print(f"raw rdma={rdma}: create+map+access {ms(t1 - t0)}, unmap+release {ms(t2 - t1)}")
    raw.address_free(ptr, size)

    core = cumem_rs.Allocator.cuda()
    core.push_tag("probe")
    t0 = time.perf_counter()
    p = core.malloc(size)
    t1 = time.perf_counter()
    core.pop_tag()
    for i in range(2):
        d = core.discard("probe")
        w = core.wake_up(["probe"])
        print(f"core #{i}: discard {ms(d['seconds'])}, wake (map only) {ms(w['seconds'])}")
    core.free(p)
    print(f"core malloc {ms(t1 - t0)}")

    for i in range(2):
        t0 = time.perf_counter()
        core.reserve_host(16 << 30)
        t1 = time.perf_counter()
        core.trim_host()
        t2 = time.perf_counter()
        print(f"reserve_host 16 GiB #{i}: {ms(t1 - t0)} ({16 * 1.073741824 / (t1 - t0):.1f} GB/s), trim {ms(t2 - t1)}")

    t0 = time.perf_counter()
    gc.collect()
    t1 = time.perf_counter()
    torch.cuda.empty_cache()
    t2 = time.perf_counter()
    print(f"gc.collect {ms(t1 - t0)}, torch.cuda.empty_cache {ms(t2 - t1)}")


if __name__ == "__main__":
    main()
