"""cumem_rs.memory_saver's disk backup with a visible file per paused allocation, as torch_memory_saver keeps them
and as its own test (`test/examples/disk_backup.py`) checks: a 1 MiB staging chunk (TMS_DISK_BACKUP_CHUNK_MB, read
at set-up), a multi-chunk fp32 tensor with an uneven tail and a tiny one under disk backup, a large one without
backup; at each of 3 pauses at least one file per disk-backed allocation in the directory, together at least the
big tensor's bytes and the same total every time; data bit-identical after each resume. On the simulated driver
(a saver over `SimulatedPools`: `Allocator.malloc` inside a region stands for torch's allocations) and, with a GPU,
in hook_mode="torch" with torch tensors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

torch = pytest.importorskip("torch")

import cumem_rs  # noqa: E402
from cumem_rs import Allocator  # noqa: E402
from cumem_rs._sim_pools import SimulatedPools  # noqa: E402
from cumem_rs.memory_saver import TorchMemorySaver  # noqa: E402

MiB = 1 << 20
BIG = (MiB * 13 // 4 + 12345) * 4  # bytes of ~13.4 fp32 chunks of 1 MiB
NO_BACKUP = 20_000_000


@pytest.fixture(autouse=True)
def _tms_env(monkeypatch):
    """torch_memory_saver's test sets a 1 MiB chunk before init; no other TMS_* variable (a developer's shell)."""
    for name in list(os.environ):
        if name.startswith("TMS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TMS_DISK_BACKUP_CHUNK_MB", "1")


def _listing(directory: Path) -> tuple[int, int]:
    """(files, total bytes) in `directory`, as that test counts them."""
    names = os.listdir(directory)
    return len(names), sum(os.path.getsize(os.path.join(directory, n)) for n in names)


@pytest.fixture
def sim() -> Iterator[Allocator]:
    a = Allocator.simulated(devices=1, capacity=96 * MiB, granularity=64 * 1024)
    try:
        yield a
    finally:
        a.close()


@pytest.fixture
def saver(sim) -> TorchMemorySaver:
    return TorchMemorySaver(_backend=SimulatedPools(sim))


def _region_alloc(saver: TorchMemorySaver, sim: Allocator, size: int, data: bytes, **region) -> int:
    with saver.region(**region):
        address = sim.malloc(size)
    sim.write(address, data)
    return address


def _cycles(saver: TorchMemorySaver, sim: Allocator, directory: Path) -> set[int]:
    big_data, small_data = os.urandom(BIG), bytes([10]) * 7
    big = _region_alloc(saver, sim, BIG, big_data, enable_disk_backup=True)
    small = _region_alloc(saver, sim, 7, small_data, enable_disk_backup=True)
    none = _region_alloc(saver, sim, NO_BACKUP, bytes([20]) * NO_BACKUP, enable_disk_backup=False)
    totals = set()
    for _ in range(3):
        saver.pause()
        assert 0 < sim.stats()["staging_bytes"] <= MiB, "the ring of TMS_DISK_BACKUP_CHUNK_MB"
        files, total = _listing(directory)
        assert files >= 2, "a backup file per disk-backed allocation"
        assert total >= BIG
        totals.add(total)
        occupy = sim.malloc(NO_BACKUP)  # the released memory is usable while paused
        sim.write(occupy, bytes([30]) * 4096)
        sim.free(occupy)
        saver.resume()
        assert sim.read(big, BIG) == big_data and sim.read(small, 7) == small_data
        assert sim.read(none, 3) != bytes([20]) * 3, "no backup: undefined (the sim's poison) after resume"
    return totals


def test_disk_backup_keeps_a_file_per_paused_allocation_in_the_named_dir(saver, sim, tmp_path):
    saver.set_disk_backup_dir(str(tmp_path))
    assert len(_cycles(saver, sim, tmp_path)) == 1, "disk usage constant across cycles"
    assert os.listdir(tmp_path) == [], "removed at resume (retain_cpu_backup is off)"


def test_tms_disk_backup_dir_names_the_files_too(saver, sim, tmp_path, monkeypatch):
    target = tmp_path / "made"
    monkeypatch.setenv("TMS_DISK_BACKUP_DIR", str(target))
    assert len(_cycles(saver, sim, target)) == 1
    assert os.listdir(target) == []


def test_with_retain_cpu_backup_the_files_stay_while_awake_and_unchanged_chunks_are_not_rewritten(
    saver, sim, tmp_path
):
    saver.set_disk_backup_dir(str(tmp_path))
    saver.retain_cpu_backup = True
    data = os.urandom(4 * MiB)
    d = _region_alloc(saver, sim, len(data), data, enable_disk_backup=True)
    saver.pause()
    first = _listing(tmp_path)
    assert first[0] == 1 and first[1] >= len(data)
    saver.resume()
    if not sim.retains_backups():
        pytest.skip("retained backups are unavailable here")
    assert _listing(tmp_path) == first, "kept with the retained backup"
    for _ in range(2):
        report = saver._allocator().pause(None)
        assert report["written_bytes"] == 0, "nothing changed: nothing rewritten"
        assert _listing(tmp_path) == first
        saver.resume()
        assert sim.read(d, len(data)) == data
    saver.retain_cpu_backup = False
    saver.pause()
    saver.resume()  # applies retain_cpu_backup=False: the backup and its file go
    assert os.listdir(tmp_path) == []
    assert sim.read(d, len(data)) == data


def test_the_system_temp_fallback_keeps_unlinked_files(saver, sim, tmp_path, monkeypatch):
    """Nobody named the system temp directory, and it is shared: nothing of ours is left there, even by a
    killed process."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    data = os.urandom(MiB)
    d = _region_alloc(saver, sim, len(data), data, enable_disk_backup=True)
    assert sim.spill_dir == tmp_path
    saver.pause()
    assert sim.stats()["file_tier_bytes"] == MiB
    assert os.listdir(tmp_path) == []
    saver.resume()
    assert sim.read(d, len(data)) == data


