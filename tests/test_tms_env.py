"""The `TMS_*` numbers as torch_memory_saver reads them: ASCII digits only. `str.isdigit()` also accepts
superscripts (which `int()` then rejects with a bare ValueError) and other scripts' digits (which `int()` reads as
a number nobody typed); here anything but ASCII digits is a CumemValueError naming the variable and the value."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from cumem_rs import Allocator, CumemValueError  # noqa: E402
from cumem_rs._sim_pools import SimulatedPools  # noqa: E402
from cumem_rs._tms_env import DEFAULT_DISK_CHUNK_MB, read_tms_env  # noqa: E402
from cumem_rs.memory_saver import TorchMemorySaver  # noqa: E402

CHUNK = "TMS_DISK_BACKUP_CHUNK_MB"

NOT_ASCII_DIGITS = [
    "\u00b2",  # superscript two: isdigit() but not int()
    "1\u00b2",
    "\u0661\u0662",  # Arabic-Indic 12: int() reads 12
    "\uff11\uff12",  # fullwidth 12
    "\u0967",  # Devanagari one
    "1_000",  # int() takes the underscore
    "+1",
    "-1",
    "0x10",
    "1.5",
    "",
    " ",
]


@pytest.mark.parametrize("value", NOT_ASCII_DIGITS)
def test_a_chunk_size_that_is_not_ascii_digits_is_refused_naming_it(value):
    with pytest.raises(CumemValueError) as info:
        read_tms_env({CHUNK: value})
    assert CHUNK in str(info.value) and repr(value) in str(info.value)


@pytest.mark.parametrize("value,mib", [("1", 1), ("0012", 12), (" 7 ", 7), ("0", DEFAULT_DISK_CHUNK_MB)])
def test_ascii_digits_are_the_chunk_size_in_mib(value, mib):
    assert read_tms_env({CHUNK: value}).disk_backup_chunk_mb == mib


def test_a_saver_refuses_to_set_up_with_such_a_value(monkeypatch):
    monkeypatch.setenv(CHUNK, "\u00b2")
    sim = Allocator.simulated(devices=1, capacity=1 << 26, granularity=1 << 16)
    try:
        saver = TorchMemorySaver(_backend=SimulatedPools(sim))
        with pytest.raises(CumemValueError, match=CHUNK):
            saver._ensure_initialized()
        assert saver._alloc is None
    finally:
        sim.close()
