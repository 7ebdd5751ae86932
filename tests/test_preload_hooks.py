"""The preload hook library's answers where the runtime is not the real one: a fake CUDA runtime built here with
the system C compiler (the thing under test is our hook, not the runtime) stands behind the hook in child
processes that never import torch, so no real runtime is loaded.

* Without `cudaGetDevice` in the process the hook has no device to give (it used to say device 0, which put the
  memory of a thread on device 1 on device 0): `cumem_rs_preload_current_device`, what the hooks pass the
  extension, answers CUMEM_RS_NO_GET_DEVICE and leaves the device alone; with one it answers the runtime's.
* `cudaMallocAsync`, `cudaFreeAsync` and `cudaMallocManaged` are intercepted and forwarded; made where a cudaMalloc
  would be routed (a region, TMS_INIT_ENABLE) their memory cannot be paused, so the first call of each name logs
  one WARNING and every call is counted in `stats()`. A `cudaFreeAsync` of a pointer of ours frees it here.

The CUDA variant (the real runtime behind the hook) is at the end; it skips without a GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

from cumem_rs import _preload  # noqa: E402
from conftest import HAS_CUDA  # noqa: E402

FAKE_RUNTIME = r"""
#include <stdlib.h>
#include <stddef.h>
/* The calls that reached this fake runtime, by name. */
static int counts[6];
int fake_count(int i) { return counts[i]; }
static void *take(size_t n) { return malloc(n ? n : 1); }
int cudaMalloc(void **p, size_t n) { counts[0]++; *p = take(n); return 0; }
int cudaFree(void *p) { counts[1]++; free(p); return 0; }
int cudaMallocAsync(void **p, size_t n, void *stream) { (void)stream; counts[2]++; *p = take(n); return 0; }
int cudaFreeAsync(void *p, void *stream) { (void)stream; counts[3]++; free(p); return 0; }
int cudaMallocManaged(void **p, size_t n, unsigned flags) { (void)flags; counts[4]++; *p = take(n); return 0; }
#ifdef WITH_GET_DEVICE
int cudaGetDevice(int *d) { counts[5]++; *d = 5; return 0; }
#endif
"""

# The child's start: the fake runtime loaded into the global scope (after the preloaded hook, as libcudart is),
# the hooks installed, and the C entry points through the global scope, as a program calls them.
CHILD = textwrap.dedent(
    """
    import ctypes, sys
    fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
    from cumem_rs import Allocator, _native
    assert _native.preload_register(), "the hook library is preloaded"
    api = ctypes.CDLL(None)
    VP, PVP, SZ = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t
    for name, args in [
        ("cudaMalloc", [PVP, SZ]), ("cudaFree", [VP]), ("cudaMallocAsync", [PVP, SZ, VP]),
        ("cudaFreeAsync", [VP, VP]), ("cudaMallocManaged", [PVP, SZ, ctypes.c_uint]),
        ("cumem_rs_preload_current_device", [ctypes.POINTER(ctypes.c_int)]),
    ]:
        getattr(api, name).argtypes = args
        getattr(api, name).restype = ctypes.c_int
    FAKE = {"cudaMalloc": 0, "cudaFree": 1, "cudaMallocAsync": 2, "cudaFreeAsync": 3, "cudaMallocManaged": 4}

    def fake_calls(name):
        return fake.fake_count(FAKE[name])

    def alloc(fn, n, *extra):
        p = ctypes.c_void_p()
        rc = fn(ctypes.byref(p), n, *extra)
        return rc, p.value
    """
)


@pytest.fixture(scope="module")
def fake_runtimes(tmp_path_factory) -> dict[str, Path]:
    """The fake runtime built twice: without cudaGetDevice ("bare") and with one that says device 5."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake runtime")
    d = tmp_path_factory.mktemp("fake_runtime")
    src = d / "fake_cudart.c"
    src.write_text(FAKE_RUNTIME)
    out = {}
    for name, flags in [("bare", []), ("with_device", ["-DWITH_GET_DEVICE"])]:
        lib = d / f"libfake_cudart_{name}.so"
        subprocess.run([cc, "-shared", "-fPIC", "-O1", *flags, "-o", str(lib), str(src)], check=True)
        out[name] = lib
    return out


