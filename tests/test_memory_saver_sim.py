"""cumem_rs.memory_saver over the simulated device: torch_memory_saver 0.0.10's defaults (retain_cpu_backup off,
host memory returned at resume), retained backups, disk backup on the file tier, `_ensure_initialized`, and every
`TMS_*` environment variable with its bad values.

A saver here runs over `SimulatedPools` (the pool, policy and pause/resume calls of CuMemAllocator over a
simulated Allocator): a region tags the `Allocator.malloc` calls made inside it, as it tags torch's allocations on
a GPU, and everything below the region is the same engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("torch")

from cumem_rs import Allocator, CumemError, CumemValueError  # noqa: E402
from cumem_rs._sim_pools import SimulatedPools  # noqa: E402
from cumem_rs._tms_env import read_tms_env  # noqa: E402
from cumem_rs.memory_saver import TorchMemorySaver  # noqa: E402

MiB = 1 << 20
N = 4 * MiB

TMS_VARIABLES = (
    "TMS_INIT_ENABLE",
    "TMS_INIT_ENABLE_CPU_BACKUP",
    "TMS_INIT_ENABLE_DISK_BACKUP",
    "TMS_INIT_CPU_BACKUP_BACKEND",
    "TMS_RETAIN_CPU_BACKUP",
    "TMS_DISK_BACKUP_DIR",
    "TMS_DISK_BACKUP_CHUNK_MB",
)


@pytest.fixture(autouse=True)
def _no_tms_env(monkeypatch):
    """Each test starts without TMS_* variables (a developer's shell may have some)."""
    for name in TMS_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def sim() -> Iterator[Allocator]:
    a = Allocator.simulated(devices=1, capacity=64 * MiB, granularity=64 * 1024)
    try:
        yield a
    finally:
        a.close()


@pytest.fixture
def saver(sim) -> TorchMemorySaver:
    return TorchMemorySaver(_backend=SimulatedPools(sim))


def _alloc(saver: TorchMemorySaver, sim: Allocator, tag: str, fill: int, **region) -> int:
    with saver.region(tag, **region):
        address = sim.malloc(N)
    sim.write(address, bytes([fill]) * N)
    return address


# -- defaults and semantics of 0.0.10 ------------------------------------------------------------------------------


@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_retain_cpu_backup_is_off_by_default_and_resume_returns_the_host_memory(saver, sim):
    assert saver.retain_cpu_backup is False
    assert sim.keep_host_memory() is False, "the saver's default is the allocator's setting"
    w = _alloc(saver, sim, "w", 7, enable_cpu_backup=True)
    kv = _alloc(saver, sim, "kv", 9)
    saver.pause()
    assert sim.host_bytes() >= N, "the paused backup is held in host memory"
    assert saver._read_backup(w, N) == bytes([7]) * N
    saver.resume()
    assert sim.host_bytes() == 0, "resume kept host backup memory although retain_cpu_backup is False"
    assert sim.read(w, N) == bytes([7]) * N
    assert saver._read_backup(w, N) is None, "no backup after a resume that did not retain it"
    assert sim.usage() >= 2 * N and sim.read(kv, 1) is not None


@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_retained_backups_make_the_next_pause_copy_only_what_changed(saver, sim):
    saver.retain_cpu_backup = True
    assert saver.retain_cpu_backup is True and sim.keep_host_memory() is True
    w = _alloc(saver, sim, "w", 3, enable_cpu_backup=True)
    first = sim.pause("w")  # through the engine, for its report; the saver's pause is the same call
    assert first["copied_bytes"] == N
    saver.resume("w")
    assert sim.host_bytes() >= N, "retain_cpu_backup=True returned the host memory"
    second = sim.pause("w")
    assert (second["copied_bytes"], second["skipped_bytes"]) == (0, N), "an unchanged backup was copied again"
    saver.resume("w")
    sim.write(w, b"\x01")  # one changed chunk is copied again, the rest is not
    third = sim.pause("w")
    assert 0 < third["copied_bytes"] < N and third["copied_bytes"] + third["skipped_bytes"] == N
    saver.resume("w")
    assert sim.read(w, 2) == b"\x01\x03"

    saver.retain_cpu_backup = False  # consulted at the next resume
    saver.pause("w")
    saver.resume("w")
    assert sim.host_bytes() == 0
    assert sim.read(w, 2) == b"\x01\x03"


def test_memory_without_backup_keeps_its_address_and_is_not_backed_up(saver, sim):
    kv = _alloc(saver, sim, "kv", 5)
    saver.pause("kv")
    assert sim.host_bytes() == 0 and sim.status()["tags"]["kv"]["state"] == "asleep"
    with pytest.raises(Exception, match="without CPU backup"):
        saver._read_backup(kv, N)
    saver.resume("kv")
    assert [a["address"] for a in sim.allocations()] == [kv]


def test_ensure_initialized_is_idempotent_and_reads_the_environment_once(saver, sim, monkeypatch):
    assert saver._alloc is None, "nothing is set up before the first use"
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "1")
    saver._ensure_initialized()
    alloc = saver._alloc
    assert alloc is not None and sim.keep_host_memory() is True
    saver.retain_cpu_backup = False
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "bogus")
    saver._ensure_initialized()  # a second call changes nothing and reads nothing
    assert saver._alloc is alloc and saver.retain_cpu_backup is False


