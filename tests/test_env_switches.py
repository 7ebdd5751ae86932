"""Every on/off environment variable is read by one parser with one set of spellings (1/true/yes/on,
0/false/no/off, any case; unset, empty or unreadable: the default). `CUMEM_RS_COMPRESS` was read twice, by the CUDA
driver (before loading nvCOMP: `off` meant off) and by the engine (`off` meant on); Python-side switches
(`CUMEM_RS_PIN_AHEAD`) took anything but `0` as on. Runs on the simulated device."""

from __future__ import annotations

import pytest

from cumem_rs import Allocator, _native

OFF = ["0", "off", "OFF", "false", "False", "no", " no "]
ON = ["1", "on", "true", "TRUE", "yes"]


def _codec(monkeypatch, value: str) -> object:
    monkeypatch.setenv("CUMEM_RS_COMPRESS", value)
    a = Allocator.simulated(devices=1, capacity=1 << 26, granularity=1 << 16)
    try:
        return a.stats()["codec"]
    finally:
        a.close()


@pytest.mark.parametrize("value", OFF)
def test_every_off_spelling_of_cumem_rs_compress_turns_the_codec_off(monkeypatch, value):
    assert _codec(monkeypatch, value) is None


@pytest.mark.parametrize("value", ON + ["", "maybe"])
def test_on_unset_and_unreadable_spellings_keep_the_codec(monkeypatch, value):
    assert _codec(monkeypatch, value) is not None


@pytest.mark.parametrize("value,want", [(v, False) for v in OFF] + [(v, True) for v in ON])
def test_python_side_switches_read_the_same_spellings(monkeypatch, value, want):
    monkeypatch.setenv("CUMEM_RS_PIN_AHEAD", value)
    assert _native.env_flag("CUMEM_RS_PIN_AHEAD", not want) is want


@pytest.mark.parametrize("value", ["", "maybe", "2"])
def test_a_python_side_switch_that_cannot_be_read_keeps_its_default(monkeypatch, value):
    monkeypatch.setenv("CUMEM_RS_PIN_AHEAD", value)
    assert _native.env_flag("CUMEM_RS_PIN_AHEAD", True) is True
    assert _native.env_flag("CUMEM_RS_PIN_AHEAD", False) is False
