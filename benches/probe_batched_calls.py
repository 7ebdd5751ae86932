"""Probe: what the driver's wake and sleep calls cost when several allocations share one reserved address range
and the calls cover many of them at once. Raw ctypes calls on libcuda (no cumem_rs in between).

Answers, for COUNT allocations of SIZE laid side by side in one reservation:
- cuMemSetAccess over K adjacent mappings in one call (K = 1, 8, 64, 512): cost per allocation;
- cuMemUnmap over K adjacent whole mappings in one call: allowed? cost per allocation;
- the same calls across two separate reservations that happen to be adjacent: allowed?
- cuMemSetAccess / cuMemUnmap over a range with an unmapped hole: refused?
- cuMemAddressReserve / cuMemAddressFree of one allocation (what a shared reservation saves at malloc);
- the wake side (create + map each, set access per K) and sleep side (unmap per K, release each) while a
  large host->device copy is in flight on another stream.

    python benches/probe_batched_calls.py [--count 6144] [--mib 2] [--copy-gib 12]
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from cumem_rs.bench import RawDriver

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=6144)
    ap.add_argument("--mib", type=int, default=2)
    ap.add_argument("--copy-gib", type=float, default=12.0)
    ap.add_argument("--groups", default="1,8,64,512")
    args = ap.parse_args()
    torch.zeros(1, device="cuda")
    raw = RawDriver(0)
    lib = raw.lib
    count, size = args.count, args.mib * MiB
    base = raw.reserve(count * size)
    ptrs = [base + i * size for i in range(count)]
    handles = [0] * count

    def create(i: int) -> None:
        handles[i] = raw.create(size)

    def map_(i: int) -> None:
        raw.map(ptrs[i], size, handles[i])

    def release(i: int) -> None:
        raw._check(lib.cuMemRelease(handles[i]), "cuMemRelease")

    def access_run(i: int, k: int) -> int:
        return lib.cuMemSetAccess(ptrs[i], k * size, ctypes.byref(raw.access), 1)

    def unmap_run(i: int, k: int) -> int:
        return lib.cuMemUnmap(ptrs[i], k * size)

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    for i in range(count):
        create(i)
    print(f"{count} x {args.mib} MiB in one reservation")
    for k in (int(x) for x in args.groups.split(",")):
        k = min(k, count)
        runs = range(0, count - count % k, k)
        for i in range(count):
            map_(i)
        t_acc = timed(lambda: [raw._check(access_run(i, k), f"cuMemSetAccess over {k}") for i in runs])
        rc = unmap_run(0, k)
        if rc == 0:
            t_un = timed(lambda: [raw._check(unmap_run(i, k), f"cuMemUnmap over {k}") for i in runs[1:]])
            un = f"unmap over {k}: {t_un / max(1, (len(runs) - 1) * k) * 1e6:.2f} us per allocation"
        else:
            un = f"unmap over {k} refused (CUresult {rc})"
            for i in range(count):
                raw._check(lib.cuMemUnmap(ptrs[i], size), "cuMemUnmap")
        if rc == 0:
            for i in range(len(runs) * k, count):
                raw._check(lib.cuMemUnmap(ptrs[i], size), "cuMemUnmap")
        print(f"  K={k:4d}: set access {t_acc / (len(runs) * k) * 1e6:.2f} us per allocation "
              f"({t_acc / len(runs) * 1e6:.1f} us per call); {un}")

    # Holes and separate reservations.
    map_(0)
    map_(2)
    rc_acc_hole = access_run(0, 3)
    rc_un_hole = unmap_run(0, 3)
    print(f"  range with an unmapped hole: set access CUresult {rc_acc_hole}, unmap CUresult {rc_un_hole}")
    for i in (0, 2):
        lib.cuMemUnmap(ptrs[i], size)
    a = raw.reserve(size)
    p = ctypes.c_uint64()
    rc_b = lib.cuMemAddressReserve(ctypes.byref(p), size, 0, a + size, 0)
    if rc_b == 0 and p.value == a + size:
        lib.cuMemMap(a, size, 0, handles[0], 0)
        lib.cuMemMap(a + size, size, 0, handles[1], 0)
        rc_acc = lib.cuMemSetAccess(a, 2 * size, ctypes.byref(raw.access), 1)
        rc_un = lib.cuMemUnmap(a, 2 * size)
        if rc_un != 0:
            lib.cuMemUnmap(a, size)
            lib.cuMemUnmap(a + size, size)
        print(f"  two adjacent reservations: set access across CUresult {rc_acc}, unmap across CUresult {rc_un}")
        lib.cuMemAddressFree(a + size, size)
    else:
        print(f"  two adjacent reservations: could not place the second one (rc {rc_b}, at {p.value:#x})")
    lib.cuMemAddressFree(a, size)
    t_res = []
    for _ in range(200):
        t = time.perf_counter()
        q = raw.reserve(size)
        t1 = time.perf_counter()
        raw.address_free(q, size)
        t_res.append((t1 - t, time.perf_counter() - t1))
    print(f"  reserve {sum(x for x, _ in t_res) / 200 * 1e6:.2f} us, address free {sum(y for _, y in t_res) / 200 * 1e6:.2f} us")
    for i in range(count):
        release(i)

    # Wake and sleep sides under a copy, per-allocation calls against runs of K.
    host = torch.empty(int(args.copy_gib * (1 << 30)), dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    side = torch.cuda.Stream()

    def copy_in_flight() -> torch.cuda.Event:
        with torch.cuda.stream(side):
            dev.copy_(host, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
        return ev

    torch.cuda.synchronize()
    t = time.perf_counter()
    copy_in_flight().synchronize()
    copy_s = time.perf_counter() - t
    print(f"\nhost->device copy of {args.copy_gib:.0f} GiB alone: {copy_s * 1e3:.1f} ms")
    for k in (1, 64):
        torch.cuda.synchronize()
        ev = copy_in_flight()
        t = time.perf_counter()
        for i0 in range(0, count, k):
            kk = min(k, count - i0)
            for i in range(i0, i0 + kk):
                create(i)
                map_(i)
            raw._check(access_run(i0, kk), "cuMemSetAccess")
        up = time.perf_counter() - t
        ev.synchronize()
        torch.cuda.synchronize()
        ev = copy_in_flight()
        t = time.perf_counter()
        for i0 in range(0, count, k):
            kk = min(k, count - i0)
            rc = unmap_run(i0, kk)
            if rc != 0:
                for i in range(i0, i0 + kk):
                    raw._check(lib.cuMemUnmap(ptrs[i], size), "cuMemUnmap")
            for i in range(i0, i0 + kk):
                release(i)
        down = time.perf_counter() - t
        ev.synchronize()
        print(f"  runs of {k:3d}, with the copy in flight: create+map+access {up * 1e3:.1f} ms, "
              f"unmap+release {down * 1e3:.1f} ms")
    raw.address_free(base, count * size)


if __name__ == "__main__":
    main()