# -- disk backup: the file tier ------------------------------------------------------------------------------------


def test_disk_backup_goes_to_files_in_the_disk_backup_dir(saver, sim, tmp_path):
    target = tmp_path / "made" / "here"
    saver.set_disk_backup_dir(str(target))
    assert target.is_dir(), "the directory is created, as torch_memory_saver does"
    assert sim.spill_dir == target
    d = _alloc(saver, sim, "disk", 4, enable_disk_backup=True)
    assert sim.tag_policy("disk")["backup_tier"] == "file"
    for _ in range(3):
        saver.pause("disk")
        assert sim.stats()["file_tier_bytes"] == N and sim.host_bytes() == 0
        assert saver._read_backup(d, 2) == b"\x04\x04"
        saver.resume("disk")
        assert sim.read(d, N) == bytes([4]) * N
    assert sim.stats()["file_tier_bytes"] == 0


def test_disk_backup_without_a_directory_uses_the_system_temp_dir(saver, sim, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    d = _alloc(saver, sim, "disk", 6, enable_disk_backup=True)
    assert sim.spill_dir == tmp_path
    saver.pause("disk")
    assert sim.stats()["file_tier_bytes"] == N
    saver.resume("disk")
    assert sim.read(d, 1) == b"\x06"


def test_disk_backup_dir_that_cannot_be_used_is_a_clear_error(saver, sim, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(CumemValueError, match="path="):
        saver.set_disk_backup_dir(str(blocker))
    assert sim.spill_dir is None


def test_one_tag_holds_memory_with_each_backup_setting(saver, sim, tmp_path):
    """torch_memory_saver records the backup setting per allocation: one tag may hold memory with CPU backup, disk
    backup and none (its test_cpu_backup uses "default" for both). pause(tag) pauses all of it; resume restores
    what had a backup, and what had none comes back undefined (the sim's poison byte)."""
    saver.set_disk_backup_dir(str(tmp_path))
    cpu = _alloc(saver, sim, "t", 1, enable_cpu_backup=True)
    disk = _alloc(saver, sim, "t", 2, enable_disk_backup=True)
    none = _alloc(saver, sim, "t", 3)
    again = _alloc(saver, sim, "t", 4, enable_cpu_backup=True)  # the same setting again: the same allocator tag
    by_address = {a["address"]: a for a in sim.allocations()}
    assert by_address[cpu]["tag"] == by_address[again]["tag"] == "t"
    assert len({by_address[x]["tag"] for x in (cpu, disk, none)}) == 3
    saver.pause("t")
    assert all(a["asleep"] for a in sim.allocations())
    assert sim.stats()["file_tier_bytes"] == N
    saver.resume("t")
    assert not any(a["asleep"] for a in sim.allocations())
    assert sim.read(cpu, N) == b"\x01" * N and sim.read(again, N) == b"\x04" * N
    assert sim.read(disk, N) == b"\x02" * N
    assert sim.read(none, 1) != b"\x03"


def test_a_region_tag_that_looks_like_a_derived_one_stays_apart(saver, sim):
    a = _alloc(saver, sim, "t", 1, enable_cpu_backup=True)
    b = _alloc(saver, sim, "t[no_backup]", 2, enable_cpu_backup=True)
    c = _alloc(saver, sim, "t", 3)  # needs an allocator tag of its own: not the region tag "t[no_backup]"
    tags = {x["address"]: x["tag"] for x in sim.allocations()}
    assert len({tags[a], tags[b], tags[c]}) == 3
    saver.pause("t[no_backup]")
    asleep = {x["address"] for x in sim.allocations() if x["asleep"]}
    assert asleep == {b}
    saver.resume("t[no_backup]")
    assert sim.read(b, N) == b"\x02" * N


# -- the TMS_* environment ------------------------------------------------------------------------------------------


def test_environment_defaults_are_torch_memory_saver_s():
    env = read_tms_env({})
    assert (env.init_enable, env.init_enable_cpu_backup, env.init_enable_disk_backup) == (False, False, False)
    assert (env.init_cpu_backup_backend, env.retain_cpu_backup) == ("pinned", False)
    assert (env.disk_backup_dir, env.disk_backup_chunk_mb) == (None, None)


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("YES", True), ("0", False), ("no", False)])
@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_tms_retain_cpu_backup_sets_the_initial_retain(saver, sim, monkeypatch, value, expected):
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", value)
    assert saver.retain_cpu_backup is expected
    w = _alloc(saver, sim, "w", 2, enable_cpu_backup=True)
    saver.pause()
    saver.resume()
    assert (sim.host_bytes() >= N) is expected
    assert sim.read(w, 1) == b"\x02"


