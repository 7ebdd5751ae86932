"""The host budget and the file tier: backups past the budget go to unlinked files in a spill directory, and
come back bit-identical; without a directory a sleep past the budget is refused before anything is released.
Parametrised over the backend (sim always, cuda with a GPU): the file I/O is the store's own host code on both.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule, run_state_machine_as_test

import cumem_rs
from cumem_rs import Allocator
from conftest import BACKENDS, STATEFUL_SETTINGS, fd_target, spill_files


def tensor(a: Allocator, tag: str, granules: int) -> tuple[int, bytes]:
    size = granules * a.granularity(0)
    a.push_tag(tag)
    try:
        addr = a.malloc(size, 0)
    finally:
        a.pop_tag()
    data = os.urandom(size)
    a.write(addr, data)
    return addr, data


@pytest.fixture
def a(alloc: Allocator):
    yield alloc
    # The CUDA allocator is shared: leave it awake, without a budget, a spill directory or armed faults.
    alloc.clear_spill_faults()
    alloc.wake_up(None)
    alloc.set_host_budget(None)
    alloc.set_spill_dir(None)
    alloc.set_tag_policy("weights")
    alloc.set_staging_bytes(256 << 20)
    alloc.trim_host()


@pytest.fixture
def spilling(a: Allocator, tmp_path):
    """`a` with a budget of one granule, a spill directory and a small staging ring (chunks per allocation)."""
    g = a.granularity(0)
    a.set_host_budget(g)
    a.set_spill_dir(tmp_path)
    a.set_staging_bytes(max(8 * 4096, g // 2))
    return a


def test_a_sleep_past_the_budget_without_a_spill_dir_is_refused_and_keeps_every_byte(a):
    g = a.granularity(0)
    addr, data = tensor(a, "weights", 2)
    a.set_host_budget(g)
    assert a.host_budget == g
    before = a.stats()["asleep_allocations"]
    with pytest.raises(cumem_rs.CumemOutOfMemoryError, match="host budget"):
        a.sleep("weights")
    assert a.stats()["asleep_allocations"] == before
    assert a.read(addr, len(data)) == data
    a.set_host_budget(2 * g)
    a.sleep("weights")
    assert a.host_bytes() <= 2 * g
    a.wake_up(None)
    assert a.read(addr, len(data)) == data
    a.free(addr)


@pytest.mark.parametrize("cells", [1, 4], ids=["arena_pinned_whole", "pinned_in_quarter_granule_cells"])
def test_under_a_budget_a_sleep_goes_into_a_hole_a_partial_wake_left_when_one_takes_it(a, cells):
    """Without retained backups a partial wake leaves holes in the arena the others' backups still use, and under
    a budget no second arena fits beside it: a sleep goes into the smallest hole that takes all its backups, and
    is refused with nothing released when no single hole does. Every byte comes back, also where the arena was
    pinned cell by cell (the copies into the hole then cross cells)."""
    g = a.granularity(0)
    a.set_retain_backups(False)
    tensors = {}
    try:
        if cells > 1:
            a.set_pin_chunk(g // cells)
        for tag, n in (("h0", 1), ("h1", 1), ("h2", 2)):
            # Raw backups: a compressing sleep under this budget would store the first allocation's blobs in an
            # arena of their own and copy the rest raw beside it, not one arena in address order.
            a.set_tag_policy(tag, compress="off")
            tensors[tag] = tensor(a, tag, n)
        a.set_host_budget(4 * g)
        a.pause(list(tensors))  # one arena of 4 granules, in address order
        outer = sorted(tensors, key=lambda t: tensors[t][0])[::2]
        a.wake_up(outer)  # two holes, apart: the middle allocation's backup lies between them
        with pytest.raises(cumem_rs.CumemOutOfMemoryError, match="host budget"):
            a.pause(outer)  # their backups, back to back, fit in neither hole
        assert all(not r["asleep"] for r in a.allocations() if r["tag"] in outer)
        for tag in outer:
            a.pause(tag)
            assert a.host_bytes() <= 4 * g
        assert a.stats()["host_tier_bytes"] == 4 * g
        a.wake_up(list(tensors))
        for addr, data in tensors.values():
            assert a.read(addr, len(data)) == data
    finally:
        a.set_retain_backups(True)
        a.set_pin_chunk(512 << 20)  # the default
        a.wake_up(None)
        for tag in ("h0", "h1", "h2"):
            a.set_tag_policy(tag)
        for addr, _ in tensors.values():
            a.free(addr)


def test_small_compressed_backups_fit_a_tight_budget_and_keep_their_retained_chunks(sim, tmp_path):
    """Tiny compressed backups under a budget of two granules: a new blob arena is no larger than the room the
    budget leaves, so the sleep compresses (found by the spilling state machine: a minimum-size arena was refused
    by a few bytes, the compression fell back to raw copies and dropped the retained backups)."""
    g = sim.granularity(0)
    sim.set_host_budget(2 * g)
    sim.set_spill_dir(tmp_path)
    sim.set_staging_bytes(max(8 * 4096, g // 2))
    addrs = [sim.malloc(1, 0) for _ in range(3)]
    sim.pause(None)
    addrs += [sim.malloc(1, 0) for _ in range(2)]
    sim.pause(None)
    addrs.append(sim.malloc(1, 0))
    sim.resume(None)
    sim.write(addrs[0], b"\x00")  # the first allocation's chunk changes; the other four retained ones do not
    report = sim.pause(None)
    assert report["skipped_bytes"] == 4 * g, report
    assert sim.errors() == []
    sim.resume(None)


def test_blob_arenas_of_tiny_backups_shrink_to_their_bytes_under_a_tight_budget(sim, tmp_path):
    """Two pauses of one tiny allocation each under a budget of two granules: each blob arena is moved into one of
    its bytes, so the retained backups after the wake leave room for the next pause's blobs (found by the spilling
    state machine: two minimum-size arenas filled the budget and that pause fell back to raw copies)."""
    g = sim.granularity(0)
    sim.set_host_budget(2 * g)
    sim.set_spill_dir(tmp_path)
    addrs = [sim.malloc(1, 0)]
    sim.pause(None)
    addrs.append(sim.malloc(1, 0))
    sim.pause(None)
    sim.wake_up(None)
    assert sim.host_bytes() < g, "blob arenas of a few hundred bytes"
    sim.write(addrs[0], bytes(range(256)) * (g // 256))
    report = sim.pause(None)
    assert report["skipped_bytes"] == g and report["chunks_checked"] == 2, report
    assert sim.errors() == []
    sim.resume(None)


def test_host_budget_bad_input_names_the_argument(a):
    with pytest.raises((ValueError, TypeError), match="nbytes"):
        a.set_host_budget(-1)
    with pytest.raises(TypeError, match="nbytes"):
        a.set_host_budget("1G")


def test_backups_past_the_budget_go_to_an_unlinked_file_and_come_back(spilling, tmp_path):
    a = spilling
    g = a.granularity(0)
    tensors = [tensor(a, "weights", n) for n in (1, 2, 1)]
    rep = a.sleep("weights")
    s = a.stats()
    assert a.host_bytes() <= g
    assert s["host_tier_bytes"] == g and s["file_tier_bytes"] == 3 * g
    assert rep["written_bytes"] == 3 * g and rep["file_seconds"] > 0
    assert s["staging_bytes"] > 0
    assert list(tmp_path.iterdir()) == [], "spill files are unlinked as soon as they are open"
    woke = a.wake_up(None)
    assert woke["read_bytes"] == 3 * g
    for addr, data in tensors:
        assert a.read(addr, len(data)) == data
    for addr, _ in tensors:
        a.free(addr)


def test_a_file_tier_policy_sends_a_tag_to_files_whatever_the_budget(a, tmp_path):
    a.set_spill_dir(tmp_path)
    assert a.spill_dir == tmp_path
    a.set_tag_policy("weights", backup_tier="file")
    assert a.tag_policy("weights")["backup_tier"] == "file"
    addr, data = tensor(a, "weights", 2)
    a.sleep("weights")
    assert a.stats()["file_tier_bytes"] == len(data) and a.stats()["host_tier_bytes"] == 0
    assert a.status()["tags"]["weights"]["backup_tier"] == "file"
    assert a.status()["tags"]["weights"]["file_bytes"] == len(data)
    a.wake_up(None)
    assert a.read(addr, len(data)) == data
    a.free(addr)


def _sleep_with_a_failed_write(a: Allocator, tensors, nth: int, error: str) -> tuple[bool, set[int]]:
    """A sleep of "weights" whose `nth` spill write fails with `error`; then each allocation is either awake with its
    data or asleep with a complete backup. Returns whether the fault fired (the sleep raised, naming the spill
    file) and the addresses asleep: the sleep failed exactly when some allocation was left awake."""
    a.inject_spill_fault("write", nth, error)
    failed = False
    try:
        a.sleep("weights")
    except cumem_rs.CumemError as e:
        assert "spill file" in str(e), e
        failed = True
    finally:
        a.clear_spill_faults()
    asleep = {r["address"] for r in a.allocations() if r["asleep"]}
    assert failed == (len(asleep) < len(tensors)), (nth, error, failed, len(asleep))
    for addr, data in tensors:
        if addr in asleep:
            assert a.read_backup(addr, len(data)) == bytes(data)
        else:
            assert a.read(addr, len(data)) == bytes(data)
    return failed, asleep


def _fired_at_the_first_writes(fired: list[int], tries: int) -> None:
    """The write fault fires at the n-th write exactly when the sleep makes at least n writes: at n = 1 at least,
    and for the n from 1 up to the sleep's write count, never past it."""
    assert fired and fired == list(range(1, len(fired) + 1)), f"the fault fired at nth {fired} of 1..{tries}"


