"""Which of torch's pool segments lie in asleep memory (`_pools.segments_in_asleep_memory`): what decides that a
region's pool is replaced and a capture into a shared graph pool refused while a tag sleeps. On the simulated
device, with segments at the addresses of real allocations (torch's snapshot entries carry more keys; only the
address is read). The GPU flows are in test_memory_saver_cuda.py, test_preload_cuda.py and test_torch_cuda.py."""

from __future__ import annotations

import pytest

from cumem_rs import Allocator
from cumem_rs._pools import asleep_segments, segments_in_asleep_memory

GRAN = 64 << 10


@pytest.fixture
def sim():
    a = Allocator.simulated(devices=1, capacity=64 * GRAN, granularity=GRAN)
    yield a
    a.close()


def _alloc(a: Allocator, tag: str, size: int) -> int:
    a.push_tag(tag)
    try:
        return a.malloc(size, 0)
    finally:
        a.pop_tag()


def test_segments_of_a_sleeping_tag_are_found_and_no_others(sim):
    kv = [_alloc(sim, "kv", 2 * GRAN), _alloc(sim, "kv", GRAN)]
    w = _alloc(sim, "w", 3 * GRAN)
    segments = [{"address": p, "total_size": 0} for p in kv + [w]]
    assert segments_in_asleep_memory(sim, segments) == []
    sim.sleep([])  # nothing offloaded: every tag's memory is discarded and asleep
    assert segments_in_asleep_memory(sim, segments) == kv + [w]
    sim.wake_up(["w"])
    assert segments_in_asleep_memory(sim, segments) == kv, "w woke; kv sleeps"
    sim.wake_up(None)
    assert segments_in_asleep_memory(sim, segments) == []


def test_a_segment_inside_an_asleep_allocation_counts_and_one_past_its_end_does_not():
    asleep = [(0x1000, 0x3000), (0x8000, 0x1000)]
    segments = [{"address": a} for a in (0x0FFF, 0x1000, 0x2FFF, 0x3FFF, 0x4000, 0x8000, 0x9000)]
    assert asleep_segments(segments, asleep) == [0x1000, 0x2FFF, 0x3FFF, 0x8000]


def test_no_segments_or_nothing_asleep_is_no_hit(sim):
    p = _alloc(sim, "kv", GRAN)
    assert segments_in_asleep_memory(sim, []) == []
    assert segments_in_asleep_memory(sim, [{"address": p}]) == []


def test_a_pool_is_looked_up_in_torchs_snapshot_only_while_something_sleeps(sim, monkeypatch):
    """`pool_holds_asleep_memory` runs before every capture into a shared graph pool (vLLM: one per graph); torch's
    snapshot of the whole allocator is taken only when an allocation sleeps. Here the snapshot is a stand-in
    (no GPU): one segment of pool (5, 0) at the start of a real allocation."""
    torch = pytest.importorskip("torch")
    from cumem_rs._pools import pool_holds_asleep_memory

    p = _alloc(sim, "kv", 2 * GRAN)
    snapshots = []

    def snapshot(include_traces=True):
        snapshots.append(include_traces)
        return [{"address": p, "segment_pool_id": (5, 0), "total_size": 2 * GRAN}]

    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    assert not pool_holds_asleep_memory(sim, (5, 0))
    assert snapshots == [], "nothing sleeps: no snapshot"
    sim.sleep([])
    assert pool_holds_asleep_memory(sim, [5, 0]), "a token given as a list names the same pool"
    assert not pool_holds_asleep_memory(sim, (6, 0)), "another pool's segments are not this one's"
    assert len(snapshots) == 2
    sim.wake_up(None)
    assert not pool_holds_asleep_memory(sim, (5, 0)) and len(snapshots) == 2
