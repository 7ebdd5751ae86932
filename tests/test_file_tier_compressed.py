"""Compressed backups in the file tier, on the simulated driver's host codec: a file-tier tag that compresses
writes the codec's blobs, so the disk holds the compressed bytes; they come back bit-identical and verified;
unchanged ones are kept across a wake and not written again, changed ones are written afresh; what does not
shrink is an ordinary raw file backup (rewritten chunk by chunk); and the fault paths keep every byte (a codec
failure at sleep writes raw, a failed read or decompression fails the wake whole and a later one succeeds)."""

from __future__ import annotations

import os

import pytest

import cumem_rs
from cumem_rs import Allocator, CumemError
from conftest import SIM_CAPACITY, SIM_GRANULARITY, live_counts, spill_files
from test_compression import bf16_like, weights

GRAN = SIM_GRANULARITY
CHUNK = 64 << 10
# These tests are about the codec: it stays on whatever the environment says.
pytestmark = pytest.mark.usefixtures("codec_on")
#: A ring of 8 slots of 4 chunks: an allocation of 16 granules is 4 frames.
STAGING = 8 * 4 * CHUNK


@pytest.fixture
def sim(tmp_path):
    a = Allocator.simulated(devices=1, capacity=SIM_CAPACITY, granularity=GRAN)
    a.set_fingerprint_chunk(CHUNK)
    a.set_staging_bytes(STAGING)
    a.set_spill_dir(str(tmp_path))
    a.set_tag_policy("weights", backup_tier="file")
    yield a
    a.close()


def test_bf16_weights_go_to_their_file_compressed_and_come_back_bit_identical(sim, tmp_path):
    data = bf16_like(16 * GRAN, 1)
    addr = weights(sim, data)
    report = sim.sleep(["weights"])
    stored = report["stored_bytes"]
    assert report["raw_bytes"] == len(data) and 0 < stored < 0.8 * len(data), report
    assert report["written_bytes"] == stored, "the file got the blobs, not the raw bytes"
    s = sim.stats()
    assert (s["file_tier_bytes"], s["file_tier_stored_bytes"]) == (len(data), stored)
    assert s["host_tier_bytes"] == 0 and s["compressed_bytes"] == 0, "nothing of it in host memory"
    assert spill_files(sim, tmp_path)[1] <= stored, "the reserved raw blocks past the blobs went back"
    assert sim.read_backup(addr + 3 * CHUNK + 5, 2 * CHUNK) == data[3 * CHUNK + 5 : 5 * CHUNK + 5]
    woken = sim.wake_up(None)
    assert woken["read_bytes"] == stored and woken["copied_bytes"] == len(data), woken
    assert (woken["raw_bytes"], woken["stored_bytes"]) == (len(data), stored)
    assert sim.read(addr, len(data)) == data


def test_an_unchanged_compressed_file_backup_is_kept_and_a_changed_one_written_afresh(sim):
    data = bytearray(bf16_like(16 * GRAN, 2))
    addr = weights(sim, bytes(data))
    first = sim.sleep(["weights"])["stored_bytes"]
    sim.wake_up(None)
    again = sim.sleep(["weights"])
    assert again["written_bytes"] == 0 and again["skipped_bytes"] == len(data), again
    sim.wake_up(None)
    assert sim.read(addr, len(data)) == bytes(data)
    data[7 * CHUNK : 7 * CHUNK + 4] = b"\x01\x02\x03\x04"
    sim.write(addr + 7 * CHUNK, b"\x01\x02\x03\x04")
    changed = sim.sleep(["weights"])
    assert changed["raw_bytes"] == len(data), "backed up afresh, compressed"
    assert 0 < changed["written_bytes"] <= first + 4096, changed
    sim.wake_up(None)
    assert sim.read(addr, len(data)) == bytes(data)