@pytest.mark.parametrize("name", ["TMS_INIT_ENABLE_CPU_BACKUP", "TMS_INIT_ENABLE_DISK_BACKUP"])
def test_tms_init_backup_flags_are_read_and_checked(saver, monkeypatch, name):
    # They choose the backup of allocations outside regions, which only TMS_INIT_ENABLE routes (see below).
    monkeypatch.setenv(name, "1")
    saver._ensure_initialized()
    field = "init_enable_cpu_backup" if "CPU" in name else "init_enable_disk_backup"
    assert getattr(saver._env, field) is True


@pytest.mark.parametrize("value", ["mmap", "pinned", ""])
def test_tms_init_cpu_backup_backend_is_read(saver, monkeypatch, value):
    monkeypatch.setenv("TMS_INIT_CPU_BACKUP_BACKEND", value)
    saver._ensure_initialized()
    assert saver._env.init_cpu_backup_backend == (value or "pinned")


def test_tms_disk_backup_dir_is_the_spill_dir_created_if_needed(saver, sim, tmp_path, monkeypatch):
    target = tmp_path / "tms_dir"
    monkeypatch.setenv("TMS_DISK_BACKUP_DIR", str(target))
    d = _alloc(saver, sim, "disk", 8, enable_disk_backup=True)
    assert target.is_dir() and sim.spill_dir == target
    saver.pause("disk")
    assert sim.stats()["file_tier_bytes"] == N
    saver.resume("disk")
    assert sim.read(d, 1) == b"\x08"


