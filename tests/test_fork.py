"""A process forked from one that holds an allocator (a DataLoader worker, a multiprocessing fork pool) while its
background pinning worker runs: in the child every call raises one clear CumemError naming the fork, no thread of
the parent is joined, and a child that exits normally (its exit handlers and the allocator's drop running) exits
cleanly; the parent's allocator is unaffected. Each scenario runs in a fresh interpreter (forking pytest itself
would run the rest of the suite twice)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCENARIO = textwrap.dedent(
    """
    import os, sys
    import cumem_rs
    from cumem_rs import Allocator, CumemError

    GRAN = 2 << 20
    a = Allocator.simulated(capacity=256 << 20, host_register_delay=0.02)
    a.set_pin_chunk(GRAN)
    addr = a.malloc(GRAN)
    a.write(addr, b"\\x5a" * GRAN)
    a.reserve_host(128 << 20, background=True)
    assert a.pin_ahead_status()["running"], "the worker runs while the process forks"

    pid = os.fork()
    if pid == 0:
        if sys.argv[1] == "calls":
            calls = {
                "sleep": lambda: a.sleep(["default"]),
                "wake_up": lambda: a.wake_up(),
                "pause": lambda: a.pause(["default"]),
                "malloc": lambda: a.malloc(4096),
                "free": lambda: a.free(addr),
                "read": lambda: a.read(addr, 16),
                "close": a.close,
                "stop_pinning_ahead": a.stop_pinning_ahead,
                "trim_host": a.trim_host,
                "reserve_host": lambda: a.reserve_host(GRAN),
                "pin_ahead_status": a.pin_ahead_status,
                "push_tag": lambda: a.push_tag("weights"),
                "current_tag": a.current_tag,
                "usage": a.usage,
                "status": a.status,
                "stats": a.stats,
                "errors": a.errors,
                "host_bytes": a.host_bytes,
                "closed": lambda: a.closed,
                "mem_info": a.mem_info,
                "info": a.info,
            }
            bad = []
            for name, call in calls.items():
                try:
                    call()
                    bad.append(f"{name}: answered")
                except CumemError as e:
                    if "fork" not in str(e):
                        bad.append(f"{name}: {e}")
            print("\\n".join(bad) or "all refused")
            os._exit(1 if bad else 0)
        # "exit": the child returns normally; interpreter exit drops the allocator in the child.
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    child = os.waitstatus_to_exitcode(status)
    # The parent is unaffected: its worker is stopped and joined, and its allocator sleeps and wakes.
    a.stop_pinning_ahead()
    a.sleep(["default"])
    a.wake_up()
    assert a.read(addr, GRAN) == b"\\x5a" * GRAN
    a.close()
    print(f"child exit code {child}")
    sys.exit(child)
    """
)


@pytest.mark.parametrize("mode", ["calls", "exit"])
def test_forked_child_refuses_every_call_and_exits_cleanly(mode):
    run = subprocess.run(
        [sys.executable, "-c", SCENARIO, mode], capture_output=True, text=True, timeout=120
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "panicked" not in out and "unusable" not in out, out
    assert "child exit code 0" in out, out
