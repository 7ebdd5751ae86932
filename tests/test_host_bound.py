"""The host-memory bound (docs/errors-and-guarantees.md, "Limitations": held <= the backups still referenced + one
spare no larger than the largest backup or reservation) around reservations and pinning ahead: a compaction moves
backups into a new arena of exactly their size (never into a cached spare, which would leave a hole of its own), and
the buffer the pin-ahead worker holds counts as held from the start. Both failed before (found by review)."""

from __future__ import annotations

import pytest

from cumem_rs import Allocator

KiB = 1 << 10
G = 64 * KiB


def _tagged_malloc(a: Allocator, tag: str, size: int) -> int:
    a.push_tag(tag)
    try:
        return a.malloc(size)
    finally:
        a.pop_tag()


def test_a_reservation_after_a_partial_free_holds_one_spare():
    """A cached smaller spare must not become the compacted arena (with a hole of its own) while the reservation
    takes a new buffer beside it."""
    a = Allocator.simulated(devices=1, capacity=64 << 20, granularity=G)
    # The largest reservation so far: the one spare the bound allows is 1 MiB.
    a.reserve_host(1024 * KiB)
    a.trim_host()
    x = _tagged_malloc(a, "a", 128 * KiB)
    y = _tagged_malloc(a, "b", 384 * KiB)
    a.sleep(["a", "b"])
    a.free(y)  # the 512 KiB arena now holds 128 KiB of referenced backup
    a.reserve_host(256 * KiB)  # a smaller spare, cached
    a.reserve_host(1024 * KiB)
    referenced = 128 * KiB  # x's backup (nothing retained: x never woke)
    spare = 1024 * KiB
    held = a.host_bytes()
    assert held <= referenced + spare, (
        f"host bytes held {held} > {referenced} referenced + {spare} spare "
        f"(arenas {a.stats()['host_backup_bytes']}, cached {a.stats()['host_cached_bytes']})"
    )
    assert a.read_backup(x, 16) is not None
    a.close()


def test_a_free_while_pinning_ahead_counts_the_workers_buffer():
    """A free that leaves holes in an arena while the worker pins must see the worker's buffer, which is cached
    once the worker stops. (The engine before the restructuring missed it too.)"""
    a = Allocator.simulated(devices=1, capacity=64 << 20, granularity=G)
    a.reserve_host(1024 * KiB)
    a.trim_host()
    _x = _tagged_malloc(a, "a", 128 * KiB)
    y = _tagged_malloc(a, "b", 384 * KiB)
    a.sleep(["a", "b"])
    a.reserve_host(1024 * KiB, background=True)
    a.free(y)  # 128 KiB of the 512 KiB arena still referenced
    a.stop_pinning_ahead()
    referenced, spare = 128 * KiB, 1024 * KiB
    held = a.host_bytes()
    assert held <= referenced + spare, (
        f"host bytes held {held} > {referenced} referenced + {spare} spare "
        f"(arenas {a.stats()['host_backup_bytes']}, cached {a.stats()['host_cached_bytes']})"
    )
    a.close()


@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_compaction_keeps_neighbours_back_to_back_so_a_wake_restores_each_run_in_one_copy():
    """Compaction moves backups in address order (it once followed a hash map's order, found by review): the wake's
    restore then merges each run of neighbours into one copy."""
    a = Allocator.simulated(devices=1, capacity=64 << 20, granularity=G)
    a.set_retain_backups(False)  # woken backups are dropped at once, leaving holes
    for t in "abcd":
        a.push_tag(t)
        for _ in range(8):
            a.malloc(G)
        a.pop_tag()
    a.sleep(list("abcd"))
    a.wake_up(list("bcd"))
    a.sleep(list("bcd"))
    a.wake_up(list("cd"))  # passes the bound: the backups of "a" and "b" are compacted into one arena
    before = a.driver_counts()["calls"]["copy_h2d"]
    a.wake_up(None)  # "a" and "b": two runs of 8 neighbours each (one wake group per tag)
    copies = a.driver_counts()["calls"]["copy_h2d"] - before
    assert copies == 2, f"{copies} restore copies for 2 runs of neighbours backed up back to back"
    a.close()
