"""Sleep/wake semantics checked directly on the simulated driver, where capacity, poison and driver-held
resources are observable (`mem_info`, `driver_counts`)."""

from __future__ import annotations

import os

import pytest

from cumem_rs import Allocator, CumemError, CumemOutOfMemoryError
from conftest import MiB, SIM_CAPACITY, SIM_DEVICES, SIM_GRANULARITY, call_counts, live_counts


def tagged(a: Allocator, tag: str, size: int, device: int = 0, fill: bool = True) -> tuple[int, bytes]:
    """Allocate under `tag` and fill with random bytes; returns (address, data)."""
    a.push_tag(tag)
    try:
        addr = a.malloc(size, device)
    finally:
        a.pop_tag()
    data = os.urandom(size) if fill else b""
    if fill:
        a.write(addr, data)
    return addr, data


def row(a: Allocator, addr: int) -> dict:
    return next(r for r in a.allocations() if r["address"] == addr)


def assert_poisoned(got: bytes, old: bytes) -> None:
    """Discarded memory reads back as one repeated, non-zero byte: not the old data, not zeros."""
    assert got != old, "discarded memory still holds its old data"
    assert len(set(got)) == 1, "discarded memory is not uniformly poisoned"
    assert got[0] != 0, "discarded memory came back as zeros"


def assert_no_leaks(a: Allocator) -> None:
    assert a.allocations() == [] and a.usage() == 0
    a.trim_host()
    c = live_counts(a)
    assert c == dict.fromkeys(c, 0), f"driver still holds resources: {c}"
    assert a.host_bytes() == 0


def test_same_addresses_and_offloaded_bytes_identical(sim):
    w, wd = tagged(sim, "weights", 3 * SIM_GRANULARITY + 123)
    k, kd = tagged(sim, "kv_cache", SIM_GRANULARITY)
    before = {r["address"]: (r["size"], r["device"], r["tag"]) for r in sim.allocations()}
    rep = sim.sleep(["weights", "kv_cache"])
    assert rep["copied_bytes"] == 5 * SIM_GRANULARITY and rep["discarded_bytes"] == 0 and rep["allocations"] == 2
    assert sim.usage() == 0 and live_counts(sim)["mapped_bytes"] == 0
    assert sim.mem_info(0)[0] == SIM_CAPACITY, "sleep kept physical memory"
    sim.wake_up()
    after = {r["address"]: (r["size"], r["device"], r["tag"]) for r in sim.allocations()}
    assert after == before
    assert sim.read(w, len(wd)) == wd
    assert sim.read(k, len(kd)) == kd
    for a in (w, k):
        sim.free(a)
    assert_no_leaks(sim)


def test_not_offloaded_comes_back_poisoned(sim):
    w, wd = tagged(sim, "weights", 2 * SIM_GRANULARITY)
    k, kd = tagged(sim, "kv_cache", 2 * SIM_GRANULARITY)
    d, dd = tagged(sim, "default", SIM_GRANULARITY)
    rep = sim.sleep("weights")
    assert rep["copied_bytes"] == 2 * SIM_GRANULARITY and rep["discarded_bytes"] == 3 * SIM_GRANULARITY
    assert row(sim, k)["backed_up"] is False and row(sim, w)["backed_up"] is True
    sim.wake_up()
    assert sim.read(w, len(wd)) == wd
    assert_poisoned(sim.read(k, len(kd)), kd)
    assert_poisoned(sim.read(d, len(dd)), dd)


def test_default_offload_is_default_tag(sim):
    d, dd = tagged(sim, "default", 1000)
    w, wd = tagged(sim, "weights", 1000)
    sim.sleep()
    sim.wake_up()
    assert sim.read(d, len(dd)) == dd
    assert_poisoned(sim.read(w, len(wd)), wd)


def test_discard_then_wake(sim):
    w, wd = tagged(sim, "weights", 5000)
    k, kd = tagged(sim, "kv_cache", 5000)
    rep = sim.discard("kv_cache")
    assert row(sim, k)["asleep"] and not row(sim, w)["asleep"]
    assert sim.usage() == SIM_GRANULARITY
    assert isinstance(rep, dict)
    sim.wake_up("kv_cache")
    assert_poisoned(sim.read(k, len(kd)), kd)
    assert sim.read(w, len(wd)) == wd


