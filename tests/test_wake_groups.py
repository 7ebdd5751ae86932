"""Wake groups: neighbouring allocations of one tag, woken together, share one physical handle and one mapping.

Checked on the simulated driver (CI) and on CUDA: which allocations are grouped, that contents and addresses
survive, that freeing members returns their memory once the last member goes (or the group sleeps), that sleep,
discard and pause release groups whole, and that turning groups off maps every allocation on its own.
"""

from __future__ import annotations

import os

import pytest

from cumem_rs import CumemError
from conftest import live_counts


def fill(a, addr: int, size: int, seed: int) -> bytes:
    data = bytes((seed * 131 + i * 7) % 251 for i in range(min(size, 4096))) * (size // min(size, 4096))
    data = data[:size]
    a.write(addr, data)
    return data


def make(a, tag: str, count: int, units: int = 1) -> tuple[list[int], dict[int, bytes]]:
    g = a.granularity(0)
    a.push_tag(tag)
    try:
        addrs = [a.malloc(units * g) for _ in range(count)]
    finally:
        a.pop_tag()
    return addrs, {p: fill(a, p, units * g, i) for i, p in enumerate(addrs)}


def check(a, data: dict[int, bytes]) -> None:
    for p, d in data.items():
        assert a.read(p, len(d)) == d, f"contents of {p:#x} changed"


def sim_handles(a) -> int:
    return live_counts(a)["handles"] if a.backend == "sim" else -1


def expected_groups(addrs: list[int], size: int, limit: int) -> int:
    """Groups the rule forms over allocations of one tag and size: runs of address neighbours, at most `limit`
    bytes each, runs of one not counted. (On the simulated driver the allocations are always neighbours; on a
    shared CUDA allocator earlier tests may leave holes that new allocations fill.)"""
    groups, run = 0, 0
    for i, p in enumerate(sorted(addrs)):
        if run and sorted(addrs)[i - 1] + size == p and (run + 1) * size <= limit:
            run += 1
        else:
            groups += run > 1
            run = 1
    return groups + (run > 1)


@pytest.fixture(autouse=True)
def restore_group_size(alloc_or_sim):
    before = alloc_or_sim.wake_group_bytes
    yield
    if not alloc_or_sim.closed:
        alloc_or_sim.set_wake_group_bytes(before)


@pytest.fixture
def alloc_or_sim(request):
    if "raw_backups" in request.fixturenames:
        request.getfixturevalue("raw_backups")  # before the allocator is made
    return request.getfixturevalue("alloc" if "alloc" in request.fixturenames else "sim")


def test_neighbours_of_one_tag_share_a_handle_after_wake(alloc):
    a = alloc
    g = a.granularity(0)
    a.set_wake_group_bytes(4 * g)
    addrs, data = make(a, "weights", 10)
    if a.backend == "sim":
        assert [q - p for p, q in zip(addrs, addrs[1:])] == [g] * 9, "allocations in order are not side by side"
    assert a.stats()["wake_groups"] == 0, "malloc made a group"
    a.sleep("weights")
    assert a.stats()["wake_groups"] == 0
    a.wake_up()
    s = a.stats()
    # 10 neighbours, at most 4 granules per group: 4 + 4 + 2.
    want = expected_groups(addrs, g, 4 * g)
    assert want == 3 or a.backend == "cuda"
    assert s["wake_groups"] == want, s
    if a.backend == "sim":
        assert sim_handles(a) == 3
    check(a, data)
    assert [r["address"] for r in a.allocations() if r["address"] in data] == sorted(addrs)
    # The next cycle releases and rebuilds them; contents still intact.
    a.sleep("weights")
    assert a.stats()["wake_groups"] == 0
    a.wake_up()
    check(a, data)
    for p in addrs:
        a.free(p)
    assert a.stats()["wake_groups"] == 0 and a.stats()["unreturned_bytes"] == 0


def test_groups_never_span_tags_or_gaps(alloc):
    a = alloc
    g = a.granularity(0)
    a.set_wake_group_bytes(64 * g)
    w, wd = make(a, "weights", 3)
    k, kd = make(a, "kv_cache", 3)
    w2, w2d = make(a, "weights", 3)
    a.free(w2[1])  # a gap between w2[0] and w2[2]
    del w2d[w2[1]]
    a.sleep(["weights", "kv_cache"])
    a.wake_up()
    # weights w (3) | kv (3) | w2[0] | w2[2]: w2[0] touches kv's end but has another tag.
    assert a.stats()["wake_groups"] == 2, a.stats()
    if a.backend == "sim":
        assert sim_handles(a) == 4
    check(a, {**wd, **kd, **w2d})


def test_freed_members_come_back_with_the_last_member(alloc):
    a = alloc
    g = a.granularity(0)
    a.set_wake_group_bytes(8 * g)
    u0 = a.usage()  # on CUDA the process-wide allocator may hold other allocations
    addrs, data = make(a, "weights", 4)
    a.sleep("weights")
    a.wake_up()
    assert a.stats()["wake_groups"] == 1
    mapped0 = live_counts(a)["mapped_bytes"] if a.backend == "sim" else None
    a.free(addrs[1])
    a.free(addrs[3])
    s = a.stats()
    assert s["unreturned_bytes"] == 2 * g and s["wake_groups"] == 1, s
    assert a.usage() == u0 + 2 * g
    if mapped0 is not None:
        assert live_counts(a)["mapped_bytes"] == mapped0, "the group's memory is held until its last member goes"
    check(a, {p: data[p] for p in (addrs[0], addrs[2])})
    # The freed addresses are not handed out again while the group still maps them.
    fresh = a.malloc(g)
    assert fresh not in (addrs[1], addrs[3])
    a.free(fresh)
    a.free(addrs[0])
    a.free(addrs[2])
    s = a.stats()
    assert (s["unreturned_bytes"], s["wake_groups"]) == (0, 0), s
    if a.backend == "sim":
        c = live_counts(a)
        assert (c["ranges"], c["handles"], c["mapped_bytes"]) == (0, 0, 0), c


def test_a_group_with_freed_members_sleeps_whole_and_returns_them(alloc):
    a = alloc
    g = a.granularity(0)
    a.set_wake_group_bytes(8 * g)
    addrs, data = make(a, "weights", 4)
    a.sleep("weights")
    a.wake_up()
    a.free(addrs[0])
    del data[addrs[0]]
    assert a.stats()["unreturned_bytes"] == g
    others = sum(not r["asleep"] for r in a.allocations()) - 3  # awake allocations of other tests (CUDA)
    r = a.sleep("weights")
    assert r["allocations"] == 3 + others, r
    if a.backend == "sim":
        assert r["copied_bytes"] + r["skipped_bytes"] == 3 * g, r
    assert a.stats()["unreturned_bytes"] == 0 and a.stats()["wake_groups"] == 0
    if a.backend == "sim":
        assert live_counts(a)["mapped_bytes"] == 0
    # The freed member's addresses are free again: the next allocation of its size lands there (the lowest
    # hole; on a shared CUDA allocator an earlier hole may come first).
    again = a.malloc(g)
    assert again == addrs[0] or a.backend == "cuda"
    a.free(again)
    a.wake_up()
    check(a, data)


def test_discard_and_pause_release_groups_whole(alloc):
    a = alloc
    g = a.granularity(0)
    a.set_wake_group_bytes(8 * g)
    u0 = a.usage()
    k, _ = make(a, "kv_cache", 4)
    w, wd = make(a, "weights", 4)
    a.sleep("weights")
    a.wake_up()
    assert a.stats()["wake_groups"] == 2
    r = a.discard("kv_cache")
    assert r["allocations"] == 4 and r["discarded_bytes"] == 4 * g, r
    assert a.stats()["wake_groups"] == 1
    r = a.pause("weights")
    assert r["allocations"] == 4 and a.stats()["wake_groups"] == 0, r
    a.resume("weights")
    check(a, wd)
    assert a.usage() == u0 + 4 * g


def test_groups_off_maps_each_allocation_on_its_own(alloc):
    a = alloc
    a.set_wake_group_bytes(0)
    assert a.wake_group_bytes == 0
    addrs, data = make(a, "weights", 6)
    a.sleep("weights")
    a.wake_up()
    assert a.stats()["wake_groups"] == 0
    if a.backend == "sim":
        assert sim_handles(a) == 6
    a.free(addrs[2])
    assert a.stats()["unreturned_bytes"] == 0, "without groups a free returns its memory at once"
    del data[addrs[2]]
    check(a, data)


def test_group_size_is_validated(sim):
    with pytest.raises(ValueError, match="nbytes"):
        sim.set_wake_group_bytes(-1)
    with pytest.raises(TypeError):
        sim.set_wake_group_bytes("big")
    sim.close()
    with pytest.raises(CumemError):
        sim.set_wake_group_bytes(1 << 20)


@pytest.mark.parametrize("op", ["create", "map", "set_access", "copy_h2d"])
@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_a_failed_group_wake_is_undone_and_retried(sim, op):
    a = sim
    g = a.granularity(0)
    a.set_wake_group_bytes(4 * g)
    addrs, data = make(a, "weights", 8)
    a.sleep("weights")
    before = live_counts(a)
    a.inject_fault(op, 2)  # the second group's call
    with pytest.raises(CumemError):
        a.wake_up()
    assert live_counts(a) == before, "a failed wake left something mapped"
    assert all(r["asleep"] for r in a.allocations())
    a.wake_up()
    assert a.stats()["wake_groups"] == 2
    check(a, data)


@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_a_failed_copy_keeps_a_whole_group_awake(sim):
    """A member whose backup copy failed keeps its whole group (its neighbours included) awake with its data."""
    a = sim
    g = a.granularity(0)
    a.set_wake_group_bytes(4 * g)
    a.set_retain_backups(False)
    a.set_pin_chunk(g)  # one cell per member: the first two finish (and are released to their group) first
    addrs, data = make(a, "weights", 4)
    a.sleep("weights")
    a.wake_up()
    assert a.stats()["wake_groups"] == 1
    a.inject_fault("copy_d2h", 3)
    with pytest.raises(CumemError):
        a.sleep("weights")
    rows = {r["address"]: r for r in a.allocations()}
    assert not any(rows[p]["asleep"] for p in addrs), "a member went to sleep while its group stayed mapped"
    check(a, data)
    a.sleep("weights")
    a.wake_up()
    check(a, data)


def test_env_sets_the_initial_group_size():
    import subprocess
    import sys

    code = (
        "import cumem_rs; a = cumem_rs.Allocator.simulated(devices=1, capacity=1 << 26, granularity=1 << 16);"
        "print(a.wake_group_bytes)"
    )
    for value, want in (("0", 0), ("8M", 8 << 20), ("4194304", 4 << 20)):
        env = dict(os.environ, CUMEM_RS_WAKE_GROUP_BYTES=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == str(want), (value, out.stderr)


@pytest.mark.parametrize("group_units", [8, 0])
@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_neighbours_go_out_and_back_as_one_copy(sim, group_units):
    """Backups of neighbours in one reservation are copied out as one copy per cell, and a woken run whose
    backups lie back to back comes back as one copy (one per allocation without groups)."""
    a = sim
    g = a.granularity(0)
    a.set_wake_group_bytes(group_units * g)
    a.set_retain_backups(False)
    addrs, data = make(a, "weights", 8)
    calls = lambda op: a.driver_counts()["calls"][op]  # noqa: E731
    d2h = calls("copy_d2h")
    a.sleep("weights")
    assert calls("copy_d2h") - d2h == 1, "eight neighbours in one cell were not copied out as one copy"
    h2d = calls("copy_h2d")
    a.wake_up()
    assert calls("copy_h2d") - h2d == (1 if group_units else 8)
    check(a, data)
    # A hole breaks the run: two copies out.
    a.free(addrs[3])
    del data[addrs[3]]
    d2h = calls("copy_d2h")
    a.sleep("weights")
    assert calls("copy_d2h") - d2h == 2
    a.wake_up()
    check(a, data)
