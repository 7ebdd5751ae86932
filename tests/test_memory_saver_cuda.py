"""cumem_rs.memory_saver on a GPU: torch_memory_saver-style flows with real tensors, kernels and CUDA graphs.

Skipped unless torch sees a GPU and cumem_rs can load the CUDA driver. Each test uses its own tags (policies are
per tag and the allocator is process-wide) and a fresh TorchMemorySaver, except one that uses the module's
singleton; the autouse fixture wakes whatever a failing test left paused.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Optional

import pytest

torch = pytest.importorskip("torch")

import cumem_rs  # noqa: E402
from cumem_rs import CumemError, CumemOutOfMemoryError  # noqa: E402
from cumem_rs.memory_saver import TorchMemorySaver  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and cumem_rs.cuda_available()),
    reason="needs a CUDA GPU visible to both torch and cumem_rs",
)

from torch_support import _awake_between_tests, cumem  # noqa: E402,F401

MiB = 1 << 20


@pytest.fixture
def saver(cumem) -> Iterator[TorchMemorySaver]:
    """A fresh saver. Initialising one sets the process-wide keep_host_memory to its retain_cpu_backup (False,
    torch_memory_saver's default): restored afterwards, so that the other modules see the allocator's default."""
    keep = cumem.native.keep_host_memory()
    yield TorchMemorySaver()
    cumem.native.set_keep_host_memory(keep)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _tag_of(cumem, tensor) -> Optional[str]:
    """The tag of the cumem_rs allocation holding `tensor`, None when torch's own allocator holds it."""
    ptr = tensor.data_ptr()
    rows = [a for a in cumem.native.allocations() if a["address"] <= ptr < a["address"] + a["size"]]
    return rows[0]["tag"] if rows else None


def _state(cumem, tag: str) -> str:
    return cumem.status()["tags"][tag]["state"]


def _bytes(n: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen)


def _free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _warm_up(step) -> None:
    """Run `step` once on a side stream before capture, as torch recommends (cuBLAS workspaces, lazy init)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)


def test_pause_resume_with_and_without_cpu_backup(cumem, saver):
    n = 64 * MiB
    with saver.region(tag="tms_weights", enable_cpu_backup=True):
        w = _bytes(n, seed=1)
    with saver.region(tag="tms_kv"):
        kv = torch.full((n,), 7, dtype=torch.uint8, device="cuda")
    w_ref, ptrs = w.cpu(), (w.data_ptr(), kv.data_ptr())
    assert (_tag_of(cumem, w), _tag_of(cumem, kv)) == ("tms_weights", "tms_kv")

    free = _free_bytes()
    saver.pause()
    assert _free_bytes() - free >= 0.95 * 2 * n, "pause did not give the memory back to the device"
    tags = cumem.status()["tags"]
    assert tags["tms_weights"]["state"] == "asleep" and tags["tms_weights"]["backup_bytes"] >= n
    assert tags["tms_kv"]["state"] == "asleep" and tags["tms_kv"]["backup_bytes"] == 0
    backup = saver.get_cpu_backup(w)
    assert backup is not None and backup.device.type == "cpu" and torch.equal(backup, w_ref)
    assert torch.equal(saver.get_cpu_backup(w, zero_copy=True), w_ref)
    with pytest.raises(CumemError, match="without CPU backup"):
        saver.get_cpu_backup(kv)
    saver.pause()  # pausing what is paused: a no-op (torch_memory_saver exits the process here)

    saver.resume()
    assert (w.data_ptr(), kv.data_ptr()) == ptrs
    assert torch.equal(w.cpu(), w_ref)
    assert saver.get_cpu_backup(w) is None, "awake: no backup"
    kv.fill_(3)
    assert torch.all(kv == 3).item()
    saver.resume()  # resuming what is awake: a no-op


def test_nested_regions_tag_by_innermost_and_pause_separately(cumem, saver):
    with saver.region("tms_outer", enable_cpu_backup=True):
        a = torch.full((4 * MiB,), 1, dtype=torch.uint8, device="cuda")
        with saver.region("tms_inner", enable_cpu_backup=True):
            b = torch.full((4 * MiB,), 2, dtype=torch.uint8, device="cuda")
        c = torch.full((4 * MiB,), 3, dtype=torch.uint8, device="cuda")
    assert [_tag_of(cumem, t) for t in (a, b, c)] == ["tms_outer", "tms_inner", "tms_outer"]

    saver.pause("tms_inner")
    assert (_state(cumem, "tms_inner"), _state(cumem, "tms_outer")) == ("asleep", "awake")
    a.add_(1)  # the outer region keeps working
    c.add_(1)
    saver.resume("tms_inner")
    assert torch.all(a == 2).item() and torch.all(b == 2).item() and torch.all(c == 4).item()


def test_pause_one_tag_while_kernels_run_on_another(cumem, saver):
    gen = torch.Generator(device="cuda").manual_seed(3)
    with saver.region("tms_busy"):
        a = torch.randn(4096, 4096, device="cuda", generator=gen)
        b = torch.randn(4096, 4096, device="cuda", generator=gen)
        c = torch.zeros(4096, 4096, device="cuda")
    with saver.region("tms_idle", enable_cpu_backup=True):
        idle = _bytes(32 * MiB, seed=4)
    idle_ref = idle.cpu()
    expected = (a @ b).cpu()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(40):  # tens of milliseconds of queued work on the busy tag's memory
            torch.matmul(a, b, out=c)
    saver.pause("tms_idle")  # no synchronize by the caller
    assert (_state(cumem, "tms_busy"), _state(cumem, "tms_idle")) == ("awake", "asleep")
    with torch.cuda.stream(side):
        c.add_(1.0)  # more work on the running tag after the pause
    torch.cuda.synchronize()
    torch.testing.assert_close(c.cpu(), expected + 1.0)
    saver.resume("tms_idle")
    assert torch.equal(idle.cpu(), idle_ref)


def test_pause_right_after_queued_writes_backs_up_their_result(saver):
    with saver.region("tms_acc", enable_cpu_backup=True):
        acc = torch.zeros(16 * MiB, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")
    out = torch.empty_like(a)
    torch.cuda.synchronize()
    for _ in range(60):
        torch.matmul(a, a, out=out)
    for _ in range(10):
        acc.add_(1.0)
    saver.pause("tms_acc")  # the adds are still queued behind the matmuls
    saver.resume("tms_acc")
    assert torch.all(acc == 10.0).item(), "the backup was taken before the queued kernels finished"


def test_cuda_graph_capture_pause_resume_replay(cumem, saver):
    gen = torch.Generator(device="cuda").manual_seed(5)
    with saver.region("tms_graph_w", enable_cpu_backup=True):
        w = torch.randn(1024, 1024, device="cuda", generator=gen)
    x = torch.randn(1024, 1024, device="cuda", generator=gen)  # static input, in torch's own memory

    def step():
        return torch.relu(x @ w) * 2.0

    _warm_up(step)
    graph = torch.cuda.CUDAGraph()
    with saver.cuda_graph(cuda_graph=graph, tag="tms_graph"):
        out = step()
    assert _tag_of(cumem, out) == "tms_graph", "graph memory did not come from a pausable pool"
    graph.replay()
    torch.testing.assert_close(out, torch.relu(x @ w) * 2.0)

    saver.pause()
    assert (_state(cumem, "tms_graph"), _state(cumem, "tms_graph_w")) == ("asleep", "asleep")
    saver.resume()
    x.copy_(torch.randn(1024, 1024, device="cuda", generator=gen))
    graph.replay()
    torch.testing.assert_close(out, torch.relu(x @ w) * 2.0)
    del graph, out


def test_graphs_sharing_a_torch_pool_token_share_a_pausable_pool(cumem, saver):
    """SGLang captures every batch size into one `torch.cuda.graph_pool_handle()`: that token stands for one pool
    of ours, so the graphs still share memory and all of it pauses."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    with saver.region("tms_shared_w", enable_cpu_backup=True):
        w = torch.randn(512, 512, device="cuda", generator=gen)
    xs = [torch.randn(n, 512, device="cuda", generator=gen) for n in (64, 128)]
    token = torch.cuda.graph_pool_handle()
    graphs, outs = [], []
    for x in xs:
        _warm_up(lambda: x @ w)
        g = torch.cuda.CUDAGraph()
        with saver.cuda_graph(g, pool=token, tag="tms_shared_graphs"):
            outs.append(torch.tanh(x @ w))
        graphs.append(g)
    assert graphs[0].pool() == graphs[1].pool() != tuple(token)
    assert [_tag_of(cumem, o) for o in outs] == ["tms_shared_graphs"] * 2

    saver.pause()
    saver.resume()
    for g in graphs:  # in capture order, as graphs sharing a pool must be replayed
        g.replay()
    for x, o in zip(xs, outs):
        torch.testing.assert_close(o, torch.tanh(x @ w))
    del graphs, outs
    saver._release_graph_pools()  # leave no cached graph segments to later tests



def test_a_capture_into_a_shared_pool_holding_paused_memory_is_refused(cumem, saver):
    """A pool shared by token keeps its segments' free blocks, a paused tag's too: torch would hand them to the next
    capture into that pool unmapped (an illegal address at their first use, which ends the CUDA context). Refused
    while the tag is paused; after resume the capture shares the pool as before."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(256, 256, device="cuda", generator=gen)
    token = torch.cuda.graph_pool_handle()

    def step():
        return torch.tanh(x @ x) + 1.0  # the intermediate is freed during capture: a cached block in the pool

    _warm_up(step)
    first = torch.cuda.CUDAGraph()
    with saver.cuda_graph(first, pool=token, tag="tms_paused_pool"):
        out1 = step()
    saver.pause("tms_paused_pool")
    second = torch.cuda.CUDAGraph()
    with pytest.raises(CumemError, match="holds memory of a paused tag"):
        with saver.cuda_graph(second, pool=token, tag="tms_paused_pool"):
            step()
    torch.cuda.synchronize()  # nothing touched unmapped memory: the context is alive
    saver.resume("tms_paused_pool")
    with saver.cuda_graph(second, pool=token, tag="tms_paused_pool"):
        out2 = step()
    first.replay()  # in capture order, as graphs sharing a pool must be replayed
    second.replay()
    torch.testing.assert_close(out1, torch.tanh(x @ x) + 1.0)
    torch.testing.assert_close(out2, torch.tanh(x @ x) + 1.0)
    del first, second, out1, out2
    saver._release_graph_pools()

def test_disable_inside_a_region_allocates_from_torch(cumem, saver):
    with saver.region("tms_disable", enable_cpu_backup=True):
        a = torch.ones(MiB, device="cuda")
        with saver.disable():
            b = torch.full((MiB,), 5.0, device="cuda")
        c = torch.ones(MiB, device="cuda")
    assert [_tag_of(cumem, t) for t in (a, b, c)] == ["tms_disable", None, "tms_disable"]
    saver.pause("tms_disable")
    b.add_(1.0)  # torch's memory keeps working while the region's is paused
    assert torch.all(b == 6.0).item()
    saver.resume("tms_disable")
    assert torch.all(a == 1.0).item() and torch.all(c == 1.0).item()


def test_zero_wake_fill_is_visible_to_torch(cumem, saver):
    cumem.set_tag_policy("tms_zero_kv", wake_fill="zero")  # set ahead; the region keeps it
    with saver.region("tms_zero_kv"):
        kv = torch.full((16 * MiB,), 9, dtype=torch.uint8, device="cuda")
    policy = cumem.native.tag_policy("tms_zero_kv")
    assert (policy["backup"], policy["wake_fill"]) == (False, "zero")
    saver.pause("tms_zero_kv")
    saver.resume("tms_zero_kv")
    assert torch.count_nonzero(kv).item() == 0, "memory woken without backup is not zero"

    # The same through CuMemAllocator: discard, then wake.
    cumem.set_tag_policy("tms_zero_pool", wake_fill="zero")
    with cumem.use_memory_pool("tms_zero_pool"):
        t = torch.full((8 * MiB,), 4, dtype=torch.uint8, device="cuda")
    cumem.discard("tms_zero_pool")
    report = cumem.wake_up()
    assert report["zeroed_bytes"] >= 8 * MiB
    assert torch.count_nonzero(t).item() == 0


def test_memory_margin_refuses_resume_and_maps_nothing(cumem, saver):
    with saver.region("tms_margin", enable_cpu_backup=True):
        t = _bytes(32 * MiB, seed=7)
    ref = t.cpu()
    saver.pause("tms_margin")
    mapped = cumem.native.usage()
    saver.memory_margin_bytes = torch.cuda.mem_get_info()[1]  # more than the device has: never satisfiable
    with pytest.raises(CumemOutOfMemoryError, match="memory_margin_bytes"):
        saver.resume("tms_margin")
    assert _state(cumem, "tms_margin") == "asleep" and cumem.native.usage() == mapped
    saver.memory_margin_bytes = 0
    saver.resume("tms_margin")
    assert torch.equal(t.cpu(), ref)


def test_retain_cpu_backup_is_keep_host_memory(cumem, saver):
    assert saver.retain_cpu_backup is False, "off by default, as in torch_memory_saver"
    assert cumem.native.keep_host_memory() is False
    with saver.region("tms_retain", enable_cpu_backup=True):
        t = _bytes(16 * MiB, seed=8)
    ref = t.cpu()
    saver.pause("tms_retain")
    assert cumem.native.host_bytes() >= 16 * MiB
    saver.resume("tms_retain")
    assert cumem.native.host_bytes() == 0, "host backup memory kept although retain_cpu_backup is False"
    assert saver.get_cpu_backup(t) is None

    saver.retain_cpu_backup = True  # retained backups: the next pause of unchanged memory copies nothing
    assert cumem.native.keep_host_memory() is True
    saver.pause("tms_retain")
    saver.resume("tms_retain")
    report = cumem.native.pause("tms_retain")
    assert (report["copied_bytes"], report["skipped_bytes"]) == (0, 16 * MiB)
    saver.resume("tms_retain")
    assert torch.equal(t.cpu(), ref)
    del t


@pytest.mark.parametrize("backend", ["pinned", "mmap"])
def test_resume_returns_the_cpu_backup_to_the_os(cumem, saver, backend):
    """torch_memory_saver's test_cpu_backup_rss: RSS grows by the paused bytes at pause and drops by them at a
    resume that does not retain the backup (both backends are mmap'd memory here, unmapped when released)."""
    n, tolerance = 2 << 30, 256 * MiB
    cumem.native.trim_host()  # no cached arena from earlier tests in the figures
    with saver.region(f"tms_rss_{backend}", enable_cpu_backup=True, cpu_backup_backend=backend):
        t = torch.full((n,), 7, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    rss_alloc = _rss_bytes()
    saver.pause(f"tms_rss_{backend}")
    rss_pause = _rss_bytes()
    saver.resume(f"tms_rss_{backend}")
    rss_resume = _rss_bytes()
    assert int(t[0].item()) == 7 and int(t[-1].item()) == 7
    assert rss_pause - rss_alloc >= n - tolerance, rss_pause - rss_alloc
    assert rss_resume - rss_pause <= -(n - tolerance), rss_resume - rss_pause
    del t


def test_disk_backup_restores_bit_identical_data(cumem, saver, tmp_path):
    saver.set_disk_backup_dir(str(tmp_path))
    try:
        with saver.region("tms_disk", enable_disk_backup=True):
            big = torch.randn((1 << 20) * 13 // 4 + 12345, device="cuda")
        with saver.region("tms_disk_none"):
            none = torch.full((20 * MiB,), 20, dtype=torch.uint8, device="cuda")
        ref = big.cpu()
        for _ in range(3):
            saver.pause()
            assert cumem.native.stats()["file_tier_bytes"] >= big.numel() * 4
            saver.resume()
            assert torch.equal(big.cpu(), ref)
        del big, none
        assert os.listdir(tmp_path) == [], "backup files are unlinked at creation"
    finally:
        cumem.set_spill_dir(None)  # the spill directory is process-wide: leave none to later tests


def test_get_cpu_backup_refuses_what_is_not_a_region(saver):
    with saver.region("tms_backup_read", enable_cpu_backup=True):
        t = torch.arange(1024, dtype=torch.float32, device="cuda").reshape(32, 32)
    outside = torch.zeros(1024, device="cuda")
    with pytest.raises(ValueError, match="not memory of a region"):
        saver.get_cpu_backup(outside)
    with pytest.raises(ValueError, match="contiguous"):
        saver.get_cpu_backup(t.t())
    saver.pause("tms_backup_read")
    backup = saver.get_cpu_backup(t[4:8])
    assert backup is not None and backup.dtype == torch.float32 and backup.shape == (4, 32)
    assert torch.equal(backup, torch.arange(128, 256, dtype=torch.float32).reshape(4, 32))
    saver.resume("tms_backup_read")


def test_one_tag_with_and_without_backup(saver):
    """As torch_memory_saver's test_cpu_backup: both settings under one tag, paused and resumed together."""
    with saver.region("tms_mixed", enable_cpu_backup=True):
        kept = torch.full((8 * MiB,), 10, dtype=torch.uint8, device="cuda")
    with saver.region("tms_mixed", enable_cpu_backup=False):
        lost = torch.full((8 * MiB,), 20, dtype=torch.uint8, device="cuda")
    saver.pause("tms_mixed")
    saver.resume("tms_mixed")
    assert torch.all(kept == 10).item()
    lost.fill_(30)  # undefined after resume; usable again
    assert torch.all(lost == 30).item()


def test_module_singleton_and_status_repr(cumem):
    from cumem_rs.memory_saver import torch_memory_saver

    keep = cumem.native.keep_host_memory()  # the singleton's set-up sets it process-wide: put back below
    try:
        with torch_memory_saver.region(tag="tms_singleton", enable_cpu_backup=True):
            t = torch.full((4 * MiB,), 1.5, device="cuda")
        torch_memory_saver.pause("tms_singleton")
        line = repr(cumem)
        assert "sleeping" in line and "tms_singleton=asleep[backup=True]" in line and "\n" not in line
        torch_memory_saver.resume("tms_singleton")
        assert torch.all(t == 1.5).item()
    finally:
        cumem.native.set_keep_host_memory(keep)
