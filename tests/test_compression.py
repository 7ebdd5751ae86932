"""Compressed backups through the Python API, on the simulated driver's host codec: round trips, host bytes held,
retained chunks not compressed again, the `compress=` policy and its bad values, and the codec's fault paths
(sleep falls back to raw copies; a wake that cannot decompress or restores wrong bytes fails whole, and a later
wake succeeds)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import cumem_rs
from cumem_rs import Allocator, CumemError, CumemValueError
from conftest import SIM_CAPACITY, SIM_GRANULARITY, live_counts

GRAN = SIM_GRANULARITY
# These tests are about the codec: it stays on whatever the environment says.
pytestmark = pytest.mark.usefixtures("codec_on")


def bf16_like(nbytes: int, seed: int) -> bytes:
    """bf16 bit patterns of N(0, 0.02) samples, what `torch.randn(...) * 0.02` in bf16 holds."""
    x = (np.random.default_rng(seed).standard_normal(nbytes // 2) * 0.02).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


@pytest.fixture
def sim():
    a = Allocator.simulated(devices=1, capacity=SIM_CAPACITY, granularity=GRAN)
    yield a
    a.close()


def weights(a: Allocator, data: bytes) -> int:
    a.push_tag("weights")
    try:
        addr = a.malloc(len(data), 0)
    finally:
        a.pop_tag()
    a.write(addr, data)
    return addr


def test_codec_is_reported_and_can_be_switched_off():
    a = Allocator.simulated(granularity=GRAN)
    raw = Allocator.simulated(granularity=GRAN, compress=False)
    try:
        assert "zstd" in a.stats()["codec"]
        assert a.info()["codec"] == a.stats()["codec"]
        assert raw.stats()["codec"] is None and raw.info()["codec"] is None
    finally:
        a.close()
        raw.close()


def test_bf16_random_and_zero_data_round_trip_and_bf16_takes_less_host_memory(sim):
    datas = [bf16_like(32 * GRAN, 1), os.urandom(8 * GRAN), bytes(8 * GRAN)]
    addrs = [weights(sim, d) for d in datas]
    raw_total = sum(map(len, datas))
    report = sim.sleep(["weights"])
    assert report["raw_bytes"] == report["copied_bytes"] == raw_total
    s = sim.stats()
    assert s["host_tier_bytes"] == s["compressed_raw_bytes"] == raw_total
    assert s["compressed_bytes"] == s["host_tier_stored_bytes"] == report["stored_bytes"]
    bf16_ratio = (report["stored_bytes"] - len(datas[1])) / len(datas[0])  # random bytes are stored raw
    assert 0.6 < bf16_ratio < 0.75, bf16_ratio
    assert s["compression_ratio"] == pytest.approx(report["stored_bytes"] / raw_total)
    assert sim.host_bytes() < 0.75 * raw_total
    assert sim.read_backup(addrs[0], 4096) == datas[0][:4096]
    woke = sim.wake_up(None)
    assert (woke["raw_bytes"], woke["stored_bytes"]) == (raw_total, report["stored_bytes"])
    for addr, d in zip(addrs, datas):
        assert sim.read(addr, len(d)) == d


def test_a_retained_unchanged_chunk_is_not_compressed_again(sim):
    sim.set_fingerprint_chunk(GRAN)
    data = bytearray(bf16_like(8 * GRAN, 2))
    addr = weights(sim, bytes(data))
    sim.sleep(["weights"])
    sim.wake_up(None)
    before = sim.driver_counts()["codec_compressed"]
    report = sim.sleep(["weights"])
    assert sim.driver_counts()["codec_compressed"] == before, "nothing changed: no chunk compressed"
    assert (report["skipped_bytes"], report["copied_bytes"]) == (8 * GRAN, 0)
    sim.wake_up(None)
    patch = bf16_like(GRAN, 3)
    data[2 * GRAN:3 * GRAN] = patch
    sim.write(addr + 2 * GRAN, patch)
    report = sim.sleep(["weights"])
    assert sim.driver_counts()["codec_compressed"] == before + 1, "only the changed chunk"
    assert (report["skipped_bytes"], report["copied_bytes"]) == (7 * GRAN, GRAN)
    sim.wake_up(None)
    assert sim.read(addr, len(data)) == bytes(data)


@pytest.mark.parametrize("mode", ["auto", "bits16", "bits8", "bytes"])
def test_every_mode_round_trips_and_off_stores_raw(sim, mode):
    data = bf16_like(8 * GRAN, 4)
    sim.set_tag_policy("weights", compress=mode)
    assert sim.tag_policy("weights").get("compress", "auto") == mode
    addr = weights(sim, data)
    assert sim.sleep(["weights"])["raw_bytes"] == len(data)
    sim.wake_up(None)
    assert sim.read(addr, len(data)) == data
    sim.set_tag_policy("weights", compress="off")
    assert sim.status()["tags"]["weights"]["compress"] == "off"
    report = sim.sleep(["weights"])
    assert report["raw_bytes"] == 0 and sim.stats()["compressed_bytes"] == 0
    sim.wake_up(None)
    assert sim.read(addr, len(data)) == data


def test_a_compression_failing_part_way_keeps_what_it_finished_and_copies_the_rest_raw(sim):
    """The codec fails at the third blob: the first allocation (two 2 MiB chunks) was complete and released under
    the codec, so it sleeps compressed; the other is copied raw by the same sleep. Both wake intact."""
    size = 2 * (2 << 20)
    datas = [bf16_like(size, 11), bf16_like(size, 12)]
    addrs = [weights(sim, d) for d in datas]
    sim.inject_fault("compress_blob", 3, "unknown")
    report = sim.sleep(["weights"])
    assert (report["raw_bytes"], report["copied_bytes"]) == (size, 2 * size)
    assert sim.stats()["asleep_allocations"] == 2 and sim.stats()["mapped_bytes"] == 0
    assert any("compress" in e and "raw" in e for e in sim.errors()), sim.errors()
    sim.wake_up(None)
    assert [sim.read(a, size) for a in addrs] == datas


@pytest.mark.parametrize("bad", ["zip", "", "OFF", 16, None, ["auto"]])
def test_a_bad_compress_value_is_refused_naming_the_argument(sim, bad):
    with pytest.raises((CumemValueError, cumem_rs.CumemTypeError), match="compress"):
        sim.set_tag_policy("weights", compress=bad)
    assert "compress" not in sim.tag_policy("weights")


def test_cumem_rs_compress_0_turns_compression_off(tmp_path):
    import subprocess
    import sys

    code = (
        "from cumem_rs import Allocator\n"
        "a = Allocator.simulated(granularity=64 << 10)\n"
        "print(a.stats()['codec'])\n"
    )
    env = dict(os.environ, CUMEM_RS_COMPRESS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None", out
    env["CUMEM_RS_COMPRESS"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "zstd" in out.stdout, out


def test_a_failed_compression_falls_back_to_raw_copies(sim):
    data = bf16_like(8 * GRAN, 5)
    addr = weights(sim, data)
    sim.inject_fault("compress", 1, "unknown")
    report = sim.sleep(["weights"])
    assert (report["copied_bytes"], report["raw_bytes"]) == (len(data), 0)
    assert any("compress" in e and "raw" in e for e in sim.errors()), sim.errors()
    sim.wake_up(None)
    assert sim.read(addr, len(data)) == data


@pytest.mark.parametrize("op", ["decompress", "decompress_corrupt"])
def test_a_failed_or_corrupted_decompression_fails_the_wake_whole(sim, op):
    assert op in cumem_rs.FAULT_OPS + cumem_rs._native.CORRUPTING_FAULT_OPS
    data = bf16_like(8 * GRAN, 6)
    addr = weights(sim, data)
    other = weights(sim, bf16_like(2 * GRAN, 7))
    sim.sleep(["weights"])
    mapped = live_counts(sim)["mapped_bytes"]
    sim.inject_fault(op, 1, "unknown")
    with pytest.raises(CumemError, match=f"{addr:#x}") as err:
        sim.wake_up(None)
    if op == "decompress_corrupt":
        assert "did not restore intact" in str(err.value)
    s = sim.stats()
    assert s["asleep_allocations"] == 2 and s["compressed_raw_bytes"] == 10 * GRAN, "backups kept"
    assert live_counts(sim)["mapped_bytes"] == mapped, "what the wake mapped was released"
    sim.wake_up(None)
    assert sim.read(addr, len(data)) == data
    assert sim.read(other, 2 * GRAN) == bf16_like(2 * GRAN, 7)
