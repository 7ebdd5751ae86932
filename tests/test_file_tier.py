"""The host budget and the file tier: backups past the budget go to unlinked files in a spill directory, and
come back bit-identical; without a directory a sleep past the budget is refused before anything is released.
Parametrised over the backend (sim always, cuda with a GPU): the file I/O is the store's own host code on both.
"""

from __future__ import annotations

import os

import pytest

import cumem_rs
from cumem_rs import Allocator


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
    # The CUDA allocator is shared: leave it awake and without a budget or spill directory.
    alloc.wake_up(None)
    alloc.set_host_budget(None)


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


def test_host_budget_bad_input_names_the_argument(a):
    with pytest.raises((ValueError, TypeError), match="nbytes"):
        a.set_host_budget(-1)
    with pytest.raises(TypeError, match="nbytes"):
        a.set_host_budget("1G")
