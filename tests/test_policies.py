"""Tag policies, pause/resume of single tags, status and backup reads through the Python API of the core allocator.

Runs on every backend (sim always, the process-wide CUDA allocator with a GPU). The state machine in
test_state_machine.py drives the same calls at random against a model; these are the readable, targeted cases.
"""

from __future__ import annotations

import pytest

import cumem_rs
from cumem_rs import Allocator, ClosedError, CumemError
from conftest import MiB

DEFAULT_POLICY = {"backup": None, "wake_fill": "undefined"}


@pytest.fixture
def clean_policies(alloc):
    """The tags these tests use, with default policies before and after (the CUDA allocator is process-wide)."""
    tags = ("p_weights", "p_kv", "p_other", "p_idle")
    for t in tags:
        alloc.set_tag_policy(t)
    yield alloc
    for t in tags:
        alloc.set_tag_policy(t)


def _alloc_under(a: Allocator, tag: str, size: int, fill: int) -> int:
    a.push_tag(tag)
    try:
        addr = a.malloc(size)
    finally:
        a.pop_tag()
    a.write(addr, bytes([fill]) * size)
    return addr


def test_policy_round_trip_and_default_clears(clean_policies):
    a = clean_policies
    a.set_tag_policy("p_idle", backup=False, wake_fill="zero")
    assert a.tag_policy("p_idle") == {"backup": False, "wake_fill": "zero"}
    assert a.status()["tags"]["p_idle"] == {
        "backup": False, "wake_fill": "zero", "allocations": 0, "mapped_bytes": 0, "asleep_bytes": 0,
        "backup_bytes": 0, "retained_bytes": 0, "state": "awake",
    }
    a.set_tag_policy("p_idle")  # the defaults clear it
    assert a.tag_policy("p_idle") == DEFAULT_POLICY
    assert "p_idle" not in a.status()["tags"]


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"tag": 5}, TypeError, "tag"),
        ({"tag": ""}, ValueError, "tag"),
        ({"tag": "p_kv", "backup": 1}, TypeError, "backup"),
        ({"tag": "p_kv", "backup": "yes"}, TypeError, "backup"),
        ({"tag": "p_kv", "wake_fill": "zeros"}, ValueError, "wake_fill"),
        ({"tag": "p_kv", "wake_fill": 0}, TypeError, "wake_fill"),
    ],
)
def test_bad_policy_arguments_change_nothing(clean_policies, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        clean_policies.set_tag_policy(**kwargs)
    assert clean_policies.tag_policy("p_kv") == DEFAULT_POLICY


@pytest.mark.parametrize("method", ["pause", "resume"])
@pytest.mark.parametrize("tags,exc", [(5, TypeError), ([b"p_kv"], TypeError), (["p_kv", ""], ValueError)])
def test_bad_tags_for_pause_and_resume(clean_policies, method, tags, exc):
    a = clean_policies
    addr = _alloc_under(a, "p_kv", 4096, 1)
    with pytest.raises(exc):
        getattr(a, method)(tags)
    assert a.status()["tags"]["p_kv"]["state"] == "awake"
    a.free(addr)


def test_pause_resume_one_tag_and_status_on_the_way(clean_policies):
    a = clean_policies
    g = a.granularity()
    a.set_tag_policy("p_kv", backup=False, wake_fill="zero")
    w = _alloc_under(a, "p_weights", 3 * g, 0x11)
    kv = _alloc_under(a, "p_kv", 2 * g, 0x22)
    other = _alloc_under(a, "p_other", g, 0x33)
    usage = a.usage()

    r = a.pause(["p_weights", "p_kv"])
    assert (r["allocations"], r["copied_bytes"], r["discarded_bytes"]) == (2, 3 * g, 2 * g)
    assert a.usage() == usage - 5 * g
    s = a.status()
    assert s["is_sleeping"]
    assert {t: s["tags"][t]["state"] for t in ("p_weights", "p_kv", "p_other")} == {
        "p_weights": "asleep", "p_kv": "asleep", "p_other": "awake",
    }
    assert s["tags"]["p_weights"]["backup_bytes"] == 3 * g and s["tags"]["p_kv"]["backup_bytes"] == 0
    assert a.read(other, g) == b"\x33" * g, "the tag left running lost its data"
    assert a.pause("p_weights")["allocations"] == 0, "pausing a paused tag is a no-op"

    r = a.resume("p_kv")
    assert (r["allocations"], r["zeroed_bytes"]) == (1, 2 * g)
    assert a.read(kv, 2 * g) == bytes(2 * g), "zero wake fill"
    assert a.status()["tags"]["p_weights"]["state"] == "asleep", "resume woke a tag it was not given"
    r = a.resume()
    assert (r["allocations"], r["copied_bytes"]) == (1, 3 * g)
    assert a.read(w, 3 * g) == b"\x11" * 3 * g
    assert a.resume("p_weights")["allocations"] == 0, "resuming an awake tag is a no-op"
    for addr in (w, kv, other):
        a.free(addr)


def test_read_backup(clean_policies):
    a = clean_policies
    a.set_tag_policy("p_kv", backup=False)
    a.set_tag_policy("p_weights", compress="off")  # raw: readable on the host on every driver (see below)
    w = _alloc_under(a, "p_weights", 8192, 0x44)
    a.write(w + 100, b"hello")
    kv = _alloc_under(a, "p_kv", 4096, 0x55)
    assert a.read_backup(w, 16) is None, "awake: nothing to read"
    a.pause(["p_weights", "p_kv"])
    assert a.read_backup(w + 100, 5) == b"hello"
    assert a.read_backup(w, 0) == b""
    with pytest.raises(CumemError, match="without a backup"):
        a.read_backup(kv, 1)
    with pytest.raises(ValueError, match="not inside"):
        a.read_backup(w + a.granularity() - 1, 2)
    with pytest.raises(TypeError):
        a.read_backup("w", 1)
    a.resume()
    for addr in (w, kv):
        a.free(addr)


@pytest.mark.usefixtures("codec_on")  # a simulated allocator compresses whatever CUMEM_RS_COMPRESS says
def test_read_backup_of_a_compressed_backup(clean_policies):
    """The sim's codec decodes on the host; a backup the GPU compressed (nvCOMP) only a wake restores: reading
    it is a clear CumemError, and the backup stays intact for the resume. (A GPU without nvCOMP stores raw.)"""
    a = clean_policies
    w = _alloc_under(a, "p_weights", 1 << 20, 0x44)
    a.pause(["p_weights"])
    try:
        if a.backend == "sim":
            s = a.stats()
            assert s["compressed_raw_bytes"] == 1 << 20 and 0 < s["compressed_bytes"] < 1 << 20, s
            assert a.read_backup(w, 16) == b"\x44" * 16
            assert a.read_backup(w + (1 << 20) - 16, 16) == b"\x44" * 16
        elif a.stats()["codec"] is None:
            assert a.read_backup(w, 16) == b"\x44" * 16
        else:
            with pytest.raises(CumemError, match="only a wake restores"):
                a.read_backup(w, 16)
    finally:
        a.resume()
    assert a.read(w, 16) == b"\x44" * 16
    a.free(w)


def test_sleep_without_tags_follows_policies(clean_policies):
    a = clean_policies
    a.set_tag_policy("p_weights", backup=True)
    w = _alloc_under(a, "p_weights", 4096, 0x66)
    o = _alloc_under(a, "p_other", 4096, 0x77)
    r = a.sleep()
    assert r["copied_bytes"] >= a.granularity(), r
    rows = {x["address"]: x for x in a.allocations()}
    assert rows[w]["backed_up"] and not rows[o]["backed_up"]
    a.wake_up()
    assert a.read(w, 4096) == b"\x66" * 4096
    for addr in (w, o):
        a.free(addr)


def test_keep_host_memory_reads_back(clean_policies):
    a = clean_policies
    before = a.keep_host_memory()
    try:
        a.set_keep_host_memory(False)
        assert a.keep_host_memory() is False
        a.set_keep_host_memory(True)
        assert a.keep_host_memory() is True
    finally:
        a.set_keep_host_memory(before)


@pytest.mark.parametrize(
    "method,args",
    [("set_tag_policy", ("t",)), ("tag_policy", ("t",)), ("pause", ()), ("resume", ()), ("status", ()),
     ("read_backup", (0x1000, 1))],
)
def test_policy_calls_after_close(sim, method, args):
    sim.close()
    with pytest.raises(ClosedError):
        getattr(sim, method)(*args)


def test_summary_line_names_states_and_policies(sim):
    pytest.importorskip("torch")
    from cumem_rs.allocator import _summary

    sim.set_tag_policy("kv", backup=False, wake_fill="zero")
    sim.set_tag_policy("unused", backup=True)  # no allocations: left out of the line
    assert _summary(sim.status()) == "awake: 0 B mapped, 0 B asleep (0 B backed up); no tags"
    _alloc_under(sim, "weights", 3 * MiB, 1)
    _alloc_under(sim, "kv", MiB, 2)
    assert _summary(sim.status()).startswith("awake: ")
    sim.pause("kv")
    line = _summary(sim.status())
    assert "\n" not in line
    assert line.startswith("sleeping: 3.00 MiB mapped, 1.00 MiB asleep (0 B backed up); "), line
    assert line.endswith("kv=asleep[backup=False,wake_fill=zero] weights=awake"), line


def test_fault_in_zero_fill_leaves_pause_undone_until_retried(sim):
    sim.set_tag_policy("kv", wake_fill="zero", backup=False)
    kv = _alloc_under(sim, "kv", 4096, 9)
    sim.pause("kv")
    sim.inject_fault("memset_zero", 1, "unknown")
    with pytest.raises(cumem_rs.DriverError, match="memset_zero"):
        sim.resume("kv")
    assert sim.status()["tags"]["kv"]["state"] == "asleep" and sim.usage() == 0
    sim.resume("kv")
    assert sim.read(kv, 4096) == bytes(4096)
