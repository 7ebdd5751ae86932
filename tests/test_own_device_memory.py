"""The allocator's own device memory (its fingerprint kernel's module and buffer) is taken when a device is first
used, before its first allocation is handed out, never inside a sleep, and reported in
`stats()["own_device_bytes"]`: so the first sleep of a fresh process gives back every byte it unmapped, as vLLM's
own tests measure (free memory after sleep >= before + the pool's bytes). The CUDA case runs in a fresh
interpreter: the process-wide CUDA allocator is set up once per process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import cumem_rs
from cumem_rs import Allocator

FIRST_SLEEP = textwrap.dedent(
    """
    import cumem_rs
    a = cumem_rs.Allocator.cuda()
    n = 64 << 20
    p = a.malloc(n)
    a.write(p, bytes(range(256)) * 16)
    own = a.stats()["own_device_bytes"]
    before = a.mem_info()[0]
    a.sleep(["default"])
    after = a.mem_info()[0]
    a.wake_up()
    assert a.read(p, 4096) == bytes(range(256)) * 16
    assert a.stats()["own_device_bytes"] == own, "taken once"
    a.free(p)
    print(f"own {own} freed {after - before} of {n}")
    assert a.retains_backups(), "the fingerprint machinery is in use (retained backups on)"
    assert after - before >= n, f"the first sleep gave back {after - before} of the {n} bytes it unmapped"
    assert own > 0, "the kernel's module and buffer are reported"
    """
)


def test_the_simulated_device_takes_no_device_memory_of_its_own():
    """Every byte of the simulated device's capacity goes to allocations, before, during and after the cycles that
    use the fingerprint machinery (retained backups), and the stat says so."""
    cap = 8 << 20
    a = Allocator.simulated(devices=1, capacity=cap, granularity=64 << 10)
    try:
        assert a.mem_info() == (cap, cap)
        p = a.malloc(cap)  # the whole capacity: nothing of it is the allocator's own
        a.write(p, bytes(range(256)) * (cap // 256))
        assert a.mem_info()[0] == 0
        for _ in range(2):  # the first wake retains the backup, the second sleep fingerprints against it
            a.sleep(["default"])
            assert a.mem_info()[0] == cap, "the sleep gave back every byte of the allocation, and only those"
            a.wake_up()
            assert a.mem_info()[0] == 0
        assert a.retains_backups() and a.driver_counts()["calls"]["fingerprint"] > 0
        assert a.read(p, 4096) == bytes(range(256)) * 16
        assert a.stats()["own_device_bytes"] == 0
        a.free(p)
        assert a.mem_info() == (cap, cap)
    finally:
        a.close()


@pytest.mark.skipif(not cumem_rs.cuda_available(), reason="no CUDA device (cuda_available() is False)")
def test_the_first_sleep_of_a_fresh_process_gives_back_every_byte_it_unmapped():
    run = subprocess.run([sys.executable, "-c", FIRST_SLEEP], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
