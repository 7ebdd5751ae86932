"""CuMemAllocator with real torch tensors on a GPU: routing, sleep/wake, CUDA graphs, out of memory, trimming, exit.

Skipped unless torch sees a GPU and cumem_rs can load the CUDA driver. Sizes stay at a few hundred MiB; the file
takes well under two minutes on an H200. The allocator is process-wide, so every test starts from settled torch
caches and leaves nothing asleep (the autouse fixture wakes whatever a failing test left behind).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
from typing import Optional

import pytest

torch = pytest.importorskip("torch")

import cumem_rs  # noqa: E402
from cumem_rs import CumemError  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and cumem_rs.cuda_available()),
    reason="needs a CUDA GPU visible to both torch and cumem_rs",
)

MiB = 1 << 20


from torch_support import _awake_between_tests, cumem, settle as _settle, sleep_and_wake  # noqa: E402,F401


def _record(cumem, tensor) -> Optional[dict]:
    """The core allocator's record of the allocation holding `tensor`, or None when torch's own pool holds it."""
    ptr = tensor.data_ptr()
    for a in cumem.native.allocations():
        if a["address"] <= ptr < a["address"] + a["size"]:
            return a
    return None


def _random_bytes(nbytes: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(generator=gen)


def _copied_bytes(report: dict) -> int:
    # Backed up = copied now + skipped as unchanged since the last wake (retained backups).
    return int(report["copied_bytes"] + report["skipped_bytes"])


def _free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


# --- routing -------------------------------------------------------------------------------------------------------


def test_pool_and_default_tensors_compute_together(cumem):
    gen = torch.Generator(device="cuda").manual_seed(0)
    with cumem.use_memory_pool():
        assert cumem.current_tag == "default"
        a = torch.randn(512, 512, device="cuda", dtype=torch.float64, generator=gen)
    b = torch.randn(512, 512, device="cuda", dtype=torch.float64, generator=gen)
    rec = _record(cumem, a)
    assert rec is not None and rec["tag"] == "default" and not rec["asleep"]
    assert _record(cumem, b) is None, "a tensor made outside the block came from our pool"

    c = a @ b + a
    expected = a.cpu() @ b.cpu() + a.cpu()
    torch.testing.assert_close(c.cpu(), expected)


def test_nested_pools_tag_by_innermost(cumem):
    with cumem.use_memory_pool("weights"):
        w = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        with cumem.use_memory_pool("kv_cache"):
            assert cumem.current_tag == "kv_cache"
            kv = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
        assert cumem.current_tag == "weights"
        w2 = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
    assert cumem.current_tag == "default"
    assert [_record(cumem, t)["tag"] for t in (w, kv, w2)] == ["weights", "kv_cache", "weights"]


def test_pool_is_per_thread(cumem):
    """torch routes only the entering thread's allocations to the pool; another thread's stay in torch's, or go
    to that thread's own block. A block ending while another thread's is active must not release its pool yet
    (torch aborts the process when a pool is released while another routes allocations)."""
    made = {}

    def other_thread():
        made["plain"] = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
        with cumem.use_memory_pool("kv_cache"):
            made["kv"] = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
            temp = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
            del temp  # leaves an unused segment for the pool release to return

    with cumem.use_memory_pool("weights"):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        mine = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
    assert _record(cumem, made["plain"]) is None
    assert _record(cumem, made["kv"])["tag"] == "kv_cache"
    assert _record(cumem, mine)["tag"] == "weights"
    # Both pools were released when the last block ended: the freed temporary's segment went back.
    assert all(not (a["tag"] == "kv_cache" and a["size"] == 32 * MiB) for a in cumem.native.allocations())


def test_tag_validation(cumem):
    with pytest.raises(TypeError):
        with cumem.use_memory_pool(3):
            pass
    with pytest.raises(ValueError):
        with cumem.use_memory_pool(""):
            pass
    with pytest.raises(TypeError):
        cumem.sleep(offload_tags=[b"weights"])
    with pytest.raises(ValueError):
        cumem.wake_up(tags=["weights", ""])
    with pytest.raises(TypeError):
        cumem.discard(5)
    # Nothing was pushed, put to sleep or left half done by the rejected calls.
    assert cumem.current_tag == "default"
    assert not any(a["asleep"] for a in cumem.native.allocations())


# --- sleep / wake ----------------------------------------------------------------------------------------------------


def test_sleep_frees_memory_and_wake_restores_bits(cumem, caplog):
    n = 256 * MiB
    with cumem.use_memory_pool("weights"):
        x = _random_bytes(n, seed=1)
    ref = x.cpu()
    ptr = x.data_ptr()
    usage = cumem.get_current_usage()
    mapped = cumem.native.usage()

    free_before = _free_bytes()
    with caplog.at_level(logging.INFO, logger="cumem_rs"):
        report = cumem.sleep(offload_tags="weights")
    free_asleep = _free_bytes()
    assert free_asleep - free_before >= 0.95 * n, "sleep did not give the pool's memory back to the driver"
    assert _copied_bytes(report) >= n
    assert cumem.native.usage() <= mapped - n
    assert cumem.get_current_usage() == usage, "asleep allocations still count as in use (as upstream)"
    rec = _record(cumem, x)
    assert rec["asleep"] and rec["backed_up"]
    assert any("sleep" in r.getMessage() and "GB/s" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.INFO, logger="cumem_rs"):
        cumem.wake_up()
    assert free_asleep - _free_bytes() >= 0.95 * n
    assert x.data_ptr() == ptr
    assert torch.equal(x.cpu(), ref), "woken contents differ from what was put to sleep"
    assert any("wake_up" in r.getMessage() and "GB/s" in r.getMessage() for r in caplog.records)


def test_sleep_without_tags_offloads_default_only(cumem):
    with cumem.use_memory_pool():
        d = _random_bytes(8 * MiB, seed=2)
    with cumem.use_memory_pool("weights"):
        w = _random_bytes(8 * MiB, seed=3)
    d_ref = d.cpu()
    cumem.sleep()
    assert _record(cumem, d)["backed_up"]
    assert _record(cumem, w)["asleep"] and not _record(cumem, w)["backed_up"]
    cumem.wake_up()
    assert torch.equal(d.cpu(), d_ref)


@pytest.mark.parametrize("layer", ["torch", "core"])
def test_sleep_right_after_queued_kernels_keeps_data(cumem, layer):
    """The last writes are queued behind ~100 ms of matmuls when sleep is called: the backup must wait for them."""
    with cumem.use_memory_pool("weights"):
        acc = torch.zeros(64 * MiB // 4, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(4096, 4096, device="cuda")
    c = torch.empty_like(a)
    torch.cuda.synchronize()
    for _ in range(60):
        torch.matmul(a, b, out=c)  # ~2 ms each in fp32 on an H200: keeps the stream busy
    for _ in range(10):
        acc.add_(1.0)
    # No synchronize here on purpose.
    sleep_and_wake(cumem, layer)
    assert torch.all(acc == 10.0).item(), "the backup was taken before the queued kernels finished"


def test_selective_wake_then_discard(cumem):
    n = 32 * MiB
    with cumem.use_memory_pool("weights"):
        w = _random_bytes(n, seed=4)
    with cumem.use_memory_pool("kv_cache"):
        kv = _random_bytes(n, seed=5)
    w_ref, kv_ref = w.cpu(), kv.cpu()

    cumem.sleep(offload_tags=("weights", "kv_cache"))
    cumem.wake_up(["weights"])
    assert not _record(cumem, w)["asleep"] and _record(cumem, kv)["asleep"]
    assert torch.equal(w.cpu(), w_ref)
    cumem.wake_up(["kv_cache"])
    assert not _record(cumem, kv)["asleep"]
    assert torch.equal(kv.cpu(), kv_ref)

    mapped = cumem.native.usage()
    cumem.discard("kv_cache")
    rec = _record(cumem, kv)
    assert rec["asleep"] and not rec["backed_up"]
    assert not _record(cumem, w)["asleep"], "discard touched another tag"
    assert cumem.native.usage() <= mapped - n
    assert torch.equal(w.cpu(), w_ref)

    cumem.wake_up(["kv_cache"])
    assert not _record(cumem, kv)["asleep"]
    kv.fill_(7)  # the discarded tensor is usable again at the same address
    assert torch.all(kv == 7).item()


def test_non_deferrable_tags_always_wake(cumem):
    n = 8 * MiB
    with cumem.use_memory_pool():
        d = _random_bytes(n, seed=6)
    with cumem.use_memory_pool("scratch"):
        s = _random_bytes(n, seed=7)
    with cumem.use_memory_pool("weights"):
        w = _random_bytes(n, seed=8)
    with cumem.use_memory_pool("kv_cache"):
        kv = _random_bytes(n, seed=9)
    d_ref, w_ref = d.cpu(), w.cpu()

    cumem.sleep(offload_tags=("default", "weights"))
    cumem.wake_up(tags=["weights"])
    assert not _record(cumem, d)["asleep"], "'default' is not deferrable and must wake with any wake_up"
    assert not _record(cumem, s)["asleep"], "custom tags are not deferrable either"
    assert not _record(cumem, w)["asleep"]
    assert _record(cumem, kv)["asleep"], "kv_cache was not asked for and is deferrable"
    assert torch.equal(d.cpu(), d_ref) and torch.equal(w.cpu(), w_ref)

    cumem.wake_up(tags=[])
    assert _record(cumem, kv)["asleep"]
    cumem.wake_up()
    assert not _record(cumem, kv)["asleep"]


# --- CUDA graphs ---------------------------------------------------------------------------------------------------


def test_cuda_graph_replays_after_sleep_and_wake(cumem):
    gen = torch.Generator(device="cuda").manual_seed(10)
    with cumem.use_memory_pool("weights"):
        w = torch.randn(1024, 1024, device="cuda", generator=gen)
    with cumem.use_memory_pool("kv_cache"):
        cache = torch.zeros(1024, 1024, device="cuda")
    x = torch.randn(1024, 1024, device="cuda", generator=gen)  # static input, in torch's own pool
    w_ref = w.clone()

    def step():
        return torch.relu(x @ w) + cache

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture, as torch recommends
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with cumem.cudagraph_pool() as pool_id:
        with torch.cuda.graph(graph, pool=pool_id):
            out = step()
    rec = _record(cumem, out)
    assert rec is not None and rec["tag"] == "cudagraph", "graph memory did not come from our pool"

    cache.fill_(1.0)
    graph.replay()
    torch.testing.assert_close(out, torch.relu(x @ w_ref) + 1.0)

    cumem.sleep(offload_tags="weights")
    assert _record(cumem, w)["backed_up"]
    assert not _record(cumem, cache)["backed_up"] and not _record(cumem, out)["backed_up"]
    cumem.wake_up()
    assert torch.equal(w, w_ref), "weights changed across sleep/wake"

    cache.fill_(2.0)  # the cache was discarded: refill it before replaying
    x.copy_(torch.randn(1024, 1024, device="cuda", generator=gen))
    graph.replay()
    torch.testing.assert_close(out, torch.relu(x @ w_ref) + 2.0)
    del graph
    cumem.release_pools()


# --- out of memory ---------------------------------------------------------------------------------------------------


def _hog_free_memory(leave: int):
    """A plain torch tensor over all free device memory but about `leave` bytes."""
    size = _free_bytes() - leave
    while size > 0:
        try:
            return torch.empty(size, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError:
            size -= 256 * MiB
    pytest.fail("could not allocate the free device memory")


def test_wake_out_of_memory_raises_then_succeeds_later(cumem):
    n = 256 * MiB
    with cumem.use_memory_pool("weights"):
        w = _random_bytes(n, seed=11)
    ref = w.cpu()
    ptr = w.data_ptr()
    cumem.sleep(offload_tags="weights")

    hog = _hog_free_memory(leave=n // 4)
    try:
        if _free_bytes() >= n:
            pytest.skip("could not fill the device: something else frees memory")
        with pytest.raises(RuntimeError) as info:
            cumem.wake_up()
        assert isinstance(info.value, CumemError)
        rec = _record(cumem, w)
        assert rec["asleep"] and rec["backed_up"], "a failed wake must leave the allocation asleep with its backup"
    finally:
        del hog
        torch.cuda.empty_cache()

    cumem.wake_up()
    assert w.data_ptr() == ptr
    assert torch.equal(w.cpu(), ref)


# --- trimming ---------------------------------------------------------------------------------------------------------


def test_pool_trims_unused_segments_and_releases_dead_tensors(cumem):
    usage0 = cumem.get_current_usage()
    errors0 = len(cumem.native.errors())
    keep_bytes, temp_bytes = 64 * MiB, 128 * MiB  # large allocations: one segment each, sized exactly
    with cumem.use_memory_pool("weights"):
        keep = torch.empty(keep_bytes, dtype=torch.uint8, device="cuda")
        temp = torch.empty(temp_bytes, dtype=torch.uint8, device="cuda")
        assert cumem.get_current_usage() >= usage0 + keep_bytes + temp_bytes
        del temp  # torch caches the freed segment in the pool: no my_free yet
    # The block exited: its pool was dropped and the unused segment went back through my_free.
    assert cumem.get_current_usage() == usage0 + keep_bytes
    del keep
    torch.cuda.empty_cache()
    assert cumem.get_current_usage() == usage0, "the dead tensor's segment was not returned"
    assert cumem.native.errors()[errors0:] == [], "torch freed something the core allocator did not know"


# Runs in a fresh process: expandable segments must be on from the start (environment), as users set them.
_EXPANDABLE_SCRIPT = textwrap.dedent(
    """
    import os, torch
    from cumem_rs import CuMemAllocator

    def segment_of(t):
        p = t.data_ptr()
        return next(s for s in torch.cuda.memory_snapshot() if s["address"] <= p < s["address"] + s["total_size"])

    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    alloc = CuMemAllocator.get_instance()
    before = torch.ones(4 << 20, device="cuda")
    assert segment_of(before)["is_expandable"], "the environment did not turn expandable segments on"
    with alloc.use_memory_pool("weights"):
        t = torch.ones(4 << 20, device="cuda")  # torch refuses MemPool allocations with expandable segments on
        inside = get() if get else None
    assert alloc.native.allocations() and any(
        a["address"] <= t.data_ptr() < a["address"] + a["size"] and a["tag"] == "weights"
        for a in alloc.native.allocations()
    )
    after = torch.ones(4 << 20, device="cuda")
    assert segment_of(after)["is_expandable"], "expandable segments were not switched back on"
    if get is not None:
        assert "expandable_segments:False" in inside and "max_split_size_mb:4096" in inside, inside
        assert get() == os.environ["PYTORCH_CUDA_ALLOC_CONF"], get()
    assert torch.all(t == 1).item()
    print("expandable-ok")
    """
)


def test_expandable_segments_off_inside_pool_and_restored_after():
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True,max_split_size_mb:4096")
    env.pop("PYTORCH_ALLOC_CONF", None)
    proc = subprocess.run(
        [sys.executable, "-c", _EXPANDABLE_SCRIPT], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "expandable-ok" in proc.stdout


# --- process exit ----------------------------------------------------------------------------------------------------

_EXIT_SCRIPT = textwrap.dedent(
    """
    import torch
    from cumem_rs import CuMemAllocator

    alloc = CuMemAllocator.get_instance()
    with alloc.use_memory_pool("weights"):
        w = torch.randn(2048, 2048, device="cuda")
    with alloc.use_memory_pool("kv_cache"):
        kv = torch.zeros(2048, 2048, device="cuda")
    x = torch.randn(2048, 2048, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x @ w + kv
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with alloc.cudagraph_pool() as pool:
        with torch.cuda.graph(graph, pool=pool):
            out = x @ w + kv
    graph.replay()
    alloc.sleep(offload_tags="weights")
    print("exiting-asleep", flush=True)
    # Exit with live tensors, a live graph, held pools and asleep memory.
    """
)


def test_process_exits_cleanly_with_live_pools_and_asleep_memory():
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "exiting-asleep" in proc.stdout
    for bad in ("terminate called", "pure virtual", "Segmentation fault", "Traceback"):
        assert bad not in proc.stderr, proc.stderr


def test_cudagraph_pool_holding_memory_that_sleeps_is_refused_until_it_wakes(cumem):
    """The graph pool is shared by every capture of its tag and keeps its segments' free blocks: after a sleep
    (the graph tag is discarded, asleep) torch would hand a new capture those blocks unmapped, and their first use
    would end the CUDA context. The block is refused while they sleep; after the wake it serves as before."""
    x = torch.randn(512, 512, device="cuda")

    def step():
        return torch.tanh(x @ x) * 2.0  # the intermediate is freed during capture: a cached block in the pool

    step()
    torch.cuda.synchronize()
    first = torch.cuda.CUDAGraph()
    with cumem.cudagraph_pool("graph_asleep") as pool_id:
        with torch.cuda.graph(first, pool=pool_id):
            out = step()
    cumem.sleep(offload_tags=())
    second = torch.cuda.CUDAGraph()
    with pytest.raises(CumemError, match="wake 'graph_asleep' first"):
        with cumem.cudagraph_pool("graph_asleep") as pool_id:
            with torch.cuda.graph(second, pool=pool_id):
                step()
    torch.cuda.synchronize()  # nothing touched unmapped memory: the context is alive
    cumem.wake_up()
    with cumem.cudagraph_pool("graph_asleep") as pool_id:
        with torch.cuda.graph(second, pool=pool_id):
            out2 = step()
    first.replay()
    second.replay()
    torch.testing.assert_close(out, torch.tanh(x @ x) * 2.0)
    torch.testing.assert_close(out2, torch.tanh(x @ x) * 2.0)
    del first, second, out, out2
    cumem.release_pools()
