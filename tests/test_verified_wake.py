"""Verified wakes: every wake compares each restored chunk with the fingerprint its sleep took, at every tier (raw
host, compressed host, raw file, compressed file). A backup damaged where it lies (host memory written behind the
allocator's back, a spill file changed on disk) fails the wake like a failed copy: CumemError naming the allocation,
what the wake mapped released, the backup kept, every allocation asleep; once the damage is repaired a later wake
restores the right bytes. A retained backup found wrong is never trusted again: the next sleep writes it whole.
`CUMEM_RS_VERIFY_WAKE=0` turns verification off (the damage is then restored, and `verified_bytes` is 0).

The host arena is damaged through the memory `view_backup(..., writable=False)` exposes (a stray write breaking the
promise to only read); the file tier in named mode (`set_spill_dir(d, named=True)`), whose files a user can reach.
The compressed tiers' blobs are reached through the `decompress_corrupt` fault (a decompression that succeeds with
wrong bytes). The named-file test runs on the GPU too (the `backend` fixture; it skips without one).
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path
from typing import Iterator

import pytest

import cumem_rs
from cumem_rs import Allocator, CumemError
from conftest import SIM_CAPACITY, allocator_for, live_counts
from test_compression import bf16_like

GRAN = 64 << 10
TAG = "verified"
BAD = b"\xa5" * 40


@pytest.fixture
def sim() -> Iterator[Allocator]:
    a = Allocator.simulated(devices=1, capacity=SIM_CAPACITY, granularity=GRAN)
    a.set_fingerprint_chunk(GRAN)
    yield a
    a.close()


def alloc(a: Allocator, data: bytes, tag: str = TAG) -> int:
    a.push_tag(tag)
    try:
        addr = a.malloc(len(data), 0)
    finally:
        a.pop_tag()
    a.write(addr, data)
    return addr


def named_files(directory: Path) -> list[Path]:
    pattern = re.compile(rf"cumem_rs-{os.getpid()}-\d+\.bak")
    return sorted(p for p in Path(directory).iterdir() if pattern.fullmatch(p.name))


def overwrite(path: Path, at: int, data: bytes) -> bytes:
    """Write `data` at `at` of the file (what a user or a failing disk does to a backup at rest); the old bytes."""
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(len(data))
        f.seek(at)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return old


def poke(view: cumem_rs.HostBytes, at: int, data: bytes) -> bytes:
    """Write `data` into host backup memory `at` bytes into `view` (a stray write); the old bytes."""
    old = ctypes.string_at(view.address + at, len(data))
    ctypes.memmove(view.address + at, data, len(data))
    return old


def mapped_now(a: Allocator) -> int:
    """Physical bytes mapped: the simulated driver's own count, or the allocator's on CUDA."""
    return live_counts(a)["mapped_bytes"] if a.backend == "sim" else a.usage()


def assert_failed_whole(a: Allocator, err: pytest.ExceptionInfo, addrs: list[int], mapped: int) -> None:
    """The wake failed for a mismatch naming `addrs`; they stay asleep with their backups, and what it mapped went
    back (`mapped`: before the wake)."""
    msg = str(err.value)
    assert "did not restore intact" in msg and all(f"{addr:#x}" in msg for addr in addrs), msg
    rows = {r["address"]: r for r in a.allocations()}
    assert all(rows[addr]["asleep"] and rows[addr]["backed_up"] for addr in addrs), "they stay asleep"
    assert mapped_now(a) == mapped, "what the wake mapped was released"


def test_a_raw_host_backup_written_behind_the_allocators_back_fails_the_wake_until_repaired(sim):
    sim.set_tag_policy(TAG, compress="off")
    data, other = os.urandom(4 * GRAN), os.urandom(GRAN)
    addr, b = alloc(sim, data), alloc(sim, other)
    sim.sleep(TAG)
    view = sim.view_backup(addr, len(data), writable=False)
    assert view is not None, "a raw host backup"
    old = poke(view, GRAN + 8, BAD)
    mapped = mapped_now(sim)
    with pytest.raises(CumemError) as err:
        sim.wake_up(None)
    assert_failed_whole(sim, err, [addr], mapped)
    assert "raw host backup" in str(err.value) and f"{b:#x}" not in str(err.value)
    assert sim.read_backup(addr, len(data))[GRAN + 8 : GRAN + 48] == BAD, "the backup is kept as it lies"
    poke(view, GRAN + 8, old)
    del view
    rep = sim.wake_up(None)
    assert rep["verified_bytes"] == len(data) + len(other)
    assert sim.read(addr, len(data)) == data and sim.read(b, len(other)) == other


def test_a_retained_host_backup_damaged_while_awake_fails_the_wake_and_is_copied_whole_next_time(sim):
    sim.set_tag_policy(TAG, compress="off")
    data = os.urandom(4 * GRAN)
    addr = alloc(sim, data)
    sim.sleep(TAG)
    sim.wake_up(None)
    assert sim.stats()["retained_allocations"] == 1
    view = sim.view_backup(addr, len(data), writable=False)
    old = poke(view, 0, bytes(64))
    rep = sim.sleep(TAG)
    assert (rep["copied_bytes"], rep["skipped_bytes"]) == (0, len(data)), "unchanged on the device: not copied"
    mapped = mapped_now(sim)
    with pytest.raises(CumemError) as err:
        sim.wake_up(None)
    assert_failed_whole(sim, err, [addr], mapped)
    assert "chunk at +0x0" in str(err.value)
    poke(view, 0, old)
    del view
    sim.wake_up(None)
    assert sim.read(addr, len(data)) == data
    assert sim.stats()["retained_allocations"] == 0, "a backup found wrong is never retained"
    rep = sim.sleep(TAG)
    assert (rep["copied_bytes"], rep["skipped_bytes"]) == (len(data), 0), "copied whole"
    assert sim.wake_up(None)["verified_bytes"] == len(data)
    assert sim.read(addr, len(data)) == data


@pytest.mark.usefixtures("codec_on")
@pytest.mark.parametrize("tier", ["host", "file"])
def test_a_compressed_backup_restored_wrong_fails_the_wake_until_a_later_one(sim, tmp_path, tier):
    if tier == "file":
        sim.set_spill_dir(tmp_path, named=True)
        sim.set_staging_bytes(8 * 4 * GRAN)  # a chunk fits a slot: the file tier compresses
    sim.set_tag_policy(TAG, backup_tier=tier)
    data = bf16_like(8 * GRAN, 3)
    addr = alloc(sim, data)
    assert sim.sleep(TAG)["raw_bytes"] == len(data), "compressed"
    mapped = mapped_now(sim)
    sim.inject_fault("decompress_corrupt", 1)
    with pytest.raises(CumemError) as err:
        sim.wake_up(None)
    assert_failed_whole(sim, err, [addr], mapped)
    assert f"compressed {tier} backup" in str(err.value)
    assert sim.wake_up(None)["verified_bytes"] == len(data)
    assert sim.read(addr, len(data)) == data


@pytest.fixture
def named(backend, tmp_path) -> Iterator[Allocator]:
    """An allocator (sim, or the process-wide CUDA one) whose TAG goes raw to named spill files in tmp_path,
    without retained backups; the CUDA one is left as it was found."""
    with allocator_for(backend) as a:
        retain = a.retains_backups()
        a.set_spill_dir(tmp_path, named=True)
        a.set_tag_policy(TAG, backup_tier="file", compress="off")
        a.set_retain_backups(False)
        try:
            yield a
        finally:
            a.set_retain_backups(retain)
            a.set_tag_policy(TAG)
            a.set_spill_dir(None)


def test_a_raw_file_backup_damaged_on_disk_fails_the_wake_until_repaired(named, tmp_path):
    a = named
    gran = a.granularity(0)
    data, other = os.urandom(2 * gran), os.urandom(gran)
    addr, b = alloc(a, data), alloc(a, other)
    a.sleep(TAG)
    files = named_files(tmp_path)
    assert len(files) == 2
    (file,) = [f for f in files if f.stat().st_size == len(data)]
    old = overwrite(file, gran + 100, BAD)  # the middle of the file
    mapped = mapped_now(a)
    with pytest.raises(CumemError) as err:
        a.wake_up(TAG)
    assert_failed_whole(a, err, [addr], mapped)
    assert "raw file backup" in str(err.value) and f"{b:#x}" not in str(err.value)
    assert a.read_backup(addr, len(data))[gran + 100 : gran + 140] == BAD, "the backup as it lies"
    assert len(named_files(tmp_path)) == 2, "the files stay"
    overwrite(file, gran + 100, old)
    rep = a.wake_up(TAG)
    assert rep["verified_bytes"] == len(data) + len(other)
    assert a.read(addr, len(data)) == data and a.read(b, len(other)) == other
    assert named_files(tmp_path) == []
    a.free(addr)
    a.free(b)


def test_a_retained_file_backup_damaged_while_awake_fails_the_wake_and_is_written_whole_next_time(sim, tmp_path):
    """The issue's repro: sleep, wake (the file backup retained), 64 zero bytes written at the start of the file
    while awake, sleep (nothing written: the device did not change), wake: the device's first 64 bytes were zeros."""
    sim.set_spill_dir(tmp_path, named=True)
    sim.set_tag_policy(TAG, backup_tier="file", compress="off")
    sim.set_staging_bytes(8 * 4096)
    data = os.urandom(4 * GRAN)
    addr = alloc(sim, data)
    sim.sleep(TAG)
    sim.wake_up(None)
    (file,) = named_files(tmp_path)
    old = overwrite(file, 0, bytes(64))
    rep = sim.sleep(TAG)
    assert (rep["written_bytes"], rep["skipped_bytes"]) == (0, len(data))
    mapped = mapped_now(sim)
    with pytest.raises(CumemError) as err:
        sim.wake_up(None)
    assert_failed_whole(sim, err, [addr], mapped)
    assert "chunk at +0x0" in str(err.value)
    overwrite(file, 0, old)
    sim.wake_up(None)
    assert sim.read(addr, len(data)) == data
    assert sim.stats()["retained_allocations"] == 0 and named_files(tmp_path) == [], "not retained: its file went"
    rep = sim.sleep(TAG)
    assert (rep["written_bytes"], rep["skipped_bytes"]) == (len(data), 0), "written whole"
    assert sim.wake_up(None)["verified_bytes"] == len(data)
    assert sim.read(addr, len(data)) == data


