"""Rust-side log records reach Python's logging through the queue, never stderr, and never need the GIL."""

import logging

import cumem_rs
from cumem_rs import Allocator, forward_native_logs

GRAN = 64 << 10


def test_engine_records_reach_the_cumem_rs_native_logger(caplog):
    forward_native_logs()  # drop what earlier tests queued
    a = Allocator.simulated(capacity=16 << 20, granularity=GRAN)
    try:
        a.push_tag("weights")
        addr = a.malloc(GRAN)
        a.pop_tag()
        a.sleep(["weights"])
        a.wake_up()
        # A release that fails after its unmap is queued and recorded (it cannot raise: the free happened).
        a.inject_fault("release", 1, "unknown")
        a.free(addr)
        caplog.clear()  # only what this forward emits
        with caplog.at_level(logging.DEBUG, logger="cumem_rs"):
            n = forward_native_logs()
        assert n == len(caplog.records) >= 3
        assert all(r.name == "cumem_rs.native" for r in caplog.records)
        messages = [(r.levelno, r.getMessage()) for r in caplog.records]
        assert any(lvl == logging.DEBUG and "engine sleep: 1 allocations" in m for lvl, m in messages), messages
        assert any(lvl == logging.DEBUG and "engine wake" in m for lvl, m in messages), messages
        warnings = [m for lvl, m in messages if lvl == logging.WARNING]
        assert len(warnings) == 1 and "release" in warnings[0] and "CUDA_ERROR_UNKNOWN" in warnings[0], messages
        assert warnings[0].endswith(a.errors()[-1].split(": ", 1)[1]), "the log line carries the recorded error"
        assert forward_native_logs() == 0, "records are forwarded once"
    finally:
        a.clear_faults()
        a.close()


def test_logs_queue_without_python_and_are_bounded():
    forward_native_logs()
    a = Allocator.simulated(capacity=1 << 30, granularity=GRAN)
    try:
        a.malloc(GRAN)
        for _ in range(6000):  # two debug records per cycle: more than the queue keeps
            a.sleep(["default"])
            a.wake_up()
        records = cumem_rs._native.drain_logs()
        assert len(records) == 10_000, "the queue keeps the newest 10 000 records"
    finally:
        a.close()
