"""Host memory that is not kept (`set_keep_host_memory(False)`: low host RAM, torch_memory_saver's
`retain_cpu_backup=False`) is back with the OS when the wake that drops it returns, never later on a background
thread: torch_memory_saver's own RSS test measures it right after `resume`. (Kept memory no longer needed is
returned off the call's path instead; that is the cached mode's business, not this one's.)"""

from __future__ import annotations

import os

from cumem_rs import Allocator

MiB = 1 << 20


def test_a_wake_without_kept_host_memory_returns_its_large_backup_before_it_returns():
    a = Allocator.simulated(devices=1, capacity=512 * MiB, granularity=2 * MiB)
    try:
        a.set_keep_host_memory(False)
        a.set_retain_backups(False)
        n = 128 * MiB  # past the size that a cached-mode release hands to the background thread
        p = a.malloc(n)
        data = os.urandom(n)
        a.write(p, data)
        for cycle in range(5):
            a.sleep(["default"])
            assert a.driver_counts()["host_pinned_bytes"] >= n, "the backup is pinned while asleep"
            a.wake_up()
            pinned = a.driver_counts()["host_pinned_bytes"]
            assert pinned == 0, f"cycle {cycle}: {pinned} bytes still pinned when the wake returned"
            assert a.read(p, n) == data
        a.free(p)
    finally:
        a.close()