@pytest.mark.parametrize("error", ["short", "enospc", "eio"])
def test_a_failed_write_leaves_each_allocation_awake_or_asleep_with_a_complete_backup(spilling, error):
    a = spilling
    tensors = [tensor(a, "weights", n) for n in (1, 2, 1)]
    fired = []
    for nth in range(1, 6):
        failed, _ = _sleep_with_a_failed_write(a, tensors, nth, error)
        fired += [nth] if failed else []
        a.wake_up(None)
        for addr, data in tensors:
            assert a.read(addr, len(data)) == data
    _fired_at_the_first_writes(fired, 5)
    for addr, _ in tensors:
        a.free(addr)


@pytest.mark.parametrize("error", ["short", "eio"])
def test_a_failed_read_fails_the_wake_and_a_later_wake_succeeds(spilling, error):
    a = spilling
    tensors = [tensor(a, "weights", n) for n in (1, 2, 1)]
    a.sleep("weights")
    usage = a.usage()
    a.inject_spill_fault("read", 1, error)
    with pytest.raises(cumem_rs.CumemError, match="spill file"):
        a.wake_up(None)
    a.clear_spill_faults()
    assert a.usage() == usage, "what the failed wake mapped was released"
    assert a.stats()["asleep_allocations"] >= 3
    a.wake_up(None)
    for addr, data in tensors:
        assert a.read(addr, len(data)) == data
        a.free(addr)


