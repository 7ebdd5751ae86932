"""`cumem_rs._pools.pool_block`, the one routed-pool block of `CuMemAllocator` and `cumem_rs.memory_saver`, over a
simulated allocator (the torch pools themselves need a GPU: tests/test_torch_cuda.py, test_memory_saver_cuda.py).

What must hold on every exit path: the tag pushed at entry is popped, the process-wide pool activity is left, and
the pools handed to the block are dropped only once no block is active (torch aborts when a pool dies while another
block routes allocations), with the block's own list emptied so that no frame keeps one alive.
"""

from __future__ import annotations

import gc
import weakref

import pytest

pytest.importorskip("torch")

from cumem_rs import ClosedError, CumemTypeError, CumemValueError  # noqa: E402
from cumem_rs._pools import check_tag, pool_activity, pool_block, tag_tuple  # noqa: E402


class Pool:
    """Stands in for a MemPool: only its lifetime is observed."""


def _alive(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is not None


def test_block_pushes_and_pops_the_tag(sim):
    with pool_block(sim, "weights") as retire:
        assert sim.current_tag() == "weights"
        assert retire == []
        with pool_block(sim, "kv_cache"):
            assert sim.current_tag() == "kv_cache"
        assert sim.current_tag() == "weights"
    assert sim.current_tag() == "default"


def test_pools_are_dropped_when_the_last_block_ends(sim):
    with pool_block(sim, "weights"):
        with pool_block(sim, "kv_cache") as inner:
            inner.append(Pool())
            ref = weakref.ref(inner[0])
        assert inner == [], "the block's list must be emptied at exit"
        assert _alive(ref), "a pool was dropped while another block was active"
    assert not _alive(ref), "the pool outlived the last block"


def test_block_without_tag(sim):
    with pool_block() as retire:
        retire.append(Pool())
        ref = weakref.ref(retire[0])
        assert sim.current_tag() == "default"
    assert not _alive(ref)


def test_failing_body_undoes_everything(sim):
    with pytest.raises(RuntimeError, match="body"):
        with pool_block(sim, "weights") as retire:
            retire.append(Pool())
            ref = weakref.ref(retire[0])
            raise RuntimeError("body")
    assert sim.current_tag() == "default"
    assert not _alive(ref)
    # The activity count is back at zero: a pool retired now is dropped at once.
    pools = [Pool()]
    ref = weakref.ref(pools[0])
    pool_activity.retire(pools)
    assert not _alive(ref)


def test_failing_push_leaves_the_activity(sim):
    sim.close()
    with pytest.raises(ClosedError):
        with pool_block(sim, "weights"):
            pytest.fail("the body ran without its tag")
    pools = [Pool()]
    ref = weakref.ref(pools[0])
    pool_activity.retire(pools)
    assert not _alive(ref), "a failed entry left the pool activity entered"


@pytest.mark.parametrize("bad,error", [(1, CumemTypeError), (None, CumemTypeError), ("", CumemValueError)])
def test_tag_checks(sim, bad, error):
    with pytest.raises(error, match="tag"):
        check_tag(bad)
    with pytest.raises(error, match="tag"):
        tag_tuple(["weights", bad], "tags")
    with pytest.raises(error, match="tag"):
        with pool_block(sim, bad):
            pytest.fail("entered with a bad tag")
    assert sim.current_tag() == "default"


def test_tag_tuple_shapes():
    assert tag_tuple("weights", "tags") == ("weights",)
    assert tag_tuple(["weights", "kv_cache"], "tags") == ("weights", "kv_cache")
    assert tag_tuple((), "tags") == ()
    with pytest.raises(CumemTypeError, match="offload_tags"):
        tag_tuple(b"weights", "offload_tags")
