"""When the memory saver's torch pools are destroyed (preload mode): a region's pool replaced because it holds paused
segments, and a capture under way. torch aborts the process when a MemPool is destroyed while any allocation is
routed to a pool or a CUDA graph is being captured, so such a pool must be destroyed by `pool_activity`, under its
lock, once no block is active, never by whichever frame last referenced it.

No GPU here: torch's MemPool, use_mem_pool and graph are replaced by stand-ins that record, at each pool's
destruction, whether it happened under `pool_activity`'s lock and whether a capture was under way. Everything of
cumem_rs's (the saver's region pools, `pool_block`, `pool_activity`) is the real code."""

from __future__ import annotations

import contextlib
import itertools
from typing import Iterator

import pytest

torch = pytest.importorskip("torch")

from cumem_rs import Allocator  # noqa: E402
from cumem_rs import memory_saver  # noqa: E402
from cumem_rs._pools import pool_activity  # noqa: E402
from cumem_rs._sim_pools import SimulatedPools  # noqa: E402
from cumem_rs.memory_saver import TorchMemorySaver  # noqa: E402

KEY = ("lifetime", "none", 0)


class _Torch:
    """Stand-ins for torch.cuda.MemPool / use_mem_pool / graph, recording each pool's destruction."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.capturing = False
        self.destroyed: list[tuple[int, bool, bool]] = []  # (pool, under pool_activity's lock, during a capture)
        self.asleep: set[int] = set()  # pools whose segments the saver is told are paused
        outer = self

        class MemPool:
            def __init__(self) -> None:
                self.id = (next(outer.ids), 0)

            def __del__(self) -> None:
                outer.destroyed.append((self.id[0], pool_activity._lock.locked(), outer.capturing))

        self.MemPool = MemPool

    @contextlib.contextmanager
    def use_mem_pool(self, pool, device=None) -> Iterator[None]:
        yield  # holds `pool` in this frame until the block ends, as torch's does

    @contextlib.contextmanager
    def graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global") -> Iterator[None]:
        self.capturing = True
        try:
            yield
        finally:
            self.capturing = False


@pytest.fixture
def fake(monkeypatch) -> _Torch:
    t = _Torch()
    monkeypatch.setattr(torch.cuda, "MemPool", t.MemPool)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", t.use_mem_pool)
    monkeypatch.setattr(torch.cuda, "graph", t.graph)
    monkeypatch.setattr(memory_saver, "pool_holds_asleep_memory_or",
                        lambda native, pool_id, unknown, what: pool_id[0] in t.asleep)
    return t


@pytest.fixture
def saver(fake) -> Iterator[TorchMemorySaver]:
    s = TorchMemorySaver()
    yield s
    s._release_region_pools()
    assert pool_activity._depth == 0


def test_a_pool_replaced_while_another_block_uses_it_is_destroyed_by_pool_activity(fake, saver):
    """Block A routes to pool 1; block B, entered meanwhile (another thread in a real run) while pool 1 holds
    paused memory, replaces it. When A ends, pool 1's last reference must not be A's frame: destroyed there, it
    would be destroyed after A's pool block ended, while another thread may route allocations."""
    a = saver._region_pool(None, KEY)
    a.__enter__()
    fake.asleep.add(1)
    b = saver._region_pool(None, KEY)
    b.__enter__()
    assert saver._region_pools[KEY].id == (2, 0), "pool 1 holds paused memory: replaced"
    b.__exit__(None, None, None)
    assert fake.destroyed == [], "block A still routes to pool 1"
    a.__exit__(None, None, None)
    assert fake.destroyed == [(1, True, False)], "destroyed by pool_activity, under its lock"


def test_a_pool_replaced_during_a_capture_is_destroyed_after_it(fake, saver, monkeypatch):
    """Preload mode: a region entered inside a capture replaces its pool holding paused memory; the old pool must
    outlive the capture (torch aborts on a pool destroyed while a capture is under way)."""
    sim = Allocator.simulated(devices=1, capacity=16 << 20, granularity=64 << 10)
    try:
        saver._alloc = SimulatedPools(sim)
        saver._preload = True
        monkeypatch.setattr(memory_saver._preload, "routed", lambda tag: contextlib.nullcontext())
        with saver._region_pool(None, KEY):
            pass
        fake.asleep.add(1)
        with saver.cuda_graph(object(), tag="lifetime_graph"):
            with saver._region_pool(None, KEY):
                pass
            assert fake.destroyed == [], "pool 1 destroyed during the capture"
        assert fake.destroyed == [(1, True, False)]
    finally:
        saver._alloc = None
        sim.close()
