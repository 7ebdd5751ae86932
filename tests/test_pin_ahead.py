"""The host RAM guard and background pinning, through the Python API on the simulated driver.

The guard: a sleep (or reserve_host) whose backup does not fit in the host memory the simulated machine has left
(`Allocator.simulated(host_memory=N)`) raises CumemOutOfMemoryError naming both numbers, before anything is
released. Background pinning (`reserve_host(n, background=True)`): a sleep racing the worker at any stage
takes what is pinned and pins the rest itself, each cell exactly once; close and trim stop it; a budget too small
stops it with one recorded warning. Each host registration takes `host_register_delay` seconds, so the worker's
stage at the moment of the sleep is chosen by waiting on `pin_ahead_status()`.
"""

from __future__ import annotations

import time
from typing import Optional

import pytest

from cumem_rs import Allocator, CumemOutOfMemoryError
from conftest import call_counts, live_counts

GRAN = 2 << 20
CELL = GRAN


def _sim(host_memory: Optional[int] = None, delay: float = 0.0) -> Allocator:
    a = Allocator.simulated(capacity=256 << 20, host_memory=host_memory, host_register_delay=delay)
    a.set_pin_chunk(CELL)
    return a


def _fill(a: Allocator, sizes: list[int]) -> list[tuple[int, bytes]]:
    out = []
    for i, n in enumerate(sizes):
        p = a.malloc(n)
        data = bytes((j * 7 + i) % 251 for j in range(n))
        a.write(p, data)
        out.append((p, data))
    return out


def _check(a: Allocator, allocs: list[tuple[int, bytes]]) -> None:
    for p, data in allocs:
        assert a.read(p, len(data)) == data


def _wait(what: str, cond) -> None:
    deadline = time.monotonic() + 20
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _refused_then_fits(a: Allocator, allocs: list[tuple[int, bytes]]) -> str:
    """The sleep is refused with every allocation awake and intact; after freeing the second allocation it
    works and the first comes back. Returns the refusal's message."""
    copies = call_counts(a)["copy_d2h"]
    with pytest.raises(CumemOutOfMemoryError) as err:
        a.sleep("default")
    assert call_counts(a)["copy_d2h"] == copies, "nothing was queued"
    assert not any(x["asleep"] for x in a.allocations())
    _check(a, allocs)
    a.free(allocs[1][0])
    a.sleep("default")
    a.wake_up()
    _check(a, allocs[:1])
    a.close()
    assert live_counts(a) == {k: 0 for k in live_counts(a)}
    return str(err.value)


@pytest.mark.usefixtures("raw_backups")  # raw bytes past the budget (these compress to fit it)
def test_sleep_past_the_host_budget_raises_and_keeps_everything_awake():
    a = _sim(host_memory=6 * GRAN)
    allocs = _fill(a, [4 * GRAN, 4 * GRAN])
    msg = _refused_then_fits(a, allocs)
    assert str(8 * GRAN) in msg and str(6 * GRAN) in msg, msg


def test_reserve_host_past_the_host_budget_is_refused():
    a = _sim(host_memory=3 * GRAN)
    with pytest.raises(CumemOutOfMemoryError, match=str(3 * GRAN)):
        a.reserve_host(4 * GRAN)
    assert a.host_bytes() == 0
    a.reserve_host(2 * GRAN)
    assert a.host_bytes() == 2 * GRAN
    a.close()


@pytest.mark.parametrize("stage", ["started", "half", "done"])
@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_sleep_racing_the_worker(stage):
    a = _sim(delay=0.02)
    allocs = _fill(a, [3 * GRAN, 5 * GRAN])
    a.reserve_host(8 * GRAN, background=True)
    if stage == "half":
        _wait("half the cells", lambda: a.pin_ahead_status()["pinned"] >= 4 * CELL)
    elif stage == "done":
        _wait("every cell", lambda: a.pin_ahead_status()["pinned"] == 8 * CELL)
    report = a.sleep("default")
    assert report["copied_bytes"] == 8 * GRAN
    assert not a.pin_ahead_status()["running"]
    # Each of the 8 cells registered once, by the worker or by the sleep, and no registration failed.
    assert call_counts(a)["host_register"] == 8, a.errors()
    assert a.errors() == []
    a.wake_up()
    _check(a, allocs)
    a.sleep("default")  # steady: nothing more to pin
    a.wake_up()
    assert call_counts(a)["host_register"] == 8
    _check(a, allocs)
    a.close()
    assert live_counts(a) == {k: 0 for k in live_counts(a)}


