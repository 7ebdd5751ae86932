"""Named spill files (`set_spill_dir(path, named=True)`): torch_memory_saver's disk backup keeps one visible file
per paused allocation in the directory its user named, and its own test (`test/examples/disk_backup.py`) lists
that directory while paused. Checked here on the simulated driver with a real temporary directory: a file per
file-tier backup while asleep (mode 0600, at least the allocation's bytes), gone when the backup is dropped
(wake, free, discard and trim of a retained one, close, interpreter exit), the same bytes on disk at every cycle,
the same transactional promises as unlinked files at every failed write or read, and the memory saver's disk
backup over it. The default (unlinked files) is tested in test_file_tier.py and stays as it is.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

import cumem_rs
from cumem_rs import Allocator
from test_file_tier import tensor

MiB = 1 << 20
GRAN = 64 << 10


def named_files(directory: Path) -> list[Path]:
    """This process's named spill files in `directory`."""
    pattern = re.compile(rf"cumem_rs-{os.getpid()}-\d+\.bak")
    return sorted(p for p in Path(directory).iterdir() if pattern.fullmatch(p.name))


def disk_total(directory: Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).iterdir())


@pytest.fixture
def a(tmp_path) -> Iterator[Allocator]:
    """A simulated allocator whose "weights" go to named files in tmp_path, through a small staging ring (several
    chunks per allocation), without retained backups (torch_memory_saver's default)."""
    alloc = Allocator.simulated(devices=1, capacity=64 * MiB, granularity=GRAN)
    alloc.set_spill_dir(tmp_path, named=True)
    alloc.set_tag_policy("weights", backup_tier="file")
    alloc.set_staging_bytes(8 * 4096)
    alloc.set_retain_backups(False)
    yield alloc
    alloc.close()


def test_each_asleep_file_backup_is_a_private_named_file_of_its_size(a, tmp_path):
    tensors = [tensor(a, "weights", n) for n in (1, 3, 2)]
    other = tensor(a, "kv", 1)
    assert named_files(tmp_path) == [], "the probe file of set_spill_dir is gone"
    a.sleep("weights")  # kv: released without backup
    files = named_files(tmp_path)
    assert len(files) == 3, "one per file-tier backup, none for a tag without backup"
    assert sorted(os.listdir(tmp_path)) == [f.name for f in files], "nothing else is left there"
    for f in files:
        st = f.lstat()
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert sorted(f.stat().st_size for f in files) == sorted(len(d) for _, d in tensors)
    assert a.stats()["file_tier_bytes"] == sum(len(d) for _, d in tensors)
    a.wake_up(None)
    assert named_files(tmp_path) == [], "removed at wake"
    for addr, data in tensors:
        assert a.read(addr, len(data)) == data
    assert a.read(other[0], len(other[1])) != other[1], "kv had no backup (poisoned)"


def test_a_freed_asleep_allocation_takes_its_file_with_it_and_close_takes_the_rest(a, tmp_path):
    tensors = [tensor(a, "weights", 1) for _ in range(3)]
    a.sleep("weights")
    assert len(named_files(tmp_path)) == 3
    a.free(tensors[1][0])
    assert len(named_files(tmp_path)) == 2
    a.close()
    assert named_files(tmp_path) == []


@pytest.mark.parametrize("retain", [False, True])
def test_the_bytes_on_disk_stay_the_same_over_cycles_and_data_is_bit_identical(a, tmp_path, retain):
    a.set_retain_backups(retain)
    a.set_fingerprint_chunk(GRAN)
    tensors = [tensor(a, "weights", n) for n in (2, 1)]
    totals = set()
    for cycle in range(3):
        rep = a.sleep("weights")
        files = named_files(tmp_path)
        assert len(files) == 2
        totals.add(disk_total(tmp_path))
        if retain and cycle > 0:
            assert rep["written_bytes"] == 0, "unchanged chunks of a retained file backup are not rewritten"
        a.wake_up(None)
        if retain and a.retains_backups():
            assert len(named_files(tmp_path)) == 2, "a retained file backup keeps its file while awake"
        else:
            assert named_files(tmp_path) == []
        for addr, data in tensors:
            assert a.read(addr, len(data)) == data
    assert totals == {sum(len(d) for _, d in tensors)}
    a.discard("weights")  # drops the retained backups of the awake allocations
    assert named_files(tmp_path) == []


def test_trim_drops_retained_file_backups_and_their_files(a, tmp_path):
    a.set_retain_backups(True)
    addr, data = tensor(a, "weights", 2)
    a.sleep("weights")
    a.wake_up(None)
    if not a.retains_backups():
        pytest.skip("retained backups are unavailable here")
    assert len(named_files(tmp_path)) == 1
    a.trim_host()
    assert named_files(tmp_path) == []
    assert a.read(addr, len(data)) == data


