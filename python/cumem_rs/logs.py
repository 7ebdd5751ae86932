"""Forwarding of the Rust side's log records into Python's `logging`.

The engine queues its records (it must not take the GIL: see rust/src/logbuf.rs); this moves them to the
logger "cumem_rs.native". `CuMemAllocator` calls it after every sleep, wake and discard; users of the core
`Allocator` call it when they like (e.g. after each step of their own loop).
"""

import logging

from . import _native

native_logger = logging.getLogger("cumem_rs.native")


def forward_native_logs() -> int:
    """Emit every queued Rust-side record on the "cumem_rs.native" logger; returns how many there were."""
    records = _native.drain_logs()
    for level, message in records:
        native_logger.log(level, "%s", message)
    return len(records)