@pytest.mark.parametrize("op", ["write", "read"])
def test_backups_back_to_back_in_a_file_share_one_io_per_staging_slot(op, tmp_path):
    """A sleep writes its file backups back to back in one file; the pipelines fill a slot from as many of them as
    it holds, so the file sees one I/O per full slot (counted by where an injected fault can still hit), not one
    more at every backup's end. Three one-granule backups, slots of two granules: two writes and two reads."""
    g = 64 << 10
    a = Allocator.simulated(devices=1, capacity=16 << 20, granularity=g)
    try:
        a.set_spill_dir(tmp_path)
        a.set_host_budget(0)
        a.set_retain_backups(False)
        a.set_staging_bytes(8 * 2 * g)  # 8 slots of 2 granules
        xs = [tensor(a, "w", 1) for _ in range(3)]

        def cycle() -> None:
            a.pause("w")
            a.resume("w")

        a.inject_spill_fault(op, 3, "eio")  # a third I/O would fail
        cycle()
        a.clear_spill_faults()
        a.inject_spill_fault(op, 2, "eio")  # the second does
        with pytest.raises(cumem_rs.CumemError):
            cycle()
        a.clear_spill_faults()
        # A failed sleep left each allocation awake or asleep with a whole backup, a failed wake every backup:
        # a later wake succeeds.
        a.resume("w")
        assert not any(r["asleep"] for r in a.allocations())
        for addr, data in xs:
            assert a.read(addr, len(data)) == data
    finally:
        a.close()


def test_close_returns_once_every_spill_file_is_closed(tmp_path):
    """Dropped spill files are closed on the reclaim thread; `close()` waits for it, so a closed allocator holds
    no spill file open (and the file system has their blocks back)."""
    a = Allocator.simulated(devices=1, capacity=64 << 20, granularity=1 << 16)
    a.set_spill_dir(tmp_path)
    a.set_host_budget(0)
    for tag in ("x", "y"):
        tensor(a, tag, 2)
    a.pause(["x", "y"])
    assert spill_files(a, str(tmp_path))[0] >= 1
    a.resume("x")
    a.close()
    count = sum(
        1 for fd in os.listdir("/proc/self/fd") if fd_target(fd).startswith(str(tmp_path) + "/")
    )
    assert count == 0, "a spill file is still open after close"


