"""The host RAM guard bounds the real peak of a sleep (issue 36 item 1), on the simulated driver.

`CUMEM_RS_HOST_MEMORY_LIMIT` caps the host memory the store holds, as a memory cgroup's `memory.max` caps the
process: a sleep whose real peak (blob arenas and their growth, the raw fallback, the cached arena, the staging ring,
pinning ahead) would pass it is refused before anything is released, with every allocation awake and its data
intact; one that fits succeeds; and the next sleep/wake cycles stay under it. Where a real cgroup's kernel would kill
the process, the simulated driver only pins: the most it had pinned at once (`host_peak_pinned_bytes`) is what the
kernel would have charged, so it must never pass the limit. For raw and compressed backups, in host memory and with
a file tier (a spill directory; tag policy "auto" or "file")."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from cumem_rs import Allocator, CumemOutOfMemoryError

M = 1 << 20
GRAN = 2 * M
LIMIT = 24 * M  # the "cgroup": 32 MiB of weights do not fit raw, bf16 weights compressed do
N, SIZE = 4, 8 * M


def content(kind: str, seed: int) -> bytes:
    """8 MiB of: random bytes (incompressible), float32 4.0 (`torch.full(..., 4)`: compresses to almost nothing),
    or bf16 N(0, 0.02) (`randn * 0.02`: ratio about 0.68)."""
    if kind == "random":
        return os.urandom(SIZE)
    if kind == "full":
        return np.full(SIZE // 4, 4.0, np.float32).tobytes()
    x = (np.random.default_rng(seed).standard_normal(SIZE // 2) * 0.02).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def make(monkeypatch, compress: bool, tier: str | None, tmp_path) -> Allocator:
    """A simulated machine under the limit; `tier`: None (host memory only), "auto" or "file" with a spill dir."""
    monkeypatch.setenv("CUMEM_RS_HOST_MEMORY_LIMIT", str(LIMIT))
    if compress:
        monkeypatch.delenv("CUMEM_RS_COMPRESS", raising=False)
    else:
        monkeypatch.setenv("CUMEM_RS_COMPRESS", "0")
    a = Allocator.simulated(devices=1, capacity=256 * M, granularity=GRAN)
    if tier is not None:
        a.set_spill_dir(tmp_path)
        a.set_staging_bytes(4 * M)
        if tier == "file":
            a.set_tag_policy("weights", backup_tier="file")
    return a


def weights(a: Allocator, kind: str) -> dict[int, bytes]:
    a.push_tag("weights")
    try:
        addrs = [a.malloc(SIZE, 0) for _ in range(N)]
    finally:
        a.pop_tag()
    datas = {addr: content(kind, i) for i, addr in enumerate(addrs)}
    for addr, d in datas.items():
        a.write(addr, d)
    return datas


def under_limit(a: Allocator, when: str) -> None:
    held = a.host_bytes()
    assert held <= LIMIT, f"{when}: the store holds {held} bytes of host memory, past the limit of {LIMIT}"
    peak = a.driver_counts()["host_peak_pinned_bytes"]
    assert peak <= LIMIT, f"{when}: {peak} bytes were pinned at once, past the limit of {LIMIT} (the kill)"


def intact(a: Allocator, datas: dict[int, bytes], when: str) -> None:
    for addr, d in datas.items():
        assert a.read(addr, len(d)) == d, f"{when}: allocation {addr:#x} lost its data"


def sleep_or_refuse(a: Allocator, datas: dict[int, bytes], when: str) -> bool:
    """Sleep the weights: True when it went to sleep; a refusal must have released nothing."""
    try:
        a.sleep(["weights"])
    except CumemOutOfMemoryError as e:
        assert "bytes of host memory" in str(e), e
        assert a.stats()["asleep_allocations"] == 0, f"{when}: refused after releasing some: {e}"
        under_limit(a, f"{when} (refused)")
        intact(a, datas, f"{when} (refused)")
        return False
    assert a.stats()["asleep_allocations"] == N
    under_limit(a, when)
    return True


def cycles(a: Allocator, datas: dict[int, bytes]) -> list[bool]:
    """The issue's sequence: sleep, wake, verify, sleep(()), wake; then two more changed sleeps of the weights."""
    slept = [sleep_or_refuse(a, datas, "first sleep")]
    a.wake_up(None)
    under_limit(a, "wake")
    intact(a, datas, "wake")
    a.sleep([])  # backs nothing up: the weights are discarded, their retained backups dropped
    under_limit(a, "sleep(())")
    a.wake_up(None)
    under_limit(a, "wake after sleep(())")
    for i in range(2):
        for addr, d in datas.items():  # rewritten, as a trainer would
            a.write(addr, d)
        slept.append(sleep_or_refuse(a, datas, f"sleep {i + 2}"))
        a.wake_up(None)
        under_limit(a, f"wake {i + 2}")
        intact(a, datas, f"wake {i + 2}")
    return slept


