"""Probe: what the per-allocation driver calls of sleep and wake cost, whether they wait for copies in flight,
and whether they run faster spread over threads. Raw ctypes calls on libcuda (no cumem_rs in between).

For each shape (count x size): per-call create / map / set access / unmap / release on an idle GPU; the same
create+map+access and unmap+release while a large host->device copy runs on another stream (does the call wait
for it?); and create+map+access / unmap+release spread over 2, 4 and 8 threads.

    python benches/probe_driver_calls.py [--shapes 1024x12,6144x2] [--copy-gib 12]
"""

from __future__ import annotations

import argparse
import ctypes
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from cumem_rs.bench import RawDriver

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1024x12,6144x2", help="COUNTxMIB,...")
    ap.add_argument("--copy-gib", type=float, default=12.0)
    ap.add_argument("--threads", default="2,4,8")
    args = ap.parse_args()
    torch.zeros(1, device="cuda")
    raw = RawDriver(0)
    lib = raw.lib
    ctx = ctypes.c_void_p()
    lib.cuCtxGetCurrent(ctypes.byref(ctx))
    host = torch.empty(int(args.copy_gib * (1 << 30)), dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    side = torch.cuda.Stream()

    def copy_in_flight() -> torch.cuda.Event:
        with torch.cuda.stream(side):
            dev.copy_(host, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
        return ev

    def t_copy() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        copy_in_flight().synchronize()
        return time.perf_counter() - t

    copy_s = min(t_copy() for _ in range(2))
    print(f"host->device copy of {args.copy_gib:.0f} GiB alone: {copy_s * 1e3:.1f} ms")

    for shape in args.shapes.split(","):
        count, mib = (int(x) for x in shape.split("x"))
        size = mib * MiB
        ptrs = [raw.reserve(size) for _ in range(count)]
        handles = [0] * count
        h = ctypes.c_uint64()

        def create(i: int) -> None:
            raw._check(lib.cuMemCreate(ctypes.byref(h), size, ctypes.byref(raw.prop), 0), "cuMemCreate")
            handles[i] = h.value

        def map_(i: int) -> None:
            raw._check(lib.cuMemMap(ptrs[i], size, 0, handles[i], 0), "cuMemMap")

        def access(i: int) -> None:
            raw._check(lib.cuMemSetAccess(ptrs[i], size, ctypes.byref(raw.access), 1), "cuMemSetAccess")

        def unmap(i: int) -> None:
            raw._check(lib.cuMemUnmap(ptrs[i], size), "cuMemUnmap")

        def release(i: int) -> None:
            raw._check(lib.cuMemRelease(handles[i]), "cuMemRelease")

        def up(i: int) -> None:
            hh = ctypes.c_uint64()
            raw._check(lib.cuMemCreate(ctypes.byref(hh), size, ctypes.byref(raw.prop), 0), "cuMemCreate")
            handles[i] = hh.value
            map_(i)
            access(i)

        def down(i: int) -> None:
            unmap(i)
            release(i)

        def each(fn) -> float:
            t = time.perf_counter()
            for i in range(count):
                fn(i)
            return time.perf_counter() - t

        per = {}
        for name, fn in (("create", create), ("map", map_), ("set_access", access), ("unmap", unmap), ("release", release)):
            per[name] = each(fn)
        line = ", ".join(f"{k} {v / count * 1e6:.1f} us" for k, v in per.items())
        print(f"\n{count} x {mib} MiB, serial, idle GPU, per call: {line}")
        print(f"  whole wake-side (create+map+access) {sum(per[k] for k in ('create', 'map', 'set_access')) * 1e3:.1f} ms, "
              f"sleep-side (unmap+release) {(per['unmap'] + per['release']) * 1e3:.1f} ms; copy of {count * size / 2**30:.1f} GiB "
              f"at 55 GB/s would take {count * size / 55e9 * 1e3:.1f} ms")

        for label, fn in (("create+map+access", up), ("unmap+release", down)):
            torch.cuda.synchronize()
            ev = copy_in_flight()
            t = time.perf_counter()
            for i in range(count):
                fn(i)
            calls = time.perf_counter() - t
            done_before = ev.query()
            ev.synchronize()
            total = time.perf_counter() - t
            print(f"  {label:18s} with a {copy_s * 1e3:.0f} ms copy in flight: calls {calls * 1e3:.1f} ms "
                  f"(copy already done when they returned: {done_before}); all done {total * 1e3:.1f} ms")

        for threads in (int(x) for x in args.threads.split(",")):
            def run(fn, part: list[int]) -> None:
                lib.cuCtxSetCurrent(ctx)
                for i in part:
                    fn(i)

            parts = [list(range(k, count, threads)) for k in range(threads)]
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(lambda p: lib.cuCtxSetCurrent(ctx), range(threads)))
                res = []
                for label, fn in (("create+map+access", up), ("unmap+release", down)):
                    t = time.perf_counter()
                    list(ex.map(lambda p: run(fn, p), parts))
                    res.append(f"{label} {(time.perf_counter() - t) * 1e3:.1f} ms")
            print(f"  {threads} threads: " + ", ".join(res))
        for p in ptrs:
            raw.address_free(p, size)


if __name__ == "__main__":
    main()
