"""Sleep and wake cost against the pin chunk: `python benches/pin_chunk.py [--cuda] [MiB ...]`.

A small pin chunk splits the host arena into many separately registered pieces (one per chunk), and every copy
must stay inside one of them. The allocator's lookups over those pieces must stay logarithmic, so that sleep and
wake cost grows with the bytes, not with their square: at 4 KiB the times per MiB should stay about flat as the
size doubles, as they do at 2 MiB. Not a timed test: it prints the times, for a person to compare.

For each size (default 1024 MiB) and pin chunk (4 KiB, 2 MiB): the size as allocations of 16 MiB, a cold sleep
(the arena is pinned chunk by chunk during the copies), a wake, a steady sleep (the arena is cached and pinned
already), a wake; the contents are checked after the last wake. Retained backups are off, so that the steady
sleep copies every byte again instead of comparing fingerprints. The simulated driver serves by default; `--cuda`
runs the same steps on the GPU through the process-wide CUDA allocator (driver copy counts are the sim's only).
"""

import sys
import time

from cumem_rs import _native

MiB = 1 << 20
ALLOC = 16 * MiB
CHUNKS = (4 << 10, 2 * MiB)


def timed(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def run(size_mib: int, chunk: int, cuda: bool) -> dict:
    size = size_mib * MiB
    a = _native.Allocator.cuda() if cuda else _native.Allocator.simulated(capacity=size, granularity=2 * MiB)
    addrs = []
    try:
        a.set_retain_backups(False)
        a.set_pin_chunk(chunk)
        addrs += [a.malloc(ALLOC) for _ in range(max(1, size // ALLOC))]
        # One marked page per allocation is enough to tell a lost or misplaced backup.
        for i, addr in enumerate(addrs):
            a.write(addr + ALLOC - 4096, bytes([i % 251 + 1]) * 4096)
        times = {
            "cold sleep": timed(lambda: a.sleep(["default"])),
            "wake": timed(a.wake_up),
            "steady sleep": timed(lambda: a.sleep(["default"])),
            "wake again": timed(a.wake_up),
        }
        for i, addr in enumerate(addrs):
            if a.read(addr + ALLOC - 4096, 4096) != bytes([i % 251 + 1]) * 4096:
                raise SystemExit(f"allocation {i}: contents lost across sleep/wake")
        if not cuda:
            counts = dict(a.driver_counts()["calls"])
            times["copies"] = counts.get("copy_d2h", 0) + counts.get("copy_h2d", 0)
        return times
    finally:
        if cuda:  # the process-wide allocator stays open for the next run
            for addr in addrs:
                a.free(addr)
            a.trim_host()
        else:
            a.close()


def main(argv: list[str]) -> int:
    cuda = "--cuda" in argv
    sizes = [int(s) for s in argv if s != "--cuda"] or [1024]
    print(f"{'MiB':>6} {'pin chunk':>9} {'cold sleep':>11} {'wake':>8} {'steady sleep':>13} {'wake':>8} {'copies':>8}")
    for size in sizes:
        for chunk in CHUNKS:
            t = run(size, chunk, cuda)
            label = f"{chunk >> 10} KiB" if chunk < MiB else f"{chunk // MiB} MiB"
            print(
                f"{size:>6} {label:>9} {t['cold sleep']:>10.2f}s {t['wake']:>7.2f}s "
                f"{t['steady sleep']:>12.2f}s {t['wake again']:>7.2f}s {t.get('copies', '-'):>8}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