def test_selective_wake(sim):
    w, wd = tagged(sim, "weights", 2 * SIM_GRANULARITY)
    k, kd = tagged(sim, "kv_cache", 3 * SIM_GRANULARITY)
    sim.sleep(["weights", "kv_cache"])
    sim.wake_up(["weights"])
    assert not row(sim, w)["asleep"] and row(sim, k)["asleep"]
    assert sim.usage() == sim.usage(0) == 2 * SIM_GRANULARITY
    assert live_counts(sim)["mapped_bytes"] == 2 * SIM_GRANULARITY
    assert sim.read(w, len(wd)) == wd
    with pytest.raises(CumemError, match="asleep"):
        sim.read(k, 16)
    sim.wake_up("kv_cache")
    assert sim.read(k, len(kd)) == kd
    assert sim.usage() == 5 * SIM_GRANULARITY


def test_free_asleep_releases_range_and_backup(sim):
    a, _ = tagged(sim, "weights", 2 * SIM_GRANULARITY)
    b, bd = tagged(sim, "weights", SIM_GRANULARITY)
    sim.sleep("weights")
    c0 = live_counts(sim)
    # Both live side by side in one shared reservation.
    assert (c0["ranges"], c0["handles"], c0["mapped_bytes"]) == (1, 0, 0)
    asleep0 = sim.stats()["asleep_bytes"]
    sim.free(a)
    assert sim.stats()["asleep_bytes"] == asleep0 - 2 * SIM_GRANULARITY
    again = sim.malloc(2 * SIM_GRANULARITY)
    assert again == a, "freeing an asleep allocation kept its addresses"
    sim.free(again)
    sim.wake_up()
    assert sim.read(b, len(bd)) == bd
    sim.free(b)
    assert_no_leaks(sim)


@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_free_of_all_asleep_returns_backup_arena(sim):
    a, _ = tagged(sim, "weights", 2 * SIM_GRANULARITY)
    b, _ = tagged(sim, "weights", SIM_GRANULARITY, device=1)
    sim.sleep("weights")
    assert sim.stats()["host_backup_bytes"] >= 3 * SIM_GRANULARITY
    sim.free(a)
    sim.free(b)
    s = sim.stats()
    # No asleep allocation points into the arena any more: it is only cached (keep policy), and trim frees it.
    assert s["host_backup_bytes"] == 0 and s["host_cached_bytes"] == sim.host_bytes() > 0
    assert sim.trim_host() == s["host_cached_bytes"]
    assert_no_leaks(sim)


def test_malloc_oom_at_capacity(sim):
    big = sim.malloc(SIM_CAPACITY)
    assert sim.mem_info(0) == (0, SIM_CAPACITY)
    with pytest.raises(CumemOutOfMemoryError):
        sim.malloc(1)
    assert live_counts(sim)["ranges"] == 1, "a failed malloc kept its address range"
    # The other device is separate.
    other = sim.malloc(SIM_GRANULARITY, 1)
    sim.free(big)
    again = sim.malloc(SIM_CAPACITY)
    for a in (other, again):
        sim.free(a)
    assert_no_leaks(sim)


def test_wake_oom_is_transactional(sim):
    w1, d1 = tagged(sim, "weights", 24 * MiB)
    w2, d2 = tagged(sim, "weights", 24 * MiB)
    sim.sleep("weights")
    host = sim.host_bytes()
    # Room for one of the two, not both: a transactional wake maps neither.
    thief = sim.malloc(SIM_CAPACITY - 30 * MiB)
    with pytest.raises(CumemOutOfMemoryError):
        sim.wake_up()
    assert row(sim, w1)["asleep"] and row(sim, w2)["asleep"]
    assert row(sim, w1)["backed_up"] and row(sim, w2)["backed_up"]
    assert sim.usage() == SIM_CAPACITY - 30 * MiB == live_counts(sim)["mapped_bytes"]
    assert sim.host_bytes() >= host >= 48 * MiB
    sim.free(thief)
    sim.wake_up()
    assert sim.read(w1, len(d1)) == d1
    assert sim.read(w2, len(d2)) == d2


def test_multiple_devices(sim):
    assert sim.device_count() == SIM_DEVICES
    a0, d0 = tagged(sim, "weights", 3 * SIM_GRANULARITY, device=0)
    a1, d1 = tagged(sim, "weights", 2 * SIM_GRANULARITY, device=1)
    k1, kd1 = tagged(sim, "kv_cache", SIM_GRANULARITY, device=1)
    assert row(sim, a1)["device"] == 1
    assert sim.usage(0) == 3 * SIM_GRANULARITY and sim.usage(1) == 3 * SIM_GRANULARITY
    assert sim.mem_info(1)[0] == SIM_CAPACITY - 3 * SIM_GRANULARITY
    sim.sleep("weights")
    assert sim.usage(0) == sim.usage(1) == 0
    sim.wake_up()
    assert sim.read(a0, len(d0)) == d0 and sim.read(a1, len(d1)) == d1
    assert_poisoned(sim.read(k1, len(kd1)), kd1)
    assert sim.usage(1) == 3 * SIM_GRANULARITY


