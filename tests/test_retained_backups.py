"""Retained backups: a wake keeps the backup it restored from, and the next sleep copies only the chunks whose
fingerprint changed. Same tests on the simulated driver (host fingerprints) and on CUDA (the GPU kernel).

The point is never to restore stale data: every test checks the bytes after the next wake, whatever was skipped.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import cumem_rs
from cumem_rs import Allocator
from conftest import allocator_for, live_counts

CHUNK = 16 << 10  # several chunks per simulated granule (64 KiB) and per CUDA granule (2 MiB)


def weights(a: Allocator, granules: int) -> tuple[int, int, bytearray]:
    """One "weights" allocation of `granules` granules filled with random bytes: (address, size, data)."""
    size = granules * a.granularity(0)
    a.push_tag("weights")
    try:
        addr = a.malloc(size, 0)
    finally:
        a.pop_tag()
    data = bytearray(os.urandom(size))
    a.write(addr, bytes(data))
    return addr, size, data


@pytest.fixture
def a(alloc: Allocator):
    alloc.set_fingerprint_chunk(CHUNK)
    alloc.set_retain_backups(True)
    yield alloc
    alloc.wake_up(None)  # the CUDA allocator is shared: leave everything awake
    alloc.set_fingerprint_chunk(2 << 20)
    alloc.set_tag_policy("weights")


def cycle(a: Allocator) -> dict:
    """sleep("weights") then wake everything; returns the sleep report."""
    rep = a.sleep("weights")
    a.wake_up(None)
    return rep


def test_unchanged_weights_are_not_copied_again(a):
    addr, size, data = weights(a, 2)
    first = cycle(a)
    assert first["copied_bytes"] >= size and first["skipped_bytes"] == 0, "the first sleep copies everything"
    assert a.retains_backups()
    second = a.sleep("weights")
    assert second["skipped_bytes"] >= size, f"unchanged chunks were copied: {second}"
    assert second["chunks_checked"] >= size // CHUNK
    a.wake_up(None)
    assert a.read(addr, size) == data


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_changed_byte_copies_its_chunk_only(a, where):
    addr, size, data = weights(a, 2)
    cycle(a)
    off = {"first": 0, "middle": size // 2 + 5, "last": size - 1}[where]
    data[off] ^= 0x5A
    a.write(addr + off, bytes([data[off]]))
    rep = a.sleep("weights")
    mine = a.stats()["last_sleep"]
    assert mine["copied_bytes"] >= CHUNK and mine["copied_bytes"] + mine["skipped_bytes"] >= size
    if a.backend == "sim":  # alone on the simulated device: exact counts
        assert (rep["copied_bytes"], rep["skipped_bytes"]) == (CHUNK, size - CHUNK), rep
    a.wake_up(None)
    assert a.read(addr, size) == data, "the changed byte was lost: a stale chunk was restored"


def test_rewriting_every_chunk_copies_everything_and_restores_the_new_bytes(a):
    """The RL pattern: wake, overwrite all weights in place, sleep, wake."""
    addr, size, _ = weights(a, 3)
    cycle(a)
    new = os.urandom(size)
    a.write(addr, new)
    rep = a.sleep("weights")
    if a.backend == "sim":
        assert (rep["copied_bytes"], rep["skipped_bytes"]) == (size, 0), rep
    a.wake_up(None)
    assert a.read(addr, size) == new


def test_writing_the_same_value_or_a_swapped_word_is_never_lost(a):
    addr, size, data = weights(a, 1)
    cycle(a)
    a.write(addr + 64, bytes(data[64:96]))  # the same bytes again: skipping is allowed, losing is not
    word = bytes(data[0:16])
    swapped = bytes(data[16:32]) + word  # two 16-byte words swapped
    data[0:32] = swapped
    a.write(addr, swapped)
    cycle(a)
    assert a.read(addr, size) == data


@pytest.mark.parametrize(
    "invalidate",
    ["discard", "not_offloaded", "trim_host", "keep_host_false", "retain_off", "chunk_change", "free"],
)
def test_invalidation_drops_the_retained_backup(a, invalidate):
    addr, size, data = weights(a, 1)
    cycle(a)
    if a.backend == "sim":
        assert a.stats()["retained_allocations"] == 1
    if invalidate == "discard":
        a.discard("weights")
        a.wake_up(None)
        data = bytearray(a.read(addr, size))  # contents undefined after a discard: take what is there
        a.write(addr, bytes(data))
    elif invalidate == "not_offloaded":
        a.sleep([])  # released without backup
        a.wake_up(None)
        data = bytearray(os.urandom(size))
        a.write(addr, bytes(data))
    elif invalidate == "trim_host":
        a.trim_host()
    elif invalidate == "keep_host_false":
        a.set_keep_host_memory(False)
        assert not a.retains_backups()
    elif invalidate == "retain_off":
        a.set_retain_backups(False)
        assert not a.retains_backups()
    elif invalidate == "chunk_change":
        a.set_fingerprint_chunk(2 * CHUNK)
    elif invalidate == "free":
        a.free(addr)
        if a.backend == "sim":
            assert a.stats()["retained_allocations"] == 0
        return
    if a.backend == "sim":
        assert a.stats()["retained_allocations"] == 0, f"{invalidate} kept a retained backup"
        rep = a.sleep("weights")
        assert (rep["copied_bytes"], rep["skipped_bytes"]) == (size, 0), rep
    else:
        a.sleep("weights")
    a.set_keep_host_memory(True)
    a.wake_up(None)
    assert a.read(addr, size) == data


_K1, _K2, _K3, _K4 = (np.uint64(k) for k in (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                                               0x27D4EB2F165667C5))


def _fmix64(k: "np.ndarray") -> "np.ndarray":
    k = k ^ (k >> np.uint64(33))
    k = k * np.uint64(0xFF51AFD7ED558CCD)
    k = k ^ (k >> np.uint64(33))
    k = k * np.uint64(0xC4CEB9FE1A85EC53)
    return k ^ (k >> np.uint64(33))


def reference_fingerprints(data: bytes, chunk: int) -> list[tuple[int, int]]:
    """The chunk fingerprint as the fingerprint module's doc comment defines it, written again here (numpy,
    uint64 arithmetic wraps): per 16-byte word (lo, hi) at index i of its chunk
    h = fmix64(lo ^ i*K1 ^ fmix64(hi ^ (i*K2 + K3))), and per chunk of len bytes
    [fmix64(sum(h) + len), fmix64(sum((h ^ K4) * (2i+1)) ^ len*K1)]."""
    out = []
    for off in range(0, len(data), chunk):
        words = np.frombuffer(data[off : off + chunk], dtype="<u8").reshape(-1, 2)
        i = np.arange(len(words), dtype=np.uint64)
        h = _fmix64(words[:, 0] ^ (i * _K1) ^ _fmix64(words[:, 1] ^ (i * _K2 + _K3)))
        n = np.full(1, 16 * len(words), dtype=np.uint64)
        first = _fmix64(h.sum(dtype=np.uint64, keepdims=True) + n)
        odd = np.uint64(2) * i + np.uint64(1)
        second = _fmix64(((h ^ _K4) * odd).sum(dtype=np.uint64, keepdims=True) ^ (n * _K1))
        out.append((int(first[0]), int(second[0])))
    return out


def test_driver_fingerprints_equal_the_host_reference(a):
    """The driver's prints of device memory (the GPU kernel on CUDA, the host code on the sim) and the host code
    (`fingerprint_bytes`) both compute the documented function, written again in this file."""
    addr, size, data = weights(a, 1)
    want = reference_fingerprints(bytes(data), CHUNK)
    assert len(want) == size // CHUNK
    assert cumem_rs._native.fingerprint_bytes(bytes(data), CHUNK) == want
    assert a.fingerprints(addr, size) == want
    part = bytes(data[4096 : 8192 + 48])  # a short last chunk
    assert a.fingerprints(addr + 4096, len(part)) == reference_fingerprints(part, CHUNK)
    assert cumem_rs._native.fingerprint_bytes(part, CHUNK) == reference_fingerprints(part, CHUNK)
    with pytest.raises(ValueError, match="multiple of 16"):
        a.fingerprints(addr, 15)


@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_host_cost_stays_flat_over_cycles(a):
    a.set_tag_policy("weights", compress="off")  # the CUDA allocator predates the fixture's environment
    addr, size, data = weights(a, 2)
    cycle(a)
    held = a.host_bytes()
    for i in range(5):
        data[i * 4097 % size] ^= 1
        a.write(addr, bytes(data))
        cycle(a)
        assert a.host_bytes() == held, "retained backups grew host memory"
    assert a.read(addr, size) == data


# --- faults (simulated driver) -----------------------------------------------------------------------------------


@pytest.fixture
def sim_a():
    with allocator_for("sim") as s:
        s.set_fingerprint_chunk(CHUNK)
        yield s


@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_fingerprint_failure_at_the_first_sleep_retains_nothing(sim_a):
    addr, size, data = weights(sim_a, 1)
    sim_a.inject_fault("fingerprint", 1, "unknown")
    sim_a.sleep("weights")  # the sleep itself succeeds, without prints
    assert any("fingerprint" in e for e in sim_a.errors())
    sim_a.wake_up(None)
    assert sim_a.read(addr, size) == data
    assert sim_a.stats()["retained_allocations"] == 0
    rep = sim_a.sleep("weights")
    assert (rep["copied_bytes"], rep["skipped_bytes"]) == (size, 0)
    sim_a.wake_up(None)
    assert sim_a.read(addr, size) == data


@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
@pytest.mark.parametrize("verify", ["1", "0"])
def test_wake_runs_one_kernel_per_device_to_verify_and_none_without(monkeypatch, verify):
    """Retention's prints are taken at sleep; a wake fingerprints only to verify what it restored, in one batch per
    device after every map (a kernel in flight would hold up the maps under the copies), and not at all with
    CUMEM_RS_VERIFY_WAKE=0."""
    monkeypatch.setenv("CUMEM_RS_VERIFY_WAKE", verify)
    with allocator_for("sim") as a:
        a.set_fingerprint_chunk(CHUNK)
        size = weights(a, 2)[1]
        a.sleep("weights")
        before = a.driver_counts()["calls"]["fingerprint"]
        rep = a.wake_up(None)
        assert a.driver_counts()["calls"]["fingerprint"] - before == int(verify)
        assert rep["verified_bytes"] == size * int(verify)
        assert a.stats()["retained_allocations"] == 1


def test_fingerprint_failure_at_sleep_copies_everything(sim_a):
    addr, size, data = weights(sim_a, 2)
    cycle(sim_a)
    data[7] ^= 1
    sim_a.write(addr, bytes(data))
    sim_a.inject_fault("fingerprint", 1, "unknown")
    rep = sim_a.sleep("weights")
    assert (rep["copied_bytes"], rep["skipped_bytes"]) == (size, 0), rep
    sim_a.wake_up(None)
    assert sim_a.read(addr, size) == data


@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_failed_copy_of_a_changed_chunk_leaves_the_data_awake_and_drops_the_retained_backup(sim_a):
    addr, size, data = weights(sim_a, 2)
    cycle(sim_a)
    data[CHUNK + 3] ^= 0xFF
    sim_a.write(addr, bytes(data))
    sim_a.inject_fault("copy_d2h", 1, "unknown")
    with pytest.raises(cumem_rs.CumemError):
        sim_a.sleep("weights")
    row = next(r for r in sim_a.allocations() if r["address"] == addr)
    assert not row["asleep"], "released without a complete backup"
    assert sim_a.read(addr, size) == data
    assert sim_a.stats()["retained_allocations"] == 0, "a half-overwritten backup stayed retained"
    assert live_counts(sim_a) and sim_a.driver_counts()["markers"] == 0
    rep = sim_a.sleep("weights")
    assert (rep["copied_bytes"], rep["skipped_bytes"]) == (size, 0)
    sim_a.wake_up(None)
    assert sim_a.read(addr, size) == data


def test_no_fingerprint_batch_or_marker_is_left_behind(sim_a):
    addr, size, data = weights(sim_a, 2)
    for _ in range(3):
        cycle(sim_a)
    c = sim_a.driver_counts()
    assert (c["markers"], c["fingerprint_batches"]) == (0, 0)
