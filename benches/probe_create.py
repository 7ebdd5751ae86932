"""Time cuMemCreate+cuMemMap+cuMemSetAccess of one large allocation with and without the GPUDirect RDMA flag.

Why: waking a discarded 48 GiB KV cache costs far more than the raw driver calls in bench.py, which create
without that flag. Run on a GPU: python benches/probe_create.py [GiB]
"""

import sys
import time

from cumem_rs.bench import RawDriver


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 48.0
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
        print(f"rdma={rdma}: create+map+access {1e3 * (t1 - t0):8.2f} ms, unmap+release {1e3 * (t2 - t1):8.2f} ms")
    raw.address_free(ptr, size)


if __name__ == "__main__":
    main()
