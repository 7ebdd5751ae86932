"""Probe: the fingerprint kernel's bandwidth and a sleep of unchanged / 1%-changed / rewritten weights against
the pinned copy of the same bytes, through the core allocator on CUDA. One process, one run; ratios only.

    python benches/probe_fingerprint.py [--gib 15] [--count 128]
"""

from __future__ import annotations

import argparse
import ctypes
import random
import time

import torch

import cumem_rs

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=15.0)
    ap.add_argument("--count", type=int, default=128)
    ap.add_argument("--kv-gib", type=float, default=48.0)
    ap.add_argument("--gap", type=float, default=0.0, help="seconds between each sleep and the wake after it")
    args = ap.parse_args()
    torch.zeros(1, device="cuda")  # makes the primary context current on this thread (for the raw memsets)
    a = cumem_rs.Allocator.cuda()
    gran = a.granularity(0)
    size = max(gran, int(args.gib * (1 << 30) / args.count) // gran * gran)
    total = size * args.count
    cuda = ctypes.CDLL("libcuda.so.1")
    a.push_tag("weights")
    addrs = [a.malloc(size, 0) for _ in range(args.count)]
    a.pop_tag()
    a.push_tag("kv_cache")
    kv = a.malloc(int(args.kv_gib * (1 << 30)), 0) if args.kv_gib else None
    a.pop_tag()
    for i, p in enumerate(addrs):
        assert cuda.cuMemsetD32_v2(ctypes.c_uint64(p), ctypes.c_uint(0x01010101 * (i % 200 + 1)), size // 4) == 0
    torch.cuda.synchronize()

    # The physical limit: torch copy_ device -> pinned host of the same bytes.
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    copy_s = min(times)
    del dev, host
    torch.cuda.empty_cache()

    # Kernel bandwidth: fingerprints of every weight allocation, one call each (includes a sync per call).
    t = time.perf_counter()
    for p in addrs:
        a.fingerprints(p, size)
    fp_s = time.perf_counter() - t
    print(f"weights {total / 2**30:.2f} GiB as {args.count} x {size // MiB} MiB; pinned copy {copy_s * 1e3:.1f} ms "
          f"({total / copy_s / 1e9:.1f} GB/s); fingerprints {fp_s * 1e3:.1f} ms ({total / fp_s / 1e9:.0f} GB/s, "
          f"{args.count} calls)")

    def sleep_wake(label: str) -> None:
        t = time.perf_counter()
        rep = a.sleep(["weights"])
        s = time.perf_counter() - t
        time.sleep(args.gap)
        t = time.perf_counter()
        w = a.wake_up(None)
        ws = time.perf_counter() - t
        print(f"{label:28s} sleep {s * 1e3:8.1f} ms = {s / copy_s:5.3f}x copy time (copied {rep['copied_bytes'] / 2**30:6.2f} GiB, "
              f"skipped {rep['skipped_bytes'] / 2**30:6.2f} GiB, fingerprint {rep['fingerprint_seconds'] * 1e3:6.1f} ms) | "
              f"wake {ws * 1e3:7.1f} ms = {copy_s / ws:5.3f}x copy limit (restored {w['copied_bytes'] / 2**30:.2f} GiB)")

    sleep_wake("cold first sleep")
    sleep_wake("steady, unchanged")
    sleep_wake("steady, unchanged")
    rng = random.Random(1)
    chunk = 2 * MiB
    chunks = [(p, off) for p in addrs for off in range(0, size, chunk)]
    for p, off in rng.sample(chunks, max(1, len(chunks) // 100)):
        assert cuda.cuMemsetD32_v2(ctypes.c_uint64(p + off + 1024), ctypes.c_uint(0xDEADBEEF), 1) == 0
    sleep_wake("1% of chunks rewritten")
    for i, p in enumerate(addrs):
        assert cuda.cuMemsetD32_v2(ctypes.c_uint64(p), ctypes.c_uint(0x02020202 * (i % 100 + 1)), size // 4) == 0
    sleep_wake("all rewritten")
    # Verify every allocation's contents after the last wake.
    for i, p in enumerate(addrs):
        want = bytes([2 * (i % 100 + 1) & 0xFF]) * 4096
        assert a.read(p, 4096) == want and a.read(p + size - 4096, 4096) == want, f"allocation {i} corrupted"
    a.set_retain_backups(False)
    sleep_wake("retain off (steady)")
    sleep_wake("retain off (steady)")
    for p in addrs:
        a.free(p)
    if kv:
        a.free(kv)
    print("verified; errors:", a.errors())


if __name__ == "__main__":
    main()
