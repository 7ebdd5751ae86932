"""cumem_rs.memory_saver's allocator tags: torch_memory_saver's tags are arbitrary strings, and the saver gives the
memory of one tag with a second backup setting an allocator tag of its own (`t[cpu_backup]`, ...). Such a derived
name must never be one that another tag of the API uses (or the allocator's memory already carries), whatever the
order of the regions: a collision hands one tag's backup policy to another's memory (data loss at resume) and
makes pause/resume of one tag act on another's memory. Runs on the simulated device."""

from __future__ import annotations

from typing import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch")

from cumem_rs import Allocator  # noqa: E402
from cumem_rs._sim_pools import SimulatedPools  # noqa: E402
from cumem_rs.memory_saver import TorchMemorySaver  # noqa: E402

MiB = 1 << 20
N = 256 * 1024


@pytest.fixture(autouse=True)
def _no_tms_env(monkeypatch):
    for name in ("TMS_INIT_ENABLE", "TMS_RETAIN_CPU_BACKUP", "TMS_DISK_BACKUP_DIR", "TMS_DISK_BACKUP_CHUNK_MB"):
        monkeypatch.delenv(name, raising=False)


def _sim() -> Allocator:
    return Allocator.simulated(devices=1, capacity=64 * MiB, granularity=64 * 1024)


@pytest.fixture
def sim() -> Iterator[Allocator]:
    a = _sim()
    try:
        yield a
    finally:
        a.close()


def _alloc(saver: TorchMemorySaver, sim: Allocator, tag: str, fill: int, cpu: bool = False) -> int:
    with saver.region(tag, enable_cpu_backup=cpu):
        address = sim.malloc(N)
    sim.write(address, bytes([fill]) * N)
    return address


def test_a_region_tag_equal_to_a_derived_name_does_not_take_its_policy(sim):
    """The issue's repro: "t" (no backup), "t" with CPU backup (-> a derived tag), then a region whose tag is that
    derived name. Its policy (no backup) must not reach the CPU-backed memory of "t"."""
    saver = TorchMemorySaver(_backend=SimulatedPools(sim))
    _alloc(saver, sim, "t", 1)
    backed = _alloc(saver, sim, "t", 2, cpu=True)
    derived = {a["address"]: a["tag"] for a in sim.allocations()}[backed]
    other = _alloc(saver, sim, derived, 3)
    tags = {a["address"]: a["tag"] for a in sim.allocations()}
    assert tags[other] != tags[backed], f"region {derived!r} was given the allocator tag of t's CPU-backed memory"
    saver.pause("t")
    saver.resume("t")
    assert sim.read(backed, N) == b"\x02" * N, "the CPU-backed memory of 't' lost its backup"


def test_pausing_a_tag_named_like_a_derived_one_leaves_the_other_tag_alone(sim):
    """pause/resume of a tag never used here act on nothing, not on another tag's memory that happens to carry
    that name inside the allocator."""
    saver = TorchMemorySaver(_backend=SimulatedPools(sim))
    _alloc(saver, sim, "t", 1)
    backed = _alloc(saver, sim, "t", 2, cpu=True)
    derived = {a["address"]: a["tag"] for a in sim.allocations()}[backed]
    saver.pause(derived)
    assert not any(a["asleep"] for a in sim.allocations()), f"pause({derived!r}) paused memory of 't'"


def test_a_derived_name_avoids_a_tag_the_allocator_already_carries(sim):
    """Memory tagged outside the saver (the same allocator used directly) keeps its tag to itself: the derived
    name for the saver's tag picks another."""
    sim.push_tag("t[cpu_backup]")
    outside = sim.malloc(N)
    sim.pop_tag()
    saver = TorchMemorySaver(_backend=SimulatedPools(sim))
    _alloc(saver, sim, "t", 1)
    backed = _alloc(saver, sim, "t", 2, cpu=True)
    tags = {a["address"]: a["tag"] for a in sim.allocations()}
    assert tags[outside] == "t[cpu_backup]"
    assert tags[backed] not in ("t", "t[cpu_backup]")


LOOKALIKES = ["t", "t[no_backup]", "t[cpu_backup]", "t[cpu_backup]#2", "t[no_backup][cpu_backup]", "u"]


@given(st.lists(st.tuples(st.sampled_from(LOOKALIKES), st.booleans()), min_size=1, max_size=8))
def test_every_tag_and_setting_has_an_allocator_tag_of_its_own(regions):
    """Any order of regions over tags that look like derived names: each (tag, backup setting) holds memory under
    an allocator tag of its own, and pause/resume of one tag touches exactly its memory, keeping its backups."""
    sim = _sim()
    try:
        saver = TorchMemorySaver(_backend=SimulatedPools(sim))
        made: list[tuple[str, bool, int, int]] = []
        for i, (tag, cpu) in enumerate(regions):
            fill = i + 1
            made.append((tag, cpu, _alloc(saver, sim, tag, fill, cpu=cpu), fill))
        inner = {a["address"]: a["tag"] for a in sim.allocations()}
        owner: dict[str, tuple[str, bool]] = {}
        for tag, cpu, address, _ in made:
            assert owner.setdefault(inner[address], (tag, cpu)) == (tag, cpu), (
                f"allocator tag {inner[address]!r} holds memory of {owner[inner[address]]} and of {(tag, cpu)}"
            )
        for tag in {t for t, _, _, _ in made}:
            saver.pause(tag)
            asleep = {a["address"] for a in sim.allocations() if a["asleep"]}
            assert asleep == {address for t, _, address, _ in made if t == tag}, f"pause({tag!r})"
            saver.resume(tag)
            for t, cpu, address, fill in made:
                if t == tag and cpu:
                    assert sim.read(address, N) == bytes([fill]) * N, f"resume({tag!r}) lost a backup"
            # Memory without backup comes back undefined: give it its bytes again for the next round's checks.
            for t, cpu, address, fill in made:
                if t == tag and not cpu:
                    sim.write(address, bytes([fill]) * N)
    finally:
        sim.close()