@pytest.mark.parametrize("error", ["short", "enospc", "eio"])
def test_a_failed_write_leaves_a_file_only_for_each_complete_backup(a, tmp_path, error):
    """Each allocation is awake with its data and no file, or asleep with a complete backup in its file, whichever
    write of the pipeline fails (chunks of 16 KiB: 4 per granule, the allocations 1, 2 and 1 granules)."""
    tensors = [tensor(a, "weights", n) for n in (1, 2, 1)]
    for nth in range(1, 17):
        a.inject_spill_fault("write", nth, error)
        failed = False
        try:
            a.sleep("weights")
        except cumem_rs.CumemError:
            failed = True
        a.clear_spill_faults()
        asleep = {r["address"] for r in a.allocations() if r["asleep"]}
        assert failed == (len(asleep) < 3), nth
        assert len(named_files(tmp_path)) == len(asleep), (nth, error)
        for addr, data in tensors:
            if addr in asleep:
                assert a.read_backup(addr, len(data)) == data
            else:
                assert a.read(addr, len(data)) == data
        a.wake_up(None)
        assert named_files(tmp_path) == []
        for addr, data in tensors:
            assert a.read(addr, len(data)) == data


@pytest.mark.parametrize("error", ["short", "eio"])
def test_a_failed_read_keeps_every_file_and_a_later_wake_succeeds(a, tmp_path, error):
    tensors = [tensor(a, "weights", n) for n in (1, 2)]
    a.sleep("weights")
    before = {f.name: f.stat().st_size for f in named_files(tmp_path)}
    a.inject_spill_fault("read", 3, error)
    with pytest.raises(cumem_rs.CumemError, match="spill file"):
        a.wake_up(None)
    a.clear_spill_faults()
    assert {f.name: f.stat().st_size for f in named_files(tmp_path)} == before
    a.wake_up(None)
    assert named_files(tmp_path) == []
    for addr, data in tensors:
        assert a.read(addr, len(data)) == data


@pytest.fixture
def small_fs(tmp_path) -> Iterator[Path]:
    """A 1 MiB file system (a tmpfs: mounting needs root, else skipped)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_sleep_past_the_free_space_is_refused_before_anything_is_released(a, small_fs):
    a.set_spill_dir(small_fs, named=True)
    tensors = [tensor(a, "weights", n) for n in (8, 16)]  # 1.5 MiB in a 1 MiB file system
    with pytest.raises(cumem_rs.CumemOutOfMemoryError, match="spill directory"):
        a.sleep("weights")
    assert os.listdir(small_fs) == []
    assert not any(r["asleep"] for r in a.allocations())
    for addr, data in tensors:
        assert a.read(addr, len(data)) == data
    a.free(tensors[1][0])
    a.sleep("weights")  # 512 KiB fits
    assert len(named_files(small_fs)) == 1
    a.wake_up(None)
    assert a.read(tensors[0][0], len(tensors[0][1])) == tensors[0][1]


@pytest.mark.parametrize("named", [False, True], ids=["unlinked", "named"])
def test_each_sleep_finds_the_space_its_last_wake_gave_back(a, small_fs, named):
    """A wake returns before the file system has its spill file's blocks back (the reclaim thread closes it);
    the next sleep's space check waits for that, so cycles of a backup that fills most of the file system never
    see the previous cycle's file still there."""
    a.set_spill_dir(small_fs, named=named)
    a.set_host_budget(0)
    a.set_retain_backups(False)
    addr, data = tensor(a, "weights", 10)  # 640 KiB of a 1 MiB file system: two files do not fit
    for _ in range(20):
        a.sleep("weights")
        assert a.stats()["file_tier_bytes"] == len(data)
        a.wake_up(None)
    assert a.read(addr, len(data)) == data


def test_named_bad_input_names_the_argument(a, tmp_path):
    with pytest.raises(TypeError, match="named"):
        a.set_spill_dir(tmp_path, named="yes")
    blocker = tmp_path / "plain"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="plain"):
        a.set_spill_dir(blocker, named=True)
    assert a.spill_dir == tmp_path, "a refused directory changes nothing"
    a.set_spill_dir(None, named=True)
    assert a.spill_dir is None


def test_a_switch_to_unlinked_files_keeps_the_named_backups_where_they_are(a, tmp_path):
    addr, data = tensor(a, "weights", 1)
    a.sleep("weights")
    assert len(named_files(tmp_path)) == 1
    a.set_spill_dir(tmp_path)  # unnamed from now on
    other, other_data = tensor(a, "weights", 1)
    a.sleep("weights")
    assert len(named_files(tmp_path)) == 1, "the new backup is in an unlinked file"
    a.wake_up(None)
    assert named_files(tmp_path) == []
    assert a.read(addr, len(data)) == data and a.read(other, len(other_data)) == other_data