@pytest.mark.parametrize("kind", ["random", "full", "bf16"])
@pytest.mark.parametrize("compress", [False, True], ids=["raw", "codec"])
def test_a_host_tier_sleep_fits_the_limit_or_is_refused_with_nothing_released(monkeypatch, tmp_path, compress, kind):
    a = make(monkeypatch, compress, None, tmp_path)
    try:
        datas = weights(a, kind)
        slept = cycles(a, datas)
        if not compress or kind == "random":
            assert slept == [False] * 3, "32 MiB of raw backups cannot fit a limit of 24 MiB"
        elif kind == "full":
            assert slept == [True] * 3, "weights that compress to almost nothing fit"
    finally:
        a.close()


@pytest.mark.parametrize("kind", ["random", "full", "bf16"])
@pytest.mark.parametrize("tier", ["auto", "file"])
@pytest.mark.parametrize("compress", [False, True], ids=["raw", "codec"])
def test_with_a_file_tier_every_sleep_succeeds_under_the_limit(monkeypatch, tmp_path, compress, tier, kind):
    """What does not fit the host's room goes to the spill file: nothing refused, the limit never passed."""
    a = make(monkeypatch, compress, tier, tmp_path)
    try:
        datas = weights(a, kind)
        assert cycles(a, datas) == [True] * 3
        if tier == "auto":
            assert a.stats()["file_tier_bytes"] == 0  # all awake at the end
    finally:
        a.close()


def test_a_staging_ring_past_the_limit_is_refused_with_nothing_released(monkeypatch, tmp_path):
    a = make(monkeypatch, False, "file", tmp_path)
    try:
        a.set_staging_bytes(2 * LIMIT)
        datas = weights(a, "random")
        assert sleep_or_refuse(a, datas, "sleep through a ring past the limit") is False
        a.set_staging_bytes(4 * M)
        assert sleep_or_refuse(a, datas, "sleep through a small ring") is True
        a.wake_up(None)
        intact(a, datas, "wake")
    finally:
        a.close()


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "codec"])
def test_pinning_ahead_stops_at_the_limit_and_the_sleep_after_it_stays_under(monkeypatch, tmp_path, compress):
    """Pinning ahead is background touching: it must never be what passes the limit, and the sleep that takes its
    buffer must pin no more than the room left."""
    a = make(monkeypatch, compress, None, tmp_path)
    try:
        a.set_pin_chunk(GRAN)
        datas = weights(a, "full")
        a.reserve_host(2 * LIMIT, background=True)
        deadline = time.monotonic() + 60
        while a.pin_ahead_status()["running"]:  # until it stops by itself, at the limit
            assert time.monotonic() < deadline, "the pin-ahead worker did not stop"
            time.sleep(0.01)
        a.stop_pinning_ahead()
        under_limit(a, "pinned ahead")
        assert a.driver_counts()["host_pinned_bytes"] > 0, "it pinned what the limit allows"
        slept = sleep_or_refuse(a, datas, "sleep after pinning ahead")
        assert slept == compress, "compressed, 4.0s take almost nothing; raw, 32 MiB do not fit"
        a.wake_up(None)
        intact(a, datas, "wake")
        under_limit(a, "wake")
    finally:
        a.close()


def bf16(nbytes: int, seed: int) -> bytes:
    x = (np.random.default_rng(seed).standard_normal(nbytes // 2) * 0.02).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


@pytest.mark.usefixtures("codec_on")
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_retained_compressed_backups_hold_no_more_than_none_when_the_weights_change(fraction):
    """Issue 35 item 1: an RL loop rewrites the weights between wake and sleep. Host memory held after each of 5
    changed sleeps is at most what the same loop holds without retained backups, +2%: the new blobs reuse the bytes
    of the dead ones (the chunks that changed) instead of a second arena pinned beside them (before: 2x at 100%
    rewritten, 1.6x at 50%)."""
    held = {}
    for retain in (False, True):
        a = Allocator.simulated(devices=1, capacity=512 * M, granularity=GRAN)
        try:
            a.set_retain_backups(retain)
            a.push_tag("weights")
            addrs = [a.malloc(SIZE, 0) for _ in range(8)]
            a.pop_tag()
            for i, addr in enumerate(addrs):
                a.write(addr, bf16(SIZE, i))
            held[retain] = []
            for cycle in range(5):
                a.sleep(["weights"])
                held[retain].append(a.host_bytes())
                assert a.host_bytes() <= a.stats()["compressed_raw_bytes"], "more than the raw bytes"
                a.wake_up(None)
                n = int(SIZE * fraction) // GRAN * GRAN  # each tensor's first fraction, as a trainer's step
                for i, addr in enumerate(addrs):
                    data = bf16(n, 100 * (cycle + 1) + i)
                    a.write(addr, data)
                    assert a.read(addr, n) == data
        finally:
            a.close()
    for cycle, (off, on) in enumerate(zip(held[False], held[True])):
        assert on <= off * 1.02, (
            f"sleep {cycle + 1}, {fraction:.0%} rewritten: {on} bytes held with retained backups, {off} without "
            f"(all: {held})"
        )
