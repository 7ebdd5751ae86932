"""The dicts the allocator returns are what `cumem_rs.results` (and so `_native.pyi`) says they are.

For each kind, a real call's dict must have exactly the TypedDict's keys (its optional keys may be missing) and
every value must be of the declared type. A key added, renamed or dropped in the extension without the TypedDict
(or the other way round) fails here, as does a value of another type (a bool where an int is promised, a str
where a Literal is).
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union

import pytest

from cumem_rs import Allocator, results

MiB = 1 << 20


def _check(value: Any, hint: Any, where: str) -> None:
    """Assert that `value` is of the type `hint` (the subset of typing the results use), recursively."""
    origin = typing.get_origin(hint)
    if typing.is_typeddict(hint):
        _check_typeddict(value, hint, where)
    elif hint is Any:
        pass
    elif hint is type(None):
        assert value is None, f"{where}: {value!r} is not None"
    elif origin in (Union, types.UnionType):
        errors = []
        for option in typing.get_args(hint):
            try:
                _check(value, option, where)
                return
            except AssertionError as e:
                errors.append(str(e))
        raise AssertionError(f"{where}: {value!r} matches no type of {hint}: {errors}")
    elif origin is Literal:
        assert value in typing.get_args(hint), f"{where}: {value!r} is not one of {typing.get_args(hint)}"
    elif origin is list:
        assert isinstance(value, list), f"{where}: {value!r} is not a list"
        (item,) = typing.get_args(hint)
        for i, v in enumerate(value):
            _check(v, item, f"{where}[{i}]")
    elif origin is dict:
        assert isinstance(value, dict), f"{where}: {value!r} is not a dict"
        key, item = typing.get_args(hint)
        for k, v in value.items():
            _check(k, key, f"{where} key {k!r}")
            _check(v, item, f"{where}[{k!r}]")
    elif hint is float:
        assert isinstance(value, float), f"{where}: {value!r} is not a float"
    elif hint in (int, str):
        # bool is an int subclass: a flag where a count is promised is a wrong type.
        assert isinstance(value, hint) and not isinstance(value, bool), f"{where}: {value!r} is not {hint.__name__}"
    elif hint is bool:
        assert isinstance(value, bool), f"{where}: {value!r} is not a bool"
    else:
        raise AssertionError(f"{where}: no check for {hint!r}")


def _check_typeddict(value: Any, td: Any, where: str) -> None:
    assert isinstance(value, dict), f"{where}: {value!r} is not a dict"
    hints = typing.get_type_hints(td)
    keys = set(value)
    assert keys <= set(hints), f"{where}: keys not in {td.__name__}: {sorted(keys - set(hints))}"
    missing = td.__required_keys__ - keys
    assert not missing, f"{where}: keys of {td.__name__} missing: {sorted(missing)}"
    for k in keys:
        _check(value[k], hints[k], f"{where}[{k!r}]")


@pytest.fixture
def busy() -> typing.Iterator[Allocator]:
    """A simulated allocator with something in every dict: two tags, one with a policy, asleep and awake
    allocations, a backup, a last sleep and a last wake."""
    a = Allocator.simulated(devices=2, capacity=64 * MiB, granularity=MiB)
    a.set_tag_policy("kv_cache", backup=False, wake_fill="zero")
    for tag, device in (("weights", 0), ("kv_cache", 1), ("weights", 1)):
        a.push_tag(tag)
        a.write(a.malloc(3 * MiB // 2, device), b"x" * 100)
        a.pop_tag()
    a.sleep(["weights"])
    a.wake_up(["kv_cache"])
    try:
        yield a
    finally:
        a.close()


def test_reports(busy):
    _check(busy.wake_up(), results.Report, "wake_up()")
    _check(busy.sleep(), results.Report, "sleep()")
    _check(busy.sleep("weights"), results.Report, "sleep(tags)")
    _check(busy.resume(), results.Report, "resume()")
    _check(busy.pause("kv_cache"), results.Report, "pause()")
    _check(busy.resume(["kv_cache"]), results.Report, "resume(tags)")
    _check(busy.discard("weights"), results.Report, "discard()")


def test_stats(busy):
    stats = busy.stats()
    _check(stats, results.Stats, "stats()")
    assert stats["last_sleep"] is not None and stats["last_wake"] is not None
    fresh = Allocator.simulated()
    try:
        # No sleep and no wake yet: the reports are None, which the TypedDict allows.
        s = fresh.stats()
        assert s["last_sleep"] is None and s["last_wake"] is None
        _check(s, results.Stats, "stats() of a fresh allocator")
    finally:
        fresh.close()


def test_status_and_policies(busy):
    status = busy.status()
    _check(status, results.Status, "status()")
    assert {"weights", "kv_cache"} <= set(status["tags"])
    _check(busy.tag_policy("kv_cache"), results.TagPolicy, "tag_policy(set)")
    _check(busy.tag_policy("never-used"), results.TagPolicy, "tag_policy(unset)")


def test_allocation_records(busy):
    records = busy.allocations()
    assert len(records) == 3
    _check(records, list[results.AllocationRecord], "allocations()")
    assert any(r["asleep"] for r in records) and not all(r["asleep"] for r in records)


def test_pin_ahead_status(busy):
    _check(busy.pin_ahead_status(), results.PinAheadStatus, "pin_ahead_status() idle")
    busy.reserve_host(4 * MiB, background=True)
    _check(busy.pin_ahead_status(), results.PinAheadStatus, "pin_ahead_status() while pinning")
    busy.stop_pinning_ahead()


def test_driver_counts(busy):
    _check(busy.driver_counts(), results.DriverCounts, "driver_counts()")


def test_info(busy):
    info = busy.info()
    _check(info, results.Info, "info()")
    assert len(info["devices"]) == 2


def test_check_catches_a_drifted_dict():
    # The checker itself: an extra key, a missing key and a wrong value type each fail.
    good = {"running": False, "pinned": 0, "nbytes": 0}
    _check(good, results.PinAheadStatus, "good")
    for bad in ({**good, "extra": 1}, {"running": False, "pinned": 0}, {**good, "pinned": True}):
        with pytest.raises(AssertionError):
            _check(bad, results.PinAheadStatus, "bad")


def test_dicts_of_a_cycle_on_every_backend(alloc):
    # The same checks on the CUDA allocator when a GPU is present (info() has driver_version there).
    info = alloc.info()
    _check(info, results.Info, "info()")
    assert ("driver_version" in info) == (alloc.backend == "cuda")
    g = alloc.granularity()
    alloc.push_tag("weights")
    try:
        addr = alloc.malloc(g)
    finally:
        alloc.pop_tag()
    try:
        _check(alloc.sleep("weights"), results.Report, "sleep()")
        _check(alloc.status(), results.Status, "status() asleep")
        _check(alloc.allocations(), list[results.AllocationRecord], "allocations() asleep")
        _check(alloc.wake_up(), results.Report, "wake_up()")
        _check(alloc.stats(), results.Stats, "stats()")
        _check(alloc.pin_ahead_status(), results.PinAheadStatus, "pin_ahead_status()")
    finally:
        alloc.free(addr)


def test_file_tier_reports_stats_and_policies(tmp_path):
    """A sleep and wake through the file tier: the reports' written/read bytes and the per-tier stats are typed
    as the TypedDicts say, and a tag with a tier shows it in its policy and status."""
    a = Allocator.simulated(devices=1, capacity=64 * MiB, granularity=MiB)
    try:
        a.set_spill_dir(tmp_path)
        a.set_host_budget(MiB)
        a.set_tag_policy("kv_cache", backup_tier="file")
        for tag in ("weights", "weights", "kv_cache"):
            a.push_tag(tag)
            a.write(a.malloc(MiB, 0), b"y" * 100)
            a.pop_tag()
        slept = a.sleep(["weights", "kv_cache"])
        _check(slept, results.Report, "sleep() to files")
        stats = a.stats()
        _check(stats, results.Stats, "stats() with file backups")
        assert (stats["host_tier_bytes"], stats["file_tier_bytes"]) == (MiB, 2 * MiB)
        # Mostly zeros: the codec's blobs went to the files, not the raw bytes.
        on_disk = stats["file_tier_stored_bytes"]
        assert slept["written_bytes"] == on_disk < MiB
        _check(a.tag_policy("kv_cache"), results.TagPolicy, "tag_policy(file)")
        assert a.tag_policy("kv_cache")["backup_tier"] == "file"
        _check(a.status(), results.Status, "status() with a tier")
        assert a.status()["tags"]["kv_cache"]["file_bytes"] == MiB
        woke = a.wake_up()
        _check(woke, results.Report, "wake_up() from files")
        assert woke["read_bytes"] == on_disk and woke["copied_bytes"] == 3 * MiB
    finally:
        a.close()