def test_with_verify_wake_off_the_damage_goes_unseen_and_nothing_is_verified(monkeypatch, tmp_path):
    monkeypatch.setenv("CUMEM_RS_VERIFY_WAKE", "0")
    a = Allocator.simulated(devices=1, capacity=SIM_CAPACITY, granularity=GRAN)
    try:
        a.set_spill_dir(tmp_path, named=True)
        a.set_tag_policy(TAG, backup_tier="file", compress="off")
        data = os.urandom(2 * GRAN)
        addr = alloc(a, data)
        a.sleep(TAG)
        (file,) = named_files(tmp_path)
        overwrite(file, GRAN, BAD)
        rep = a.wake_up(None)
        assert (rep["verified_bytes"], rep["copied_bytes"]) == (0, len(data))
        assert a.read(addr, len(data))[GRAN : GRAN + len(BAD)] == BAD, "restored as it lay"
    finally:
        a.close()


def test_a_write_through_a_writable_view_while_asleep_is_restored_as_written(sim):
    """`view_backup`'s documented promise (torch_memory_saver's zero-copy `get_cpu_backup`): a write through a
    writable view changes what the next wake restores. That allocation is not verified; the others are."""
    sim.set_tag_policy(TAG, compress="off")
    data, other = os.urandom(2 * GRAN), os.urandom(GRAN)
    addr, b = alloc(sim, data), alloc(sim, other)
    sim.sleep(TAG)
    view = sim.view_backup(addr, len(data))  # writable
    poke(view, 16, BAD)
    del view
    rep = sim.wake_up(None)
    assert rep["verified_bytes"] == len(other), "the written one is the caller's"
    assert sim.read(addr, len(data)) == data[:16] + BAD + data[16 + len(BAD) :]
    assert sim.read(b, len(other)) == other