def test_the_disk_blocks_of_a_woken_or_freed_file_backup_go_back_once_the_reclaim_settles(a, tmp_path):
    """Backups of one sleep share a file; a wake (without retention) or a free of some of them hands their disk
    blocks back (punched, merged, on the reclaim thread: free once `settle_spill_files` returns), while the others
    keep theirs and their bytes."""

    g = a.granularity(0)
    a.set_retain_backups(False)
    tensors = {}
    try:
        a.set_spill_dir(tmp_path)
        a.set_host_budget(0)
        for tag, n in (("d0", 1), ("d1", 2), ("d2", 1)):
            tensors[tag] = tensor(a, tag, n)
        a.pause(list(tensors))
        assert a.stats()["file_tier_bytes"] == 4 * g
        assert 4 * g <= spill_files(a, tmp_path)[1] <= 4 * g + (64 << 10)
        a.resume("d1")
        assert spill_files(a, tmp_path)[1] <= 2 * g + (64 << 10), "d1's blocks went back"
        a.free(tensors.pop("d0")[0])
        assert spill_files(a, tmp_path)[1] <= g + (64 << 10), "d0's blocks went back"
        a.resume(list(tensors))
        assert spill_files(a, tmp_path)[1] == 0, "the last backup went: the file closed"
        for addr, data in tensors.values():
            assert a.read(addr, len(data)) == data
    finally:
        a.set_retain_backups(True)
        a.wake_up(None)
        for addr, _ in tensors.values():
            a.free(addr)


def test_spill_dir_bad_input_names_the_path(a, tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match="missing"):
        a.set_spill_dir(missing)
    a_file = tmp_path / "plain"
    a_file.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a directory"):
        a.set_spill_dir(a_file)
    with pytest.raises(TypeError, match="path"):
        a.set_spill_dir(3)
    with pytest.raises(ValueError, match="backup_tier"):
        a.set_tag_policy("weights", backup_tier="disk")
    with pytest.raises(ValueError, match="staging"):
        a.set_staging_bytes(100)


