"""The host RAM guard in a real memory cgroup on a GPU (issue 36 item 1): never killed.

A child process in a cgroup v2 with `memory.max` = 6 GiB and `memory.swap.max` = 0 allocates 8 GiB in
`use_memory_pool(tag="weights")` (random bytes, `torch.full(..., 4)`, bf16 `randn * 0.02`), then sleeps, wakes,
verifies, and runs `sleep(offload_tags=()); wake_up()`, for raw backups (`CUMEM_RS_COMPRESS=0`) and compressed ones,
in host memory and with a file tier (`CUMEM_RS_SPILL_DIR`). It must never die by a signal (the kernel's OOM killer
sends SIGKILL): it either completes with its data intact or reports a refusal (`CumemOutOfMemoryError`) with its
data intact. Before the fix the compressed cases were killed: `torch.full` during the `sleep(()); wake_up()` after
the first cycle, bf16 during the sleep itself.

Needs root, a writable cgroup v2 hierarchy with the memory controller, and CUDA; skipped otherwise. The three
contents of one configuration run at once, each in a cgroup of its own (8 GiB of weights and 8 GiB of reference
copies each on the GPU), so the module takes about a minute and a half on an H200.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import cumem_rs  # noqa: E402

CGROUP = Path("/sys/fs/cgroup")
GiB = 1 << 30
LIMIT = 6 * GiB
WEIGHTS = 8 * GiB


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (creates a memory cgroup)"
    try:
        if "memory" not in (CGROUP / "cgroup.controllers").read_text().split():
            return "no cgroup v2 memory controller at /sys/fs/cgroup"
    except OSError:
        return "no cgroup v2 hierarchy at /sys/fs/cgroup"
    if not (torch.cuda.is_available() and cumem_rs.cuda_available()):
        return "needs a CUDA GPU visible to both torch and cumem_rs"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")

CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from cumem_rs import CuMemAllocator, CumemOutOfMemoryError

    kind, total = sys.argv[1], int(sys.argv[2])
    n = 8
    each = total // n
    alloc = CuMemAllocator.get_instance()
    with alloc.use_memory_pool(tag="weights"):
        if kind == "random":
            ws = [torch.randint(0, 256, (each,), dtype=torch.uint8, device="cuda") for _ in range(n)]
        elif kind == "full":
            ws = [torch.full((each // 4,), 4.0, dtype=torch.float32, device="cuda") for _ in range(n)]
        else:
            ws = [torch.randn(each // 2, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(n)]
    refs = [w.clone() for w in ws]  # outside the pool: stays on the GPU through every sleep
    torch.cuda.synchronize()

    def intact():
        torch.cuda.synchronize()
        return all(torch.equal(w, r) for w, r in zip(ws, refs))

    def say(outcome, **kw):
        print(json.dumps(dict(outcome=outcome, **kw)), flush=True)

    try:
        alloc.sleep(offload_tags=("weights",))
    except CumemOutOfMemoryError as e:
        say("refused", intact=intact(), error=str(e))
        sys.exit(0)
    alloc.wake_up()
    ok = intact()
    try:
        alloc.sleep(offload_tags=())
        alloc.wake_up()
    except CumemOutOfMemoryError as e:
        say("refused later", intact=ok, error=str(e))
        sys.exit(0)
    say("done", intact=ok, host_bytes=alloc.native.host_bytes())
    """
)


def _cgroup() -> Path:
    """A fresh child of the root with memory.max = 6 GiB and no swap; skips where the root will not delegate."""
    try:
        controls = (CGROUP / "cgroup.subtree_control").read_text().split()
        if "memory" not in controls:
            (CGROUP / "cgroup.subtree_control").write_text("+memory")
        cg = CGROUP / f"cumem_rs_guard_{uuid.uuid4().hex[:8]}"
        cg.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup under {CGROUP}: {e}")
    (cg / "memory.max").write_text(str(LIMIT))
    swap = cg / "memory.swap.max"
    if swap.exists():
        swap.write_text("0")
    return cg


def _start(cg: Path, kind: str, env: dict[str, str]) -> subprocess.Popen:
    procs = str(cg / "cgroup.procs")

    def join() -> None:  # in the child, before exec: everything it allocates is charged to the cgroup
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    return subprocess.Popen(
        [sys.executable, "-c", CHILD, kind, str(WEIGHTS)],
        env=env,
        preexec_fn=join,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _remove(cg: Path) -> None:
    try:
        cg.rmdir()
    except OSError:
        pass


@pytest.mark.parametrize("tier", ["host", "file"])
@pytest.mark.parametrize("compress", ["0", "1"], ids=["raw", "codec"])
def test_a_sleep_in_a_6_gib_cgroup_never_gets_the_process_killed(tmp_path, compress, tier):
    kinds = ["random", "full", "bf16"]
    env = dict(os.environ, CUMEM_RS_COMPRESS=compress)
    env.pop("CUMEM_RS_HOST_MEMORY_LIMIT", None)
    env.pop("CUMEM_RS_SPILL_DIR", None)
    groups = {k: _cgroup() for k in kinds}
    try:
        procs = {}
        for k in kinds:
            e = dict(env)
            if tier == "file":
                d = tmp_path / k
                d.mkdir()
                e["CUMEM_RS_SPILL_DIR"] = str(d)
            procs[k] = _start(groups[k], k, e)
        results = {}
        for k, p in procs.items():
            try:
                out, err = p.communicate(timeout=200)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            peak = groups[k] / "memory.peak"
            results[k] = (p.returncode, out, err, peak.read_text().strip() if peak.exists() else "?")
    finally:
        for cg in groups.values():
            _remove(cg)
    for k, (rc, out, err, peak) in results.items():
        what = f"{k} (compress={compress}, tier={tier}, cgroup peak {peak} bytes)"
        assert rc >= 0, f"{what}: killed by signal {-rc} (the OOM killer?); stderr tail:\n{err[-2000:]}"
        assert rc == 0, f"{what}: exited {rc}; stderr tail:\n{err[-3000:]}"
        said = json.loads(out.strip().splitlines()[-1])
        assert said["intact"], f"{what}: data not intact after {said}"
        assert said["outcome"] in ("done", "refused", "refused later"), said
        if tier == "file":
            assert said["outcome"] == "done", f"{what}: the file tier takes what host memory cannot: {said}"
        elif compress == "0" or k == "random":
            assert said["outcome"] == "refused", f"{what}: 8 GiB raw cannot fit 6 GiB: {said}"
        elif k == "full":
            assert said["outcome"] == "done", f"{what}: compresses to almost nothing: {said}"