def test_set_verify_wakes_switches_it_at_run_time(sim, tmp_path):
    """Read at each wake: off, a damaged backup is restored as it lay; on again, the next sleep's backup is checked.
    A sleep while off (and without retained backups) takes no prints: its backup wakes unverified."""
    sim.set_spill_dir(tmp_path, named=True)
    sim.set_tag_policy(TAG, backup_tier="file", compress="off")
    sim.set_retain_backups(False)
    assert sim.verifies_wakes()
    data = os.urandom(2 * GRAN)
    addr = alloc(sim, data)
    sim.sleep(TAG)  # prints taken
    (file,) = named_files(tmp_path)
    overwrite(file, GRAN, BAD)
    sim.set_verify_wakes(False)
    assert sim.wake_up(None)["verified_bytes"] == 0 and not sim.verifies_wakes()
    assert sim.read(addr, len(data))[GRAN : GRAN + len(BAD)] == BAD, "off: restored as it lay"
    sim.write(addr, data)
    sim.sleep(TAG)  # off, no retention: no prints
    sim.set_verify_wakes(True)
    assert sim.wake_up(None)["verified_bytes"] == 0, "nothing to compare with"
    sim.sleep(TAG)
    (file,) = named_files(tmp_path)
    old = overwrite(file, GRAN, BAD)
    with pytest.raises(CumemError, match="did not restore intact"):
        sim.wake_up(None)
    overwrite(file, GRAN, old)
    assert sim.wake_up(None)["verified_bytes"] == len(data)
    assert sim.read(addr, len(data)) == data
    with pytest.raises(cumem_rs.CumemTypeError, match="on must be"):
        sim.set_verify_wakes(None)
    sim.close()
    with pytest.raises(cumem_rs.ClosedError):
        sim.verifies_wakes()