_CHILD = textwrap.dedent(
    """
    import os, sys
    from cumem_rs import Allocator
    from cumem_rs._sim_pools import SimulatedPools
    from cumem_rs.memory_saver import TorchMemorySaver

    sim = Allocator.simulated(devices=1, capacity=16 << 20, granularity=64 << 10)
    saver = TorchMemorySaver(_backend=SimulatedPools(sim))
    saver.set_disk_backup_dir(sys.argv[1])
    with saver.region("disk", enable_disk_backup=True):
        sim.malloc(1 << 20)
    saver.pause()
    print(len(os.listdir(sys.argv[1])), flush=True)
    if sys.argv[2] == "killed":
        os._exit(0)  # no exit handler runs, as after SIGKILL
    """
)


@pytest.mark.parametrize("end", ["exit", "killed"])
def test_interpreter_exit_removes_the_named_files_a_killed_process_leaves_them(tmp_path, end):
    pytest.importorskip("torch")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path), end], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1"], "a file while paused"
    left = os.listdir(tmp_path)
    if end == "exit":
        assert left == []
    else:
        assert len(left) == 1 and left[0].startswith("cumem_rs-") and left[0].endswith(".bak"), left


_FD_LIMIT_CHILD = textwrap.dedent(
    """
    import os, resource, sys
    import cumem_rs
    from cumem_rs import Allocator

    a = Allocator.simulated(devices=1, capacity=16 << 20, granularity=64 << 10)
    a.set_spill_dir(sys.argv[1], named=True)
    a.set_tag_policy("weights", backup_tier="file")
    a.push_tag("weights")
    tensors = []
    for i in range(40):
        addr = a.malloc(64 << 10)
        a.write(addr, bytes([i]) * (64 << 10))
        tensors.append(addr)
    a.pop_tag()
    # Room for a few more open files than now: far fewer than the 40 backups' files.
    open_now = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 8, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    try:
        a.sleep("weights")
        print("slept")
    except cumem_rs.CumemError as e:
        print("refused:", e)
    assert not any(r["asleep"] for r in a.allocations()), "refused before anything was released"
    assert os.listdir(sys.argv[1]) == [], os.listdir(sys.argv[1])
    for i, addr in enumerate(tensors):
        assert a.read(addr, 64 << 10) == bytes([i]) * (64 << 10)
    print("intact")
    """
)


def test_past_the_open_file_limit_a_named_sleep_is_refused_before_anything_is_released(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _FD_LIMIT_CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused:") and "ulimit" in lines[0], lines
    assert lines[-1] == "intact"


# --- the file tier's state machines in named mode --------------------------------------------------------------


def _named_machine(faulty: bool) -> type:
    from hypothesis.stateful import invariant

    from test_file_tier import Spilling, _faulty_spilling_machine, _spilling_machine

    base = _faulty_spilling_machine() if faulty else _spilling_machine("sim")

    class NamedSpilling(base):  # type: ignore[misc, valid-type]
        """The file tier's machine (a small host budget, most backups in files) with named files: every name in
        the directory is a file this process holds open for a backup, and every backup file has its name."""

        def __init__(self) -> None:
            super().__init__()
            self.a.set_spill_dir(self.spill, named=True)

        @invariant()
        def spill_files_are_never_visible(self):
            """Replaces the base invariant: here they are, exactly those of live backups (a dropped backup's
            name goes at once, its open file once the reclaim thread closed it)."""
            self.a.settle_spill_files()
            held = set()
            for fd in os.listdir("/proc/self/fd"):
                try:
                    target = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    continue
                if os.path.dirname(target) == self.spill:
                    held.add(os.path.basename(target))
            names = {p.name for p in named_files(Path(self.spill))}
            assert names == held, (names, held)
            assert set(os.listdir(self.spill)) == names

    assert issubclass(NamedSpilling, Spilling)
    return NamedSpilling


def test_state_machine_with_named_spill_files():
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test

    from conftest import STATEFUL_SETTINGS

    run_state_machine_as_test(_named_machine(False), settings=settings(STATEFUL_SETTINGS, max_examples=60))


@pytest.mark.usefixtures("raw_backups")
def test_faulty_state_machine_with_named_spill_files():
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test

    from conftest import STATEFUL_SETTINGS

    run_state_machine_as_test(_named_machine(True), settings=settings(STATEFUL_SETTINGS, max_examples=60))