def test_incompressible_bytes_make_a_raw_file_backup_whose_changed_chunks_are_rewritten_alone(sim):
    data = bytearray(os.urandom(16 * GRAN))
    addr = weights(sim, bytes(data))
    report = sim.sleep(["weights"])
    assert report["raw_bytes"] == 0 and report["written_bytes"] == len(data), report
    assert sim.stats()["file_tier_stored_bytes"] == len(data)
    sim.wake_up(None)
    sim.write(addr + 9 * CHUNK, b"\xff" * 16)
    data[9 * CHUNK : 9 * CHUNK + 16] = b"\xff" * 16
    rewrite = sim.sleep(["weights"])
    assert rewrite["written_bytes"] <= CHUNK, "only the changed chunk, in place"
    sim.wake_up(None)
    assert sim.read(addr, len(data)) == bytes(data)


def test_compress_off_writes_raw_bytes_to_the_file(sim):
    sim.set_tag_policy("weights", backup_tier="file", compress="off")
    data = bf16_like(8 * GRAN, 3)
    addr = weights(sim, data)
    report = sim.sleep(["weights"])
    assert report["raw_bytes"] == 0 and report["written_bytes"] == len(data)
    sim.wake_up(None)
    assert sim.read(addr, len(data)) == data


def test_a_codec_failure_at_sleep_writes_those_backups_raw(sim):
    data = bf16_like(16 * GRAN, 4)
    addr = weights(sim, data)
    sim.inject_fault("compress", 2, "unknown")  # the second frame: the first one's blobs are in the file already
    report = sim.sleep(["weights"])
    assert report["written_bytes"] >= len(data) and report["raw_bytes"] == 0, report
    assert any("compress" in e and "raw" in e for e in sim.errors()), sim.errors()
    sim.wake_up(None)
    assert sim.read(addr, len(data)) == data


@pytest.mark.parametrize("error", ["eio", "short", "enospc"])
def test_a_failed_write_leaves_the_allocation_awake_with_its_data(sim, error):
    data = bf16_like(16 * GRAN, 5)
    addr = weights(sim, data)
    sim.inject_spill_fault("write", 3, error)
    with pytest.raises(CumemError):
        sim.sleep(["weights"])
    assert sim.stats()["asleep_allocations"] == 0
    assert sim.read(addr, len(data)) == data
    sim.clear_spill_faults()
    assert sim.sleep(["weights"])["raw_bytes"] == len(data)
    sim.wake_up(None)
    assert sim.read(addr, len(data)) == data


@pytest.mark.parametrize("fault", ["read", "decompress", "decompress_corrupt"])
def test_a_failed_read_or_decompression_fails_the_wake_whole_and_a_later_one_succeeds(sim, fault):
    data = bf16_like(16 * GRAN, 6)
    addr = weights(sim, data)
    other = weights(sim, bf16_like(4 * GRAN, 7))
    sim.sleep(["weights"])
    mapped = live_counts(sim)["mapped_bytes"]
    if fault == "read":
        sim.inject_spill_fault("read", 2, "eio")
    else:
        assert fault in cumem_rs.FAULT_OPS + cumem_rs._native.CORRUPTING_FAULT_OPS
        sim.inject_fault(fault, 1, "unknown")
    with pytest.raises(CumemError) as err:
        sim.wake_up(None)
    if fault == "decompress_corrupt":
        assert "did not restore intact" in str(err.value) and f"{addr:#x}" in str(err.value)
    elif fault == "decompress":
        assert f"{addr:#x}" in str(err.value)
    s = sim.stats()
    assert s["asleep_allocations"] == 2 and s["file_tier_bytes"] == 20 * GRAN, "backups kept"
    assert live_counts(sim)["mapped_bytes"] == mapped, "what the wake mapped was released"
    sim.wake_up(None)
    assert sim.read(addr, len(data)) == data
    assert sim.read(other, 4 * GRAN) == bf16_like(4 * GRAN, 7)


def test_a_ring_made_too_small_for_a_blob_since_the_sleep_fails_the_wake_clearly(sim):
    data = bf16_like(16 * GRAN, 8)
    addr = weights(sim, data)
    sim.sleep(["weights"])
    sim.set_staging_bytes(4096)
    with pytest.raises(CumemError, match="staging"):
        sim.wake_up(None)
    assert sim.stats()["asleep_allocations"] == 1
    sim.set_staging_bytes(STAGING)
    sim.wake_up(None)
    assert sim.read(addr, len(data)) == data