# -- on a GPU, with torch tensors (hook_mode="torch") -----------------------------------------------------------

_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and cumem_rs.cuda_available()),
    reason="needs a CUDA GPU visible to both torch and cumem_rs",
)


@_gpu
def test_torch_memory_savers_disk_backup_test_in_torch_mode(tmp_path):
    from cumem_rs.allocator import CuMemAllocator

    cumem = CuMemAllocator.get_instance()
    keep = cumem.native.keep_host_memory()
    saver = TorchMemorySaver()
    saver.hook_mode = "torch"
    saver.set_disk_backup_dir(str(tmp_path))
    try:
        numel = MiB * 13 // 4 + 12345
        with saver.region(tag="tms_disk_files", enable_disk_backup=True):
            big = torch.randn((numel,), dtype=torch.float32, device="cuda")
            small = torch.full((7,), 10, dtype=torch.uint8, device="cuda")
        with saver.region(tag="tms_disk_files", enable_disk_backup=False):
            none = torch.full((NO_BACKUP,), 20, dtype=torch.uint8, device="cuda")
        big_ref, small_ref = big.cpu().clone(), small.cpu().clone()
        totals = set()
        for _ in range(3):
            saver.pause("tms_disk_files")
            files, total = _listing(tmp_path)
            assert files >= 2 and total >= numel * 4, (files, total)
            totals.add(total)
            occupy = torch.full((NO_BACKUP,), 30, dtype=torch.uint8, device="cuda")
            del occupy
            torch.cuda.empty_cache()
            saver.resume("tms_disk_files")
            assert torch.equal(big.cpu(), big_ref) and torch.equal(small.cpu(), small_ref)
            assert none[:3].tolist() != [20, 20, 20]
        assert len(totals) == 1, sorted(totals)
        assert os.listdir(tmp_path) == []
        del big, small, none
    finally:
        # Process-wide: leave later tests no segment of these tags in torch's cache, no file-tier policy (a pause of
        # every tag would be refused without a spill directory) and no spill directory.
        torch.cuda.empty_cache()
        for inner in saver._tags.get("tms_disk_files", {}).values():
            cumem.native.set_tag_policy(inner)
        cumem.set_spill_dir(None)
        cumem.set_staging_bytes(256 * MiB)  # the default, which TMS_DISK_BACKUP_CHUNK_MB changed
        cumem.native.set_keep_host_memory(keep)