@pytest.mark.parametrize("value,mib", [("1", 1), ("3", 3), ("0", 256)])
def test_tms_disk_backup_chunk_mb_is_the_staging_ring_size(saver, sim, tmp_path, monkeypatch, value, mib):
    monkeypatch.setenv("TMS_DISK_BACKUP_CHUNK_MB", value)
    saver.set_disk_backup_dir(str(tmp_path))
    d = _alloc(saver, sim, "disk", 5, enable_disk_backup=True)
    saver.pause("disk")
    assert sim.stats()["staging_bytes"] == mib * MiB
    saver.resume("disk")
    assert sim.read(d, N) == bytes([5]) * N


def test_tms_init_enable_names_the_missing_preload_hook(saver, monkeypatch):
    # This process was not started with the preload library (test_preload.py runs children that were).
    monkeypatch.setenv("TMS_INIT_ENABLE", "1")
    with pytest.raises(CumemError, match="preload hook") as info:
        saver.region("w").__enter__()
    assert "TMS_INIT_ENABLE" in str(info.value) and "configure_subprocess" in str(info.value)
    assert saver._alloc is None
    monkeypatch.setenv("TMS_INIT_ENABLE", "0")  # off: nothing is routed outside regions, as there
    saver._ensure_initialized()
    assert saver._env.init_enable is False


BAD_VALUES = [
    ("TMS_INIT_ENABLE", "2"),
    ("TMS_INIT_ENABLE_CPU_BACKUP", "on"),
    ("TMS_INIT_ENABLE_DISK_BACKUP", ""),
    ("TMS_RETAIN_CPU_BACKUP", "True"),  # torch_memory_saver takes true and TRUE only
    ("TMS_INIT_CPU_BACKUP_BACKEND", "disk"),
    ("TMS_DISK_BACKUP_CHUNK_MB", "-1"),
    ("TMS_DISK_BACKUP_CHUNK_MB", "1.5"),
    ("TMS_DISK_BACKUP_CHUNK_MB", "lots"),
    ("TMS_DISK_BACKUP_DIR", ""),
]


