"""`get_cpu_backup(zero_copy=True)`: a tensor whose storage is the raw host backup itself.

On the simulated device the saver runs over `SimulatedPools` (see test_memory_saver_sim.py) and a paused
allocation is an address, not a CUDA tensor, so these tests call `_cpu_backup`, the body of `get_cpu_backup`
below its tensor checks. The CUDA tests at the end go through `get_cpu_backup` with real tensors, in both hook
modes (preload in a child process started inside `configure_subprocess()`); they skip without a GPU.
"""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import textwrap
from typing import Iterator

import pytest

torch = pytest.importorskip("torch")

import cumem_rs  # noqa: E402
from cumem_rs import Allocator, CumemError, CumemOutOfMemoryError, CumemValueError  # noqa: E402
from cumem_rs._sim_pools import SimulatedPools  # noqa: E402
from cumem_rs.memory_saver import TorchMemorySaver, configure_subprocess  # noqa: E402

MiB = 1 << 20
GRAN = 64 << 10
N = 4 * MiB


@pytest.fixture(autouse=True)
def _no_tms_env(monkeypatch):
    for name in [k for k in os.environ if k.startswith("TMS_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def sim() -> Iterator[Allocator]:
    a = Allocator.simulated(devices=1, capacity=64 * MiB, granularity=GRAN)
    try:
        yield a
    finally:
        a.close()


@pytest.fixture
def saver(sim) -> TorchMemorySaver:
    return TorchMemorySaver(_backend=SimulatedPools(sim))


def _alloc(saver: TorchMemorySaver, sim: Allocator, tag: str, data: bytes, **region) -> int:
    with saver.region(tag, **region):
        address = sim.malloc(len(data))
    sim.write(address, data)
    return address


def _pattern(n: int, offset: int) -> bytes:
    return bytes((i + offset) % 251 for i in range(251)) * (n // 251) + bytes(n % 251)


def _view(saver: TorchMemorySaver, address: int, nbytes: int = N, dtype=torch.uint8) -> "torch.Tensor":
    shape = (nbytes // torch.empty((), dtype=dtype).element_size(),)
    return saver._cpu_backup(address, nbytes, dtype, shape, True)


def _copy(saver: TorchMemorySaver, address: int, nbytes: int = N):
    return saver._cpu_backup(address, nbytes, torch.uint8, (nbytes,), False)


def _asleep(sim: Allocator, address: int) -> bool:
    return next(r["asleep"] for r in sim.allocations() if r["address"] == address)


def _bytes_of(t: "torch.Tensor") -> bytes:
    """The bytes of CPU tensor `t`, read where they lie."""
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def test_a_view_is_the_backup_itself_at_the_same_address_across_a_retained_resume(saver, sim):
    data = _pattern(N, 3)
    w = _alloc(saver, sim, "w", data, enable_cpu_backup=True)
    saver.pause()
    first = _view(saver, w)
    first_ptr = first.data_ptr()
    assert _bytes_of(first) == data
    assert first_ptr == sim.view_backup(w, N).address, "the tensor's storage is the backup's host memory"
    assert first_ptr == _view(saver, w).data_ptr(), "every view of a backup that stays put has its address"
    saver.retain_cpu_backup = True
    del first
    saver.resume()
    after = _view(saver, w)
    assert after.data_ptr() == first_ptr, "a retained resume keeps the backup where it was"
    assert _bytes_of(after) == data and sim.read(w, N) == data
    del after
    saver.retain_cpu_backup = False
    saver.pause()
    saver.resume()
    assert _view(saver, w) is None and _copy(saver, w) is None, "released after a resume that did not retain"
    assert sim.host_bytes() == 0 and sim.read(w, N) == data


def test_a_retained_backup_is_updated_in_place_when_chunks_changed(saver, sim):
    """torch_memory_saver's sequence: retain off while awake still shows the retained backup; changed data paused
    again lands at the same address; retained again; released by a resume without retain."""
    first_data = _pattern(N, 40)
    w = _alloc(saver, sim, "sel", first_data, enable_cpu_backup=True)
    other = _alloc(saver, sim, "other", _pattern(N, 80), enable_cpu_backup=True)
    saver.pause("sel")
    ptr = _view(saver, w).data_ptr()
    saver.retain_cpu_backup = True
    saver.resume("sel")
    assert _view(saver, w).data_ptr() == ptr
    saver.retain_cpu_backup = False
    assert saver.retain_cpu_backup is False
    kept = _view(saver, w)
    assert kept.data_ptr() == ptr and _bytes_of(kept) == first_data, "False takes effect at the next resume"
    del kept
    for offset, retain in ((50, True), (60, False)):
        new = _pattern(N, offset)
        sim.write(w, new)
        report = sim.pause("sel")  # the saver's pause is this call; here for its report
        assert report["copied_bytes"] == N, "a viewed backup is copied whole (a write through a view is seen)"
        paused = _view(saver, w)
        assert paused.data_ptr() == ptr, "changed chunks are copied into the same host bytes"
        assert _bytes_of(paused) == new
        saver.retain_cpu_backup = retain
        del paused
        saver.resume("sel")
        assert sim.read(w, N) == new
        if retain:
            retained = _view(saver, w)
            assert retained.data_ptr() == ptr and _bytes_of(retained) == new
            del retained
    assert _view(saver, w) is None and _copy(saver, w) is None
    assert sim.read(other, N) == _pattern(N, 80), "the other tag was never paused"


@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies
def test_a_wake_that_retains_binds_a_backup_slept_without_prints():
    """Host memory kept only after the sleep (retain_cpu_backup set while paused): the wake still retains the
    backup, where it is, and the next sleep, with no prints to compare, copies it whole into it."""
    a = Allocator.simulated(devices=1, capacity=64 * MiB, granularity=GRAN)
    try:
        a.set_keep_host_memory(False)
        w = a.malloc(N)
        a.write(w, _pattern(N, 4))
        a.sleep("default")
        where = a.view_backup(w, N, False).address
        a.set_keep_host_memory(True)
        a.wake_up(None)
        assert a.stats()["retained_allocations"] == 1
        assert a.view_backup(w, N, False).address == where
        a.write(w, b"\x01")
        first = a.sleep("default")
        assert (first["copied_bytes"], first["skipped_bytes"]) == (N, 0), "no prints: copied whole"
        assert a.view_backup(w, N, False).address == where, "into the same host bytes"
        a.wake_up(None)
        second = a.sleep("default")
        assert (second["copied_bytes"], second["skipped_bytes"]) == (0, N), "prints now: nothing changed"
        a.wake_up(None)
        assert a.read(w, 2) == b"\x01" + _pattern(N, 4)[1:2]
    finally:
        a.close()


def test_an_unviewed_retained_backup_copies_only_what_changed(saver, sim):
    saver.retain_cpu_backup = True
    w = _alloc(saver, sim, "w", _pattern(N, 1), enable_cpu_backup=True)
    saver.pause("w")
    saver.resume("w")  # retained, with the prints of that pause
    copied = _copy(saver, w)  # a copy of the retained backup while awake: no writable view is handed out
    assert _bytes_of(copied) == _pattern(N, 1)
    report = sim.pause("w")
    assert (report["copied_bytes"], report["skipped_bytes"]) == (0, N), "a copy does not force a full copy"
    saver.resume("w")


def test_a_write_through_a_view_of_a_retained_backup_never_outlives_the_next_pause(saver, sim):
    """Written into while awake, a retained backup differs from the device behind the fingerprints' back: the
    next pause must copy the device's bytes over it, or the resume after it would restore the write."""
    saver.retain_cpu_backup = True
    data = _pattern(N, 7)
    w = _alloc(saver, sim, "w", data, enable_cpu_backup=True)
    for _ in range(2):  # the second round has prints: an unchanged device would copy nothing
        saver.pause("w")
        saver.resume("w")
    view = _view(saver, w)
    view[:GRAN] = 0xEE  # the device still holds `data`
    del view
    report = sim.pause("w")
    assert report["copied_bytes"] == N, "the viewed allocation was not copied whole"
    saver.resume("w")
    assert sim.read(w, N) == data, "the resume restored a write made into the backup"
    again = sim.pause("w")
    assert again["copied_bytes"] == 0, "no view since the last pause: unchanged chunks are skipped again"
    saver.resume("w")


def test_a_view_outlives_its_backup_the_allocation_and_the_allocator():
    sim = Allocator.simulated(devices=1, capacity=64 * MiB, granularity=GRAN)
    saver = TorchMemorySaver(_backend=SimulatedPools(sim))
    data = _pattern(N, 9)
    w = _alloc(saver, sim, "w", data, enable_cpu_backup=True)
    saver.pause()
    old = _view(saver, w, dtype=torch.float32)
    assert old.dtype == torch.float32 and old.shape == (N // 4,)
    saver.resume()  # without retain: the backup is released, the view keeps its bytes
    assert sim.host_bytes() == 0, "memory only a view holds is the view's, outside the allocator's accounting"
    sim.write(w, _pattern(N, 10))
    saver.pause()  # a new backup: never in the bytes the view shows
    saver.resume()
    assert _bytes_of(old) == data, "the view shows the bytes as they were"
    saver.pause()
    paused = _view(saver, w)
    sim.free(w)  # freed while paused: its backup goes
    sim.close()
    assert _bytes_of(paused[:251]) == _pattern(N, 10)[:251] and _bytes_of(old) == data
    del old, paused
    gc.collect()  # the last holders go: the arenas are unpinned and unmapped, no crash


def test_views_of_live_bytes_are_not_reused_under_a_host_budget(sim):
    """Under a host budget a pause reuses the holes that wakes left in an arena in use; a hole that a view still
    shows is not one."""
    saver = TorchMemorySaver(_backend=SimulatedPools(sim))
    a = _alloc(saver, sim, "a", _pattern(N, 1), enable_cpu_backup=True)
    b = _alloc(saver, sim, "b", _pattern(N, 2), enable_cpu_backup=True)
    saver.pause()  # one arena holds both backups
    sim.set_host_budget(sim.host_bytes())
    view = _view(saver, a)
    saver.resume("a")  # a's bytes become a hole of the arena b's backup keeps
    sim.write(a, _pattern(N, 3))
    host = sim.host_bytes()
    with pytest.raises(CumemOutOfMemoryError, match="host budget"):
        saver.pause("a")  # no room for a new arena and no hole: refused (nothing changes)
    assert not _asleep(sim, a) and _asleep(sim, b), "the refused pause left a awake, b paused"
    assert sim.read(a, N) == _pattern(N, 3) and sim.host_bytes() == host
    assert _bytes_of(view) == _pattern(N, 1), "a pause wrote into bytes a live view shows"
    del view
    gc.collect()
    saver.pause("a")  # the hole is free again
    assert _bytes_of(_view(saver, a)) == _pattern(N, 3)
    saver.resume()
    assert sim.read(a, N) == _pattern(N, 3) and sim.read(b, N) == _pattern(N, 2)


def test_a_compressed_backup_falls_back_to_a_copy(saver, sim):
    data = bytes(N)  # zeros: compressed by the simulated codec
    w = _alloc(saver, sim, "w", data, enable_cpu_backup=True)
    sim.set_tag_policy("w", backup=True, compress="bytes")  # set outside the saver, which stores raw
    sim.pause("w")
    assert sim.stats()["compressed_bytes"] > 0, "the backup is compressed"
    assert sim.view_backup(w, N) is None, "no raw host bytes to view"
    one, two = _view(saver, w), _view(saver, w)
    assert _bytes_of(one) == data and one.data_ptr() != two.data_ptr(), "a copy each time"
    saver.resume("w")
    assert _view(saver, w) is None, "awake, nothing retained"


def test_a_disk_backup_falls_back_to_a_copy_while_paused(saver, sim, tmp_path):
    saver.set_disk_backup_dir(str(tmp_path))
    data = _pattern(N, 5)
    d = _alloc(saver, sim, "disk", data, enable_disk_backup=True)
    saver.pause("disk")
    assert sim.view_backup(d, N) is None
    assert _bytes_of(_view(saver, d)) == data, "read from its file"
    saver.resume("disk")
    assert _view(saver, d) is None


def test_no_backup_none_or_an_error(saver, sim):
    kv = _alloc(saver, sim, "kv", _pattern(N, 1))
    assert _view(saver, kv) is None, "awake, no backup"
    saver.pause("kv")
    with pytest.raises(CumemError, match="without CPU backup"):
        _view(saver, kv)
    with pytest.raises(CumemValueError, match="not memory of a region"):
        _view(saver, kv + 64 * MiB)
    saver.resume("kv")


def test_an_empty_tensor_and_a_view_inside_an_allocation(saver, sim):
    data = _pattern(N, 11)
    w = _alloc(saver, sim, "w", data, enable_cpu_backup=True)
    saver.pause()
    empty = saver._cpu_backup(w, 0, torch.float16, (0, 4), True)
    assert empty.shape == (0, 4) and empty.dtype == torch.float16
    inner = saver._cpu_backup(w + 4096, 1000, torch.uint8, (10, 100), True)
    assert inner.shape == (10, 100) and _bytes_of(inner) == data[4096:5096]
    assert inner.data_ptr() == sim.view_backup(w, N).address + 4096
    saver.resume()


@pytest.mark.parametrize(
    "args, error, name",
    [
        (("x", 4), TypeError, "address"),
        ((0, 4), ValueError, "not inside one live allocation"),
        ((None, -1), TypeError, "address"),
        (("w", -1), ValueError, "size"),
        (("w", 4, "yes"), TypeError, "writable"),
    ],
)
def test_view_backup_refuses_bad_arguments_by_name(sim, args, error, name):
    w = sim.malloc(GRAN)
    args = tuple(w if a == "w" else a for a in args)
    with pytest.raises(error, match=name):
        sim.view_backup(*args)


def test_a_view_that_outlives_its_backup_unpins_it_when_it_goes_but_not_in_a_forked_child(saver, sim):
    w = _alloc(saver, sim, "w", _pattern(N, 2), enable_cpu_backup=True)
    saver.pause()
    view = _view(saver, w)
    saver.resume()  # without retain: the view is the arena's last holder
    assert sim.driver_counts()["host_registered"] > 0, "the view's arena is still pinned"
    pid = os.fork()
    if pid == 0:  # the child: read, drop, exit; the parent's pinning is no driver state of the child's
        before = sim.driver_counts()["host_registered"]
        ok = _bytes_of(view) == _pattern(N, 2)
        del view
        gc.collect()
        os._exit(0 if ok and sim.driver_counts()["host_registered"] == before else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child unpinned its copy of the view's arena"
    assert _bytes_of(view) == _pattern(N, 2)
    del view
    gc.collect()
    assert sim.driver_counts()["host_registered"] == 0, "the last view went: its arena is unpinned"


# -- on a GPU, through get_cpu_backup with real tensors --------------------------------------------------------------

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and cumem_rs.cuda_available()),
    reason="needs a CUDA GPU visible to both torch and cumem_rs",
)

#: Run as a script: in this process (hook_mode "torch") or in a child with the hook library preloaded.
CUDA_FLOW = textwrap.dedent(
    """
    import torch
    from cumem_rs.memory_saver import TorchMemorySaver

    def flow(tms, hook_mode, tag):
        tms.hook_mode = hook_mode
        assert tms.retain_cpu_backup is False
        expected = torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8)
        with tms.region(tag, enable_cpu_backup=True, cpu_backup_backend="mmap"):
            retained = expected.to("cuda")
        tms.pause(tag)
        first = tms.get_cpu_backup(retained, zero_copy=True)
        first_ptr = first.data_ptr()
        assert first.device.type == "cpu" and torch.equal(first, expected)
        assert tms.get_cpu_backup(retained).data_ptr() != first_ptr, "zero_copy=False copies"
        tms.retain_cpu_backup = True
        del first
        tms.resume(tag)
        after = tms.get_cpu_backup(retained, zero_copy=True)
        assert after.data_ptr() == first_ptr
        assert torch.equal(after, expected) and torch.equal(retained.cpu(), expected)
        tms.retain_cpu_backup = False
        changed = expected.flip(0).contiguous()
        retained.copy_(changed)
        tms.pause(tag)
        assert after.data_ptr() == first_ptr and torch.equal(after, changed), "updated in place"
        del after
        tms.resume(tag)
        assert tms.get_cpu_backup(retained) is None
        assert torch.equal(retained.cpu(), changed)
        # A resume, then a clone on a non-default stream sees the restored data.
        with tms.region(tag, enable_cpu_backup=True, cpu_backup_backend="mmap"):
            restored = torch.full((64 << 20,), 7, dtype=torch.uint8, device="cuda")
        tms.pause(tag)
        kept = tms.get_cpu_backup(restored, zero_copy=True)
        tms.resume(tag)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            out = restored.clone()
        stream.synchronize()
        assert bool(torch.all(out == 7))
        assert bool(torch.all(kept == 7)), "the view outlives the released backup"
    """
)


@needs_cuda
def test_zero_copy_on_a_gpu_in_torch_mode():
    namespace: dict = {}
    exec(CUDA_FLOW, namespace)
    saver = TorchMemorySaver()
    keep = saver._allocator().native.keep_host_memory()
    try:
        namespace["flow"](saver, "torch", "zero_copy_torch")
    finally:
        saver._allocator().native.set_keep_host_memory(keep)


@needs_cuda
def test_zero_copy_on_a_gpu_in_preload_mode():
    script = CUDA_FLOW + '\nflow(TorchMemorySaver(), "preload", "zero_copy_preload")\nprint("ok")\n'
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_")}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    with configure_subprocess():
        env["LD_PRELOAD"] = os.environ["LD_PRELOAD"]
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("ok"), (out.returncode, out.stdout, out.stderr)