def _run(body: str, runtime: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_")}
    env["LD_PRELOAD"] = _preload.library_path()
    env["CUDA_VISIBLE_DEVICES"] = ""
    script = CHILD + textwrap.dedent(body) + '\nprint("ok")\n'
    out = subprocess.run(
        [sys.executable, "-c", script, str(runtime)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.rstrip().endswith("ok"), (out.returncode, out.stdout, out.stderr)


def test_without_cuda_get_device_the_hook_gives_no_device(fake_runtimes):
    body = """
    rc, p = alloc(api.cudaMalloc, 4096)
    assert (rc, fake_calls("cudaMalloc")) == (0, 1), "forwarded to the runtime there is"
    dev = ctypes.c_int(7)
    rc = api.cumem_rs_preload_current_device(ctypes.byref(dev))
    assert (rc, dev.value) == (-2, 7), f"no cudaGetDevice: no device, none guessed (got rc {rc}, device {dev.value})"
    """
    _run(body, fake_runtimes["bare"])


def test_with_cuda_get_device_the_hook_gives_the_runtime_s_device(fake_runtimes):
    body = """
    dev = ctypes.c_int(7)
    assert api.cumem_rs_preload_current_device(ctypes.byref(dev)) == 0 and dev.value == 5
    """
    _run(body, fake_runtimes["with_device"])


def test_async_and_managed_allocations_are_forwarded_warned_once_and_counted(fake_runtimes):
    body = """
    sim = Allocator.simulated(devices=1, capacity=64 << 20, granularity=64 << 10)
    _native.preload_route_to(sim)
    _native.drain_logs()

    def counted():
        s = sim.stats()
        return s["preload_unrouted_calls"], s["preload_unrouted_bytes"]

    def warnings(name):
        return [m for level, m in _native.drain_logs() if level == 30 and name in m]

    # Outside regions: the runtime's memory, as expected; forwarded, not counted, no warning.
    rc, a = alloc(api.cudaMallocAsync, 1000, None)
    assert rc == 0 and a and fake_calls("cudaMallocAsync") == 1
    assert counted() == (0, 0) and warnings("cudaMallocAsync") == []

    _native.preload_push_region("t")
    rc, b = alloc(api.cudaMallocAsync, 1000, None)
    rc2, c = alloc(api.cudaMallocAsync, 500, None)
    assert (rc, rc2, fake_calls("cudaMallocAsync")) == (0, 0, 3), "forwarded inside a region too"
    assert counted() == (2, 1500)
    assert len(warnings("cudaMallocAsync")) == 1, "one warning per call name"
    rc, m = alloc(api.cudaMallocManaged, 24, 1)
    assert rc == 0 and fake_calls("cudaMallocManaged") == 1 and counted() == (3, 1524)
    [w] = warnings("cudaMallocManaged")
    assert "not cumem_rs's" in w and "stats()" in w, w
    for p in (b, c, m):
        assert api.cudaFreeAsync(p, None) == 0
    assert fake_calls("cudaFreeAsync") == 3 and counted() == (6, 1524)
    assert len(warnings("cudaFreeAsync")) == 1

    # A pointer of ours, freed with cudaFreeAsync: ours to free, never the runtime's.
    rc, ours = alloc(api.cudaMalloc, 1 << 20)
    assert rc == 0 and fake_calls("cudaMalloc") == 0 and _native.preload_live_pointers() == 1
    assert api.cudaFreeAsync(ours, None) == 0
    assert _native.preload_live_pointers() == 0 and sim.allocations() == []
    assert fake_calls("cudaFreeAsync") == 3 and counted() == (6, 1524)
    _native.preload_pop()

    # TMS_INIT_ENABLE routes outside regions: counted there too.
    _native.preload_set_init_enable(True)
    rc, d = alloc(api.cudaMallocAsync, 7, None)
    assert rc == 0 and counted() == (7, 1531) and warnings("cudaMallocAsync") == []
    _native.preload_set_init_enable(False)
    assert api.cudaFreeAsync(a, None) == 0 and api.cudaFreeAsync(d, None) == 0
    assert counted() == (7, 1531), "outside routing again: not counted"
    assert api.cudaFreeAsync(None, None) == 0 and counted() == (7, 1531)
    """
    _run(body, fake_runtimes["bare"])


# -- the real runtime (a GPU) ----------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (cuda_available() is False)")
def test_cuda_async_and_managed_allocations_in_a_region_are_counted_and_work():
    """The real runtime behind the hook: cudaMallocAsync / cudaMallocManaged inside a region are the runtime's
    (usable memory), counted and warned about; cudaFreeAsync of a routed cudaMalloc pointer frees ours."""
    body = """
    import ctypes
    import torch
    from cumem_rs import Allocator, _native
    from cumem_rs.memory_saver import torch_memory_saver as tms
    assert _native.preload_registered()
    torch.cuda.init()
    api = ctypes.CDLL(None)
    VP, PVP, SZ = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t
    api.cudaMalloc.argtypes = [PVP, SZ]
    api.cudaMallocAsync.argtypes = [PVP, SZ, VP]
    api.cudaFreeAsync.argtypes = [VP, VP]
    api.cudaMallocManaged.argtypes = [PVP, SZ, ctypes.c_uint]
    stream = torch.cuda.current_stream().cuda_stream
    alloc = Allocator.cuda()
    before = alloc.stats()["preload_unrouted_calls"], alloc.stats()["preload_unrouted_bytes"]
    with tms.region("t"):
        p = ctypes.c_void_p()
        assert api.cudaMallocAsync(ctypes.byref(p), 1 << 20, stream) == 0 and p.value
        q = ctypes.c_void_p()
        assert api.cudaMallocManaged(ctypes.byref(q), 1 << 20, 1) == 0 and q.value
        assert api.cudaFreeAsync(p, stream) == 0
        r = ctypes.c_void_p()
        assert api.cudaMalloc(ctypes.byref(r), 2 << 20) == 0
        assert any(a["address"] == r.value for a in alloc.allocations()), "cudaMalloc in a region is ours"
        assert api.cudaFreeAsync(r, stream) == 0
        assert not any(a["address"] == r.value for a in alloc.allocations()), "freed by cumem_rs"
    torch.cuda.synchronize()
    after = alloc.stats()["preload_unrouted_calls"], alloc.stats()["preload_unrouted_bytes"]
    assert (after[0] - before[0], after[1] - before[1]) == (3, 2 << 20), (before, after)
    assert api.cudaFree(q) == 0
    """
    script = textwrap.dedent(body) + '\nprint("ok")\n'
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_")}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env["LD_PRELOAD"] = _preload.library_path()
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("ok"), (out.returncode, out.stdout, out.stderr)
