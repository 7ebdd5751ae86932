"""One process of the swap table (`python -m cumem_rs.bench.swap_child`, started by `swap.py`): it holds the
reference weights in its own core allocator and sleeps or wakes them when told.

Commands come as JSON lines on stdin, each answered by one JSON line on stdout (anything else the process prints
goes to stderr). Role "A" starts awake and its timed operation is a sleep; role "B" starts asleep and wakes.
- {"cmd": "setup", "backend", "scale", "role", "seed", "device"}: allocate and fill; answers {"codec": bool, ...}
- {"cmd": "mode", "compress": m}: (awake again,) set the weights' compress policy, one warm-up cycle so that
  host memory is pinned, then B goes back to sleep
- {"cmd": "go", "at": t}: wait until time.monotonic() reaches t (CLOCK_MONOTONIC is system-wide on Linux, so
  both processes start together), run the operation; answers {"t0", "t1"} (monotonic, around it and its
  synchronisation), {"seconds"} (the core's own time) and for A {"held"} (its host bytes asleep); B verifies
  its weights after (outside the timing)
- {"cmd": "reset"}: back to the starting state (A wakes and verifies, B sleeps); {"cmd": "quit"}
Retained backups are off: every sleep copies (and compresses) every byte.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any

from ..workload import WEIGHTS_TAG, reference_workload
from . import config


class _Process:
    def __init__(self, msg: dict) -> None:
        self.role = msg["role"]
        self.gpu = msg["backend"] == "cuda"
        specs = reference_workload(int(msg["scale"]), kv_gib=0)
        seed = int(msg["seed"])
        self.sync: Any = lambda: None
        self.core: Any  # the core Allocator (CUDA or simulated); compress modes come as text from the parent
        if self.gpu:
            import torch

            from .. import Allocator, _native
            from .compress_data import GpuWeights

            torch.cuda.set_device(int(msg["device"]))
            self.sync = torch.cuda.synchronize
            self.core = Allocator.cuda()
            self.codec = _native.cuda_codec_status()
            ctx = SimpleNamespace(torch=torch, device=int(msg["device"]))
            self.w: Any = GpuWeights(ctx, self.core, specs, seed=seed)
        else:
            from .compress_data import SimWeights
            from .subjects import sim_allocator

            self.core = sim_allocator(int(msg["scale"]), [s.nbytes for s in specs], compress=True)
            self.codec = (self.core.info().get("codec") is not None, str(self.core.info().get("codec")))
            self.w = SimWeights(self.core, specs, seed=seed)
        self.core.set_retain_backups(False)
        self.w.allocate()
        self.w.fill("bf16")
        self.asleep = False

    def _sleep(self) -> Any:
        r = self.core.sleep(WEIGHTS_TAG)
        self.sync()
        self.asleep = True
        return r

    def _wake(self) -> Any:
        r = self.core.wake_up(None)
        self.sync()
        self.asleep = False
        return r

    def mode(self, compress: str) -> dict:
        if self.asleep:
            self._wake()
            self.w.verify()
        self.core.set_tag_policy(WEIGHTS_TAG, compress=compress)
        self.core.trim_host()  # the last setting's cached arena would count as held
        self._sleep()
        self._wake()
        self.w.verify()
        if self.role == "B":
            self._sleep()
        return {"config": config.short(self.core)}  # what the rows of this mode ran in, read back

    def go(self, at: float) -> dict:
        while time.monotonic() < at:
            pass  # spin: a sleep() would wake up late by up to a scheduler tick
        t0 = time.monotonic()
        report = self._sleep() if self.role == "A" else self._wake()
        t1 = time.monotonic()
        answer = {"t0": t0, "t1": t1, "seconds": float(report.get("seconds", t1 - t0))}
        if self.role == "B":
            self.w.verify()
        else:
            answer["held"] = self.core.host_bytes()
        return answer

    def reset(self) -> dict:
        if self.role == "A":
            self._wake()
            self.w.verify()
        else:
            self._sleep()
        return {}

    def close(self) -> None:
        if self.asleep:
            self._wake()
        self.w.release()


def main() -> int:
    # The answers get the real stdout; whatever else writes to fd 1 (a library's print) goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    proc = None
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            cmd = msg["cmd"]
            if cmd == "quit":
                break
            if cmd == "setup":
                proc = _Process(msg)
                answer: dict = {"codec": bool(proc.codec[0]), "codec_text": proc.codec[1]}
            elif proc is None:
                raise RuntimeError(f"{cmd!r} before setup")
            elif cmd == "mode":
                answer = proc.mode(msg["compress"])
            elif cmd == "go":
                answer = proc.go(float(msg["at"]))
            elif cmd == "reset":
                answer = proc.reset()
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception as e:  # noqa: BLE001 - the parent reports it and stops the table
            traceback.print_exc()
            answer = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    if proc is not None:
        proc.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