def test_unwritable_spill_dir_is_a_value_error(a, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into any directory")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="ro"):
        a.set_spill_dir(ro)


def test_the_environment_sets_budget_and_spill_dir(tmp_path):
    import subprocess
    import sys

    code = (
        "import cumem_rs; a = cumem_rs.Allocator.simulated(granularity=1 << 16); "
        "print(a.host_budget, a.spill_dir)"
    )
    env = dict(os.environ, CUMEM_RS_HOST_BUDGET="64K", CUMEM_RS_SPILL_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["65536", str(tmp_path)]


# --- retained file backups: a sleep after a wake rewrites only the changed chunks --------------------------------


@pytest.fixture
def retaining_files(a: Allocator, tmp_path):
    """`a` with the weights' backups in files, retained across wakes, one fingerprint chunk per granule and a
    staging ring of several slots smaller than an allocation."""
    g = a.granularity(0)
    a.set_spill_dir(tmp_path)
    a.set_tag_policy("weights", backup_tier="file")
    a.set_staging_bytes(max(8 * 4096, g // 2))
    a.set_retain_backups(True)
    a.set_fingerprint_chunk(g)
    yield a
    a.set_retain_backups(True)
    a.set_fingerprint_chunk(2 << 20)


def _retained_file_backups(a: Allocator, granules: list[int]) -> list[tuple[int, bytearray]]:
    """Weights of these sizes, slept to files and woken: each retains its file backup now."""
    tensors = [tensor(a, "weights", n) for n in granules]
    first = a.sleep("weights")
    assert first["written_bytes"] == sum(len(d) for _, d in tensors)
    a.wake_up(None)
    if not a.retains_backups():
        pytest.skip("retained backups are unavailable here (fingerprint kernel)")
    assert a.stats()["file_tier_bytes"] == 0
    return [(addr, bytearray(data)) for addr, data in tensors]


def _check(a: Allocator, tensors: list[tuple[int, bytearray]]) -> None:
    for addr, data in tensors:
        assert a.read(addr, len(data)) == bytes(data)


def test_unchanged_weights_sleep_to_files_without_writing(retaining_files):
    a = retaining_files
    tensors = _retained_file_backups(a, [1, 3, 2])
    size = sum(len(d) for _, d in tensors)
    for _ in range(3):
        rep = a.sleep("weights")
        assert rep["written_bytes"] == 0 and rep["copied_bytes"] == 0
        assert rep["skipped_bytes"] == size
        ours = {addr for addr, _ in tensors}
        # Counted among this test's allocations: the CUDA allocator is shared, other tests may leave theirs.
        assert a.stats()["file_tier_bytes"] == size
        assert sum(1 for x in a.allocations() if x["address"] in ours and x["asleep"]) == 3
        for addr, data in tensors:
            assert a.read_backup(addr, len(data)) == bytes(data)
        woke = a.wake_up(None)
        assert woke["read_bytes"] == size
        _check(a, tensors)
    for addr, _ in tensors:
        a.free(addr)


def test_a_changed_chunk_is_the_only_one_written_at_its_offset(retaining_files):
    a = retaining_files
    g = a.granularity(0)
    tensors = _retained_file_backups(a, [50, 50])  # 100 chunks
    size = sum(len(d) for _, d in tensors)
    # 1% of the chunks: one, in the middle of the second allocation.
    addr, data = tensors[1]
    at = 17 * g
    new = bytes(x ^ 0x5A for x in data[at : at + g])
    a.write(addr + at, new)
    data[at : at + g] = new
    rep = a.sleep("weights")
    assert rep["written_bytes"] == g and rep["copied_bytes"] == g
    assert rep["skipped_bytes"] == size - g
    for addr2, d in tensors:
        assert a.read_backup(addr2, len(d)) == bytes(d)
    a.wake_up(None)
    _check(a, tensors)
    # A change of a few bytes inside a chunk rewrites that chunk whole, neighbours untouched.
    a.write(tensors[0][0] + 5, b"\x01\x02\x03")
    tensors[0][1][5:8] = b"\x01\x02\x03"
    rep = a.sleep("weights")
    assert rep["written_bytes"] == g and rep["skipped_bytes"] == size - g
    a.wake_up(None)
    _check(a, tensors)
    for addr2, _ in tensors:
        a.free(addr2)


@pytest.mark.parametrize("error", ["short", "enospc", "eio"])
def test_a_failed_rewrite_keeps_the_promises_at_every_write_position(retaining_files, error):
    """A rewrite of changed chunks that fails at its n-th write: each allocation is awake with its data or asleep
    with a complete backup; one left awake lost its (maybe half rewritten) retained backup, so its next sleep
    writes it whole; the data is right after every wake."""
    a = retaining_files
    g = a.granularity(0)
    tensors = _retained_file_backups(a, [2, 3, 2])
    fired = []
    for nth in range(1, 8):
        # Change the first chunk of every allocation and the last of the second: several writes per sleep.
        for i, (addr, data) in enumerate(tensors):
            spots = [0] + ([len(data) - g] if i == 1 else [])
            for at in spots:
                new = bytes((x + nth) % 256 for x in data[at : at + g])
                a.write(addr + at, new)
                data[at : at + g] = new
        failed, asleep = _sleep_with_a_failed_write(a, tensors, nth, error)
        fired += [nth] if failed else []
        awake = [len(d) for addr, d in tensors if addr not in asleep]
        a.wake_up(None)
        _check(a, tensors)
        # The next sleep: those left awake write whole (no retained backup), the others nothing (unchanged).
        rep = a.sleep("weights")
        assert rep["written_bytes"] == sum(awake), (nth, awake)
        a.wake_up(None)
        _check(a, tensors)
    _fired_at_the_first_writes(fired, 7)
    for addr, _ in tensors:
        a.free(addr)


def test_a_retained_file_backup_follows_a_policy_change_to_host(retaining_files):
    a = retaining_files
    tensors = _retained_file_backups(a, [2])
    a.set_tag_policy("weights", backup_tier="host")
    rep = a.sleep("weights")
    assert rep["written_bytes"] == 0 and a.stats()["file_tier_bytes"] == 0
    assert a.stats()["host_tier_bytes"] == len(tensors[0][1])
    a.wake_up(None)
    _check(a, tensors)
    a.free(tensors[0][0])


# --- the state machine with a small host budget and a spill directory ------------------------------------------


class _StatusAs:
    """An allocator whose `status()` answers `status`; everything else goes to the allocator."""

    def __init__(self, a: Allocator, status: dict) -> None:
        self._a, self._status = a, status

    def status(self) -> dict:
        return self._status

    def __getattr__(self, name: str):
        return getattr(self._a, name)


class Spilling:
    """Mixin for the allocator's state machines: a host budget of one granule and a spill directory, so that most
    backups go to files (and single-granule ones to host memory) and every sleep, wake, pause, resume, free and
    discard runs through the file tier with the model's promises unchanged. File backups are retained like host ones (a sleep
    rewrites only their changed chunks), so the model's exact count of retained backups and skipped chunks holds
    as on the host tier (`exact_skips` is the base machine's: off under fault injection).

    Reach over a whole run (every example) is counted on the machine's class: sleeps and pauses that backed
    anything up, and of them those that left backups in files; `assert_reach` checks it after the run."""

    #: Per run (the class is made per test): sleeps that backed something up, and those that left backups in files.
    backing_sleeps = 0
    file_sleeps = 0
    #: The least share of backing sleeps that must have written files over a run.
    MIN_FILE_SHARE = 0.25
    #: The host budget in granules. One for the plain machine: with two, whether a sleep spilled depended on how
    #: much cached host memory the budget still counted, and since a compressed sleep returns cached buffers it
    #: cannot use (placer.rs), runs spilled in as few as 13% of their backing sleeps (the reach check wants 25%: CI
    #: failed on it). The fault machines keep two (below).
    BUDGET_GRANULES = 1

    def __init__(self) -> None:
        super().__init__()  # type: ignore[call-arg]
        self.spill = tempfile.mkdtemp(prefix="cumem-rs-spill-")
        self.budget = self.BUDGET_GRANULES * self.gran[0]
        self.a.set_host_budget(self.budget)
        self.a.set_spill_dir(self.spill)
        self.a.set_staging_bytes(max(8 * 4096, self.gran[0] // 2))

    def _call(self, what: str, fn, *args, **kw):
        if what in ("sleep", "pause"):
            self.files_before = self.a.stats()["file_tier_bytes"]
        return super()._call(what, fn, *args, **kw)  # type: ignore[misc]

    def _released(self, report, awake, backed) -> None:
        super()._released(report, awake, backed)  # type: ignore[misc]
        if backed:
            # A file-tier sleep: it left backups in files (written now, or retained ones it kept unchanged).
            type(self).backing_sleeps += 1
            type(self).file_sleeps += self.a.stats()["file_tier_bytes"] > self.files_before

    @classmethod
    def assert_reach(cls) -> None:
        print(f"\n{cls.__name__}: {cls.file_sleeps} of {cls.backing_sleeps} sleeps that backed up used the file tier")
        assert cls.backing_sleeps > 0 and cls.file_sleeps >= cls.MIN_FILE_SHARE * cls.backing_sleeps, (
            f"only {cls.file_sleeps} of {cls.backing_sleeps} sleeps that backed anything up left backups in files"
        )

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def sleep_everything(self, data):
        """Wake all, then a sleep that backs up every tag there is (past the budget: files), or a pause of all:
        most other steps find little awake, and a file tier that no sleep reaches proves nothing."""
        if any(r.asleep for r in self.model.values()):
            self.wake_up(None)  # type: ignore[attr-defined]
        if data.draw(st.booleans(), label="pause"):
            self.pause(None)  # type: ignore[attr-defined]
        else:
            self.sleep(sorted({r.tag for r in self.model.values()}))  # type: ignore[attr-defined]

    @invariant()
    def tiers_hold_the_models_backups(self):
        """Each backup asleep is in one tier at its size: host plus file tier bytes are the model's backups asleep,
        the host tier within the budget (stored bytes: compressed ones count what they take)."""
        s = self.a.stats()
        asleep = sum(r.size for r in self.model.values() if r.asleep and r.backed_up)
        assert s["host_tier_bytes"] + s["file_tier_bytes"] == asleep, (
            f"host tier {s['host_tier_bytes']} + file tier {s['file_tier_bytes']} bytes, the model's backups "
            f"asleep {asleep}"
        )
        assert s["host_tier_stored_bytes"] <= self.budget, s

    @invariant()
    def host_memory_within_the_budget(self):
        assert self.a.host_bytes() <= 2 * self.gran[0]

    @invariant()
    def spill_files_are_never_visible(self):
        assert os.listdir(self.spill) == []

    @invariant()
    def spill_disk_blocks_are_those_of_backups(self):
        """The spill files hold disk only for backups still referenced (asleep in files, or retained, which may
        be in files), each rounded to whole blocks, plus a little file system metadata per file: a backup woken,
        freed or dropped, and what a failed sleep wrote for allocations that stayed awake, gave its blocks back."""
        files, disk = spill_files(self.a, self.spill)
        referenced = self.a.stats()["file_tier_bytes"]
        referenced += sum(t["retained_bytes"] for t in self.a.status()["tags"].values())
        slack = 4096 * len(self.a.allocations()) + (64 << 10) * files
        assert disk <= referenced + slack, (disk, referenced, files)

    @invariant()
    def status_matches_model(self):
        """The base machine's status check, after this one's own of `file_bytes` (a key the model does not know:
        the tier of each backup is the store's choice): within each tag's backups, summing to the stats'."""
        status = self.a.status()
        in_files = 0
        for tag, t in status["tags"].items():
            if "file_bytes" in t:
                file_bytes = t.pop("file_bytes")
                asleep = sum(r.size for r in self.model.values() if r.tag == tag and r.asleep and r.backed_up)
                assert 0 < file_bytes <= asleep, (tag, t, asleep)
                in_files += file_bytes
        assert in_files == self.a.stats()["file_tier_bytes"]
        real = self.a
        self.a = _StatusAs(real, status)
        try:
            super().status_matches_model()  # type: ignore[misc]
        finally:
            self.a = real

    def teardown(self):
        try:
            super().teardown()  # type: ignore[misc]
        finally:
            if not self.a.closed:
                self.a.set_host_budget(None)
                self.a.set_spill_dir(None)
                self.a.set_staging_bytes(256 << 20)
                self.a.trim_host()
            shutil.rmtree(self.spill, ignore_errors=True)


def _spilling_machine(backend: str) -> type:
    from test_state_machine import AllocatorMachine, machine_for

    return machine_for(backend, type("SpillingMachine", (Spilling, AllocatorMachine), {}))


def _faulty_spilling_machine() -> type:
    from test_faults import FaultyMachine

    class FaultySpillingMachine(Spilling, FaultyMachine):
        """The fault-injecting machine of test_faults.py (driver faults) on the file tier, plus a rule that makes
        a spill-file write or read fail (short, ENOSPC, EIO) at a random position of a sleep or wake: the failed
        call must leave what `_reconcile` allows (a wake changes nothing, a sleep only puts allocations to sleep
        with a complete backup), and everything still wakes with its data at teardown.

        Two granules of budget, as before: with one, the compressed variant found spill-file disk blocks kept
        after a pause failed at an injected unmap (1376256 bytes on disk for 65536 referenced, hypothesis seed
        165241124916236511454014101928425965764 of that budget); an open defect, not yet fixed."""

        BUDGET_GRANULES = 2

        spill_armed = ""  # the spill op armed ("write" or "read"), while its sleep or wake runs

        # One fault at a time, as in FaultyMachine: a driver fault armed beside it could fire in the rollback
        # (a refused unmap stays queued, mapped), which the model's invariants do not follow; one armed before
        # and not reached yet is cleared first.
        @rule(
            data=st.data(),
            op=st.sampled_from(["write", "read"]),
            nth=st.integers(1, 4),
            error=st.sampled_from(["short", "enospc", "eio"]),
        )
        def spill_fault_step(self, data, op, nth, error):
            """Everything awake with a byte changed, then a spill write failing in a sleep, or a clean sleep and
            a spill read failing in the wake of everything: both find files to write or read (allocations are
            added first while all of them would fit the host budget twice)."""
            self._settle()
            for _ in range(3):
                if sum(r.size for r in self._ours()) > 2 * self.budget:
                    break
                self.alloc(data)
            self._wake_and_touch(data)
            tags = self._draw_offload(data)
            if op == "read":
                self.sleep(tags)
                tags = None
            self.a.inject_spill_fault(op, nth, error)
            self.spill_armed = op
            self.tally.armed[f"spill {op}"] += 1
            try:
                (self.sleep if op == "write" else self.wake_up)(tags)
            finally:
                self.spill_armed = ""
                self.a.clear_spill_faults()

        def _faulted(self, what: str, err: Exception) -> bool:
            if self.spill_armed and "spill file" in str(err):
                self.tally.fired[(f"spill {self.spill_armed}", what, "raised")] += 1
                self.spill_armed = ""
                self._reconcile(what)
                return True
            return super()._faulted(what, err)

    return FaultySpillingMachine


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_machine_with_a_small_budget_and_a_spill_dir(backend):
    machine = _spilling_machine(backend)
    run_state_machine_as_test(machine, settings=settings(STATEFUL_SETTINGS, max_examples=100))
    machine.assert_reach()


@pytest.mark.usefixtures("raw_backups")
def test_faulty_state_machine_with_a_small_budget_and_a_spill_dir():
    from test_faults import run_faulty

    machine = _faulty_spilling_machine()
    run_faulty(machine, "FaultySpillingMachine (raw)", settings(STATEFUL_SETTINGS, max_examples=100))
    machine.assert_reach()


@pytest.mark.usefixtures("codec_on")  # the variant of the raw one above: compressing whatever CUMEM_RS_COMPRESS says
def test_faulty_state_machine_with_a_small_budget_a_spill_dir_and_compression():
    from test_faults import run_faulty

    compressed = []

    class Compressing(_faulty_spilling_machine()):  # type: ignore[misc]
        @invariant()
        def record_compressed_backups(self):
            compressed.append(self.a.stats()["compressed_bytes"] > 0)

    run_faulty(Compressing, "FaultySpillingMachine (compressed)", settings(STATEFUL_SETTINGS, max_examples=100))
    Compressing.assert_reach()
    assert any(compressed), "no step of the run held a compressed backup: the raw variant ran again"


def test_with_a_spill_dir_a_sleep_past_what_the_host_can_pin_spills_instead_of_being_refused(tmp_path):
    g = 64 << 10
    ring = 8 * 4096
    a = Allocator.simulated(devices=1, capacity=64 << 20, granularity=g, host_memory=3 * g + ring)
    try:
        a.set_staging_bytes(ring)
        tensors = [tensor(a, "weights", 2) for _ in range(4)]
        with pytest.raises(cumem_rs.CumemOutOfMemoryError):
            a.sleep("weights")  # no spill directory: the host RAM guard refuses, as before
        a.set_spill_dir(tmp_path)
        a.sleep("weights")
        s = a.stats()
        assert (s["host_tier_bytes"], s["file_tier_bytes"]) == (2 * g, 6 * g)
        a.wake_up(None)
        for addr, data in tensors:
            assert a.read(addr, len(data)) == data
    finally:
        a.close()


# --- compressed backups under a host budget ---------------------------------------------------------------------


def test_a_failed_compression_of_a_retained_compressed_backup_spills_what_its_raw_copy_does_not_fit(tmp_path):
    """The raw fallback of a failed compression includes the allocations with a retained compressed backup, which
    the tier plan had left out: it is planned again with them (their blob arena given back first), so what does
    not fit the budget goes to the spill file instead of the sleep being refused."""
    from test_compression import bf16_like

    g = 64 << 10
    a = Allocator.simulated(devices=1, capacity=64 << 20, granularity=g)
    try:
        a.set_host_budget(2 * g)
        a.set_spill_dir(tmp_path)
        a.set_staging_bytes(8 * 4096)
        big = bytearray(bf16_like(2 * g, 11))
        big_addr, _ = tensor(a, "weights", 2)
        a.write(big_addr, bytes(big))
        a.sleep("weights")
        assert a.stats()["compressed_raw_bytes"] == 2 * g  # compressed, in one blob arena
        a.wake_up(None)  # the compressed backup is retained
        small_addr, small = tensor(a, "weights", 1)
        big[:4096] = bytes(4096)  # a changed chunk: the sleep compresses it again
        a.write(big_addr, bytes(big[:4096]))
        a.inject_fault("compress", 1, "unknown")
        a.sleep("weights")
        assert any("compress" in e and "raw" in e for e in a.errors()), a.errors()
        s = a.stats()
        assert s["compressed_raw_bytes"] == 0
        assert s["host_tier_bytes"] + s["file_tier_bytes"] == 3 * g and s["file_tier_bytes"] > 0, s
        assert a.host_bytes() <= 2 * g
        a.wake_up(None)
        assert a.read(big_addr, len(big)) == bytes(big)
        assert a.read(small_addr, len(small)) == small
    finally:
        a.close()


def test_a_compressed_sleep_into_a_larger_cached_arena_stays_within_the_host_budget():
    """A compressed sleep whose blobs take a small part of the cached arena it was given moves them into an
    arena of their size: the cached one it leaves must not stay held beside it past the budget."""
    g = 64 << 10
    a = Allocator.simulated(devices=1, capacity=64 << 20, granularity=g)
    try:
        a.set_host_budget(2 * g)
        a.set_tag_policy("kv", compress="off")
        kv_addr, kv = tensor(a, "kv", 2)
        a.sleep("kv")  # raw: a 2-granule arena
        a.wake_up(None)  # ... which stays cached
        assert a.host_bytes() == 2 * g
        a.free(kv_addr)
        a.push_tag("weights")
        try:
            addr = a.malloc(g, 0)
        finally:
            a.pop_tag()
        a.write(addr, bytes(g))  # zeros: a blob of a few bytes, in the 2-granule cached arena
        a.sleep("weights")
        assert a.stats()["compressed_raw_bytes"] == g
        assert a.host_bytes() <= 2 * g
        a.wake_up(None)
        assert a.read(addr, g) == bytes(g)
    finally:
        a.close()