def test_keep_host_memory_false_returns_host(sim):
    w, wd = tagged(sim, "weights", 4 * SIM_GRANULARITY)
    sim.set_keep_host_memory(False)
    sim.sleep("weights")
    assert sim.host_bytes() >= 4 * SIM_GRANULARITY
    sim.wake_up()
    assert sim.read(w, len(wd)) == wd
    assert sim.host_bytes() == 0
    assert live_counts(sim)["host_registered"] + live_counts(sim)["host_allocated"] == 0


@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_keep_host_memory_true_caches_host(sim):
    w, wd = tagged(sim, "weights", 4 * SIM_GRANULARITY)
    sim.set_keep_host_memory(True)
    sim.sleep("weights")
    sim.wake_up()
    kept = sim.host_bytes()
    assert kept >= 4 * SIM_GRANULARITY
    # The next sleep reuses the cached memory instead of pinning more.
    pins = call_counts(sim)
    sim.sleep("weights")
    assert sim.host_bytes() == kept
    after = call_counts(sim)
    assert after["host_register"] == pins["host_register"] and after["host_alloc"] == pins["host_alloc"]
    sim.wake_up()
    assert sim.read(w, len(wd)) == wd
    assert sim.trim_host() == kept
    assert sim.host_bytes() == 0


def test_reserve_host(sim):
    sim.reserve_host(8 * SIM_GRANULARITY)
    assert sim.host_bytes() >= 8 * SIM_GRANULARITY
    reserved = sim.host_bytes()
    pins = call_counts(sim)
    w, wd = tagged(sim, "weights", 8 * SIM_GRANULARITY)
    sim.sleep("weights")
    assert sim.host_bytes() == reserved, "sleep pinned new memory despite the reservation"
    after = call_counts(sim)
    assert after["host_register"] == pins["host_register"] and after["host_alloc"] == pins["host_alloc"]
    sim.wake_up()
    assert sim.read(w, len(wd)) == wd


@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_stats_fields(sim):
    w, _ = tagged(sim, "weights", 2 * SIM_GRANULARITY)
    k, _ = tagged(sim, "kv_cache", SIM_GRANULARITY, device=1)
    s = sim.stats()
    assert (s["live_allocations"], s["asleep_allocations"]) == (2, 0)
    assert s["mapped_bytes"] == s["peak_mapped_bytes"] == sim.usage() == 3 * SIM_GRANULARITY
    assert s["asleep_bytes"] == 0
    assert (s["mallocs"], s["frees"], s["sleeps"], s["wakes"]) == (2, 0, 0, 0)
    assert s["last_sleep"] is None and s["last_wake"] is None
    rep = sim.sleep("weights")
    s = sim.stats()
    assert (s["live_allocations"], s["asleep_allocations"]) == (2, 2)
    assert s["mapped_bytes"] == 0 and s["asleep_bytes"] == 3 * SIM_GRANULARITY
    assert s["peak_mapped_bytes"] == 3 * SIM_GRANULARITY
    assert s["host_backup_bytes"] >= 2 * SIM_GRANULARITY
    assert s["host_backup_bytes"] + s["host_cached_bytes"] == sim.host_bytes()
    assert s["sleeps"] == 1
    assert {k: v for k, v in s["last_sleep"].items() if k not in ("seconds", "gb_per_s")} == {
        k: v for k, v in rep.items() if k not in ("seconds", "gb_per_s")
    }
    wrep = sim.wake_up()
    s = sim.stats()
    assert s["wakes"] == 1 and s["last_wake"]["copied_bytes"] == wrep["copied_bytes"] == 2 * SIM_GRANULARITY
    assert s["last_wake"]["discarded_bytes"] == wrep["discarded_bytes"] == SIM_GRANULARITY
    assert s["mapped_bytes"] == 3 * SIM_GRANULARITY and s["asleep_bytes"] == 0
    # The wake kept the weights' backup bound to them (retained, for a sleep that copies only what changed).
    assert (s["retained_allocations"], s["host_retained_bytes"]) == (1, 2 * SIM_GRANULARITY)
    assert s["host_backup_bytes"] == sim.host_bytes() > 0 and s["host_cached_bytes"] == 0
    # Without retention the arena is no longer used by anyone: it is cached (keep policy), not counted as backup.
    sim.set_retain_backups(False)
    s = sim.stats()
    assert (s["retained_allocations"], s["host_retained_bytes"]) == (0, 0)
    assert s["host_backup_bytes"] == 0 and s["host_cached_bytes"] == sim.host_bytes() > 0
    sim.free(w)
    s = sim.stats()
    assert (s["frees"], s["live_allocations"]) == (1, 1)
    assert s["recorded_errors"] == len(sim.errors()) == 0 and s["pending_releases"] == 0