@pytest.mark.parametrize("stop", ["close", "trim_host", "keep_off"])
def test_close_trim_and_keep_off_stop_the_worker(stop):
    delay = 0.05  # per cell: 32 cells are 1.6 s of pinning if the stop were ignored
    a = _sim(delay=delay)
    allocs = _fill(a, [2 * GRAN])
    a.reserve_host(32 * GRAN, background=True)
    _wait("first cell", lambda: a.pin_ahead_status()["pinned"] >= CELL)
    # Registrations are counted as they start: `before` includes the cell the worker is pinning now, so a stop
    # that waits for that cell only adds at most the one that may start between this read and the stop flag.
    before = call_counts(a)["host_register"]
    if stop == "close":
        a.close()
    elif stop == "trim_host":
        a.trim_host()
    else:
        a.set_keep_host_memory(False)
    after = call_counts(a)["host_register"]
    assert after <= before + 1 < 32, f"the worker went on pinning after the stop: {before} then {after} of 32 cells"
    time.sleep(3 * delay)  # room for a worker that was not really stopped to register more
    assert call_counts(a)["host_register"] == after, "a cell was registered after the stop returned"
    assert a.driver_counts()["host_registered"] == 0
    if stop != "close":
        assert not a.pin_ahead_status()["running"]
        a.sleep("default")
        a.wake_up()
        _check(a, allocs)
        a.close()
    assert live_counts(a) == {k: 0 for k in live_counts(a)}


def test_malloc_and_free_do_not_wait_for_the_worker():
    a = _sim(delay=0.05)
    a.reserve_host(40 * GRAN, background=True)  # two seconds of pinning
    p = a.malloc(GRAN)
    a.write(p, b"x" * GRAN)
    a.free(p)
    assert a.pin_ahead_status()["running"]
    a.close()


@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_budget_too_small_stops_the_worker_with_one_warning():
    a = _sim(host_memory=5 * GRAN)
    allocs = _fill(a, [3 * GRAN, 4 * GRAN])
    a.reserve_host(7 * GRAN, background=True)
    _wait("worker stopped", lambda: not a.pin_ahead_status()["running"])
    a.stop_pinning_ahead()
    errors = a.errors()
    assert len(errors) == 1 and "pinning ahead" in errors[0] and "out of memory" in errors[0], errors
    assert a.driver_counts()["host_registered"] == 5
    # The sleep needs 2 cells more than the 5 pinned, and the budget has none left: refused, all awake. With one
    # allocation freed the backup fits in the part already pinned.
    _refused_then_fits(a, allocs)


def test_bad_host_register_delay_is_a_value_error():
    with pytest.raises(ValueError, match="host_register_delay"):
        Allocator.simulated(host_register_delay=-1.0)
    with pytest.raises(ValueError, match="host_memory"):
        Allocator.simulated(host_memory=-1)


@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_backup_bytes_of_counts_awake_allocations_of_the_tags():
    a = _sim()
    a.push_tag("weights")
    w = a.malloc(3 * GRAN)
    a.pop_tag()
    a.malloc(GRAN)  # default
    assert a.backup_bytes_of(["weights"]) == 3 * GRAN
    assert a.backup_bytes_of(["weights", "default"]) == 4 * GRAN
    a.sleep("weights")
    assert a.backup_bytes_of(["weights"]) == 0
    a.wake_up()
    a.free(w)
    a.close()