@pytest.mark.parametrize("name,value", BAD_VALUES)
def test_a_bad_value_is_a_clear_error_naming_the_variable(saver, sim, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    for call in (saver._ensure_initialized, lambda: saver.retain_cpu_backup, saver.pause):
        with pytest.raises(CumemValueError, match=name):
            call()
    assert saver._alloc is None and sim.keep_host_memory() is True, "a refused set-up changed something"
    monkeypatch.delenv(name)
    saver._ensure_initialized()  # fixed, the next call succeeds
    assert saver._alloc is not None


def test_tms_disk_backup_dir_that_cannot_be_used_names_the_variable(saver, sim, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("TMS_DISK_BACKUP_DIR", str(blocker / "below"))
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "0")
    for _ in range(2):  # refused, and refused again: nothing was half set up
        with pytest.raises(CumemValueError, match="TMS_DISK_BACKUP_DIR"):
            saver._ensure_initialized()
    assert saver._alloc is None and sim.keep_host_memory() is True and sim.spill_dir is None


def test_both_init_backups_are_refused(saver, monkeypatch):
    monkeypatch.setenv("TMS_INIT_ENABLE_CPU_BACKUP", "1")
    monkeypatch.setenv("TMS_INIT_ENABLE_DISK_BACKUP", "1")
    with pytest.raises(CumemValueError, match="mutually exclusive"):
        saver._ensure_initialized()


# A script as torch_memory_saver's examples write them: the variables are set after the import and before the
# first call, which is when both read them.
CHILD = textwrap.dedent(
    """
    import os, sys
    from cumem_rs import Allocator
    from cumem_rs._sim_pools import SimulatedPools
    from cumem_rs.memory_saver import torch_memory_saver

    sim = Allocator.simulated(devices=1, capacity=64 << 20, granularity=64 << 10)
    torch_memory_saver._backend = SimulatedPools(sim)
    os.environ.update(dict(arg.split("=", 1) for arg in sys.argv[1:]))
    try:
        torch_memory_saver._ensure_initialized()
    except Exception as e:
        print(f"{type(e).__name__}: {e}")
        sys.exit(3)
    print(torch_memory_saver.retain_cpu_backup, sim.keep_host_memory())
    """
)


def _child(*assignments: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_")}
    return subprocess.run(
        [sys.executable, "-c", CHILD, *assignments], env=env, capture_output=True, text=True, timeout=120
    )


def test_variables_set_after_import_are_read_at_first_use_in_a_child_process():
    out = _child("TMS_RETAIN_CPU_BACKUP=1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]
    out = _child()
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize(
    "assignment,message",
    [("TMS_INIT_ENABLE=1", "CumemError: TMS_INIT_ENABLE=1"), ("TMS_RETAIN_CPU_BACKUP=maybe",
                                                                        "CumemValueError: TMS_RETAIN_CPU_BACKUP")],
)
def test_a_refused_environment_raises_in_a_child_process_and_never_aborts_it(assignment, message):
    out = _child(assignment)
    assert out.returncode == 3, (out.stdout, out.stderr)  # the script caught the exception: no abort, no exit(1)
    assert out.stdout.startswith(message)


TMS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "torch_memory_saver.md"


@pytest.mark.skipif(not TMS_PAGE.is_file(), reason="needs the source tree (docs/torch_memory_saver.md)")
def test_docs_name_every_variable():
    page = TMS_PAGE.read_text()
    section = page[page.index("## The `TMS_*` environment"):]
    table = section[section.index("| variable |"):]
    for name in TMS_VARIABLES:
        assert f"| `{name}` |" in table, f"{name} is not a row of the TMS_* table in docs/torch_memory_saver.md"


# -- torch_memory_saver's C-level state getters (`_impl._binary_wrapper.cdll`) -------------------------------------


def test_state_getters_follow_regions_nesting_and_disable(saver, sim):
    saver._ensure_initialized()
    c = saver._impl._binary_wrapper.cdll
    assert not c.tms_get_interesting_region() and not c.tms_get_enable_cpu_backup()
    assert (c.tms_get_current_tag(), c.tms_get_cpu_backup_backend()) == (b"default", b"pinned")
    with saver.region("outer", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        assert c.tms_get_interesting_region() and c.tms_get_enable_cpu_backup()
        assert (c.tms_get_current_tag(), c.tms_get_cpu_backup_backend()) == (b"outer", b"mmap")
        with saver.region("inner"):
            assert c.tms_get_interesting_region() and not c.tms_get_enable_cpu_backup()
            assert (c.tms_get_current_tag(), c.tms_get_cpu_backup_backend()) == (b"inner", b"pinned")
            with saver.disable():
                assert not c.tms_get_interesting_region()
            assert c.tms_get_current_tag() == b"inner"
        assert c.tms_get_current_tag() == b"outer"
        seen: list[bool] = []
        t = threading.Thread(target=lambda: seen.append(c.tms_get_interesting_region()))
        t.start()
        t.join()
        assert seen == [False], "regions are per thread"
    assert not c.tms_get_interesting_region() and c.tms_get_current_tag() == b"default"
    assert saver._impl is saver._impl


def test_state_getters_read_the_backend_from_the_environment(saver, sim, monkeypatch):
    monkeypatch.setenv("TMS_INIT_CPU_BACKUP_BACKEND", "mmap")
    saver._ensure_initialized()
    c = saver._impl._binary_wrapper.cdll
    assert c.tms_get_cpu_backup_backend() == b"mmap"
    with saver.region(enable_cpu_backup=True):
        assert c.tms_get_cpu_backup_backend() == b"mmap"
    with saver.region("p", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        assert c.tms_get_cpu_backup_backend() == b"pinned"


def test_other_names_of_the_state_library_come_from_the_global_symbol_scope(saver):
    c = saver._impl._binary_wrapper.cdll
    assert callable(c.malloc), "libc's malloc, as dlsym on torch_memory_saver's library handle would find it"
    with pytest.raises(AttributeError):
        c.no_such_symbol_anywhere
