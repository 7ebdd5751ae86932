"""The preload hook library (hook_mode="preload") in child processes started with it in LD_PRELOAD, on the
simulated driver: `cudaMalloc`/`cudaFree` called through `ctypes.CDLL(None)`, as a program (torch's caching
allocator) calls them, land in the engine while a region is active on the calling thread or TMS_INIT_ENABLE=1
holds, and are forwarded to the CUDA runtime otherwise. Without a GPU the forwarded calls fail with a CUDA error
code (the runtime finds no driver, or there is no runtime at all): cleanly, never a crash.

Torch's caching allocator under preload mode, on a GPU, is in test_memory_saver_cuda.py.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

from cumem_rs import CumemError, _native, _preload  # noqa: E402
from cumem_rs.memory_saver import TorchMemorySaver, configure_subprocess  # noqa: E402

# The start of every child: the C entry points through the global symbol scope, and a saver in preload mode over
# a simulated allocator (what routed allocations go to once the saver is set up).
PRELUDE = textwrap.dedent(
    """
    import ctypes, os, sys, threading
    from cumem_rs import Allocator, CumemError, CumemValueError, _native
    from cumem_rs._sim_pools import SimulatedPools
    from cumem_rs.memory_saver import TorchMemorySaver

    api = ctypes.CDLL(None)
    cudaMalloc = api.cudaMalloc
    cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    cudaMalloc.restype = ctypes.c_int
    cudaFree = api.cudaFree
    cudaFree.argtypes = [ctypes.c_void_p]
    cudaFree.restype = ctypes.c_int
    tms_pause, tms_resume = api.tms_pause, api.tms_resume
    for fn in (tms_pause, tms_resume):
        fn.argtypes = [ctypes.c_char_p]
        fn.restype = ctypes.c_int

    def malloc(n):
        p = ctypes.c_void_p()
        rc = cudaMalloc(ctypes.byref(p), n)
        return rc, p.value

    def on_thread(fn):
        out = []
        t = threading.Thread(target=lambda: out.append(fn()))
        t.start()
        t.join()
        return out[0]

    MiB = 1 << 20
    sim = Allocator.simulated(devices=1, capacity=64 * MiB, granularity=64 << 10)
    saver = TorchMemorySaver(_backend=SimulatedPools(sim))
    saver.hook_mode = "preload"

    def tags():
        return {a["address"]: a["tag"] for a in sim.allocations()}

    def asleep(p):
        return next(a["asleep"] for a in sim.allocations() if a["address"] == p)
    """
)

# The environment variables that change what a child does; each child starts without them.
_CLEARED = ("LD_PRELOAD", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _run(body: str, preload: bool = True, prelude: bool = True, **env: str) -> subprocess.CompletedProcess:
    """Run `body` (after PRELUDE) in a child with the hook library preloaded; it prints "ok" at its end."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_") and k not in _CLEARED}
    # No GPU for the runtime, also where there is one: the forwarded calls then fail, as the tests expect, and
    # routed ones reach the simulated driver only.
    child_env["CUDA_VISIBLE_DEVICES"] = ""
    child_env.update(env)
    if preload:
        child_env["LD_PRELOAD"] = _preload.library_path()
    script = (PRELUDE if prelude else "") + textwrap.dedent(body) + '\nprint("ok")\n'
    return subprocess.run(
        [sys.executable, "-c", script], env=child_env, capture_output=True, text=True, timeout=120
    )


def _check(out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0 and out.stdout.rstrip().endswith("ok"), (out.returncode, out.stdout, out.stderr)


# -- the library file ------------------------------------------------------------------------------------------


def test_the_library_is_written_once_to_a_private_file():
    path = _preload.library_path()
    assert _preload.library_path() == path
    with open(path, "rb") as f:
        assert f.read() == _native.preload_library()
    assert _native.preload_library()[:4] == b"\x7fELF"
    st = os.stat(os.path.dirname(path))
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert not os.stat(path).st_mode & 0o222, "a written library is never changed"


def test_a_directory_others_can_write_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(_preload, "_PATH", None)
    shared = tmp_path / f"cumem_rs-{os.getuid()}"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(CumemError, match="private directory"):
        _preload.library_path()
    shared.chmod(0o700)
    assert _preload.library_path().startswith(str(shared))


def test_configure_subprocess_preloads_the_library_in_children_and_restores_ld_preload(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "libother.so")
    with configure_subprocess():
        assert os.environ["LD_PRELOAD"] == f"{_preload.library_path()}:libother.so"
        out = subprocess.run(
            [sys.executable, "-c", "import cumem_rs.memory_saver; from cumem_rs import _native; "
             "print(_native.preload_registered())"],
            capture_output=True, text=True, timeout=120,
        )
    assert os.environ["LD_PRELOAD"] == "libother.so"
    assert out.stdout.split()[-1:] == ["True"], out.stderr
    monkeypatch.delenv("LD_PRELOAD")
    with configure_subprocess():
        assert os.environ["LD_PRELOAD"] == _preload.library_path()
    assert "LD_PRELOAD" not in os.environ


def test_preload_mode_without_the_library_is_a_clear_error():
    # This test process was not started with the library preloaded.
    assert not _native.preload_register() and not _native.preload_registered()
    saver = TorchMemorySaver()
    saver.hook_mode = "preload"
    with pytest.raises(CumemError, match="configure_subprocess"):
        saver._ensure_initialized()
    assert saver._alloc is None, "nothing was set up"


# -- forwarding --------------------------------------------------------------------------------------------------


def test_a_process_that_never_imports_cumem_rs_runs_as_without_the_library():
    # No runtime here (nothing imported torch): every call is forwarded and fails with cudaErrorInitialization.
    body = """
    import ctypes
    api = ctypes.CDLL(None)
    api.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    api.cudaFree.argtypes = [ctypes.c_void_p]
    p = ctypes.c_void_p()
    assert api.cudaMalloc(ctypes.byref(p), 1 << 20) == 3 and p.value is None
    assert api.cudaFree(None) == 3 and api.cudaFree(0x7F0000000000) == 3
    assert api.tms_pause(None) == 3 and api.tms_resume(None) == 3, "no hooks: nothing to pause"
    import torch
    assert float(torch.arange(4.0).sum()) == 6.0, "torch runs under the library"
    """
    _check(_run(body, prelude=False))


def test_a_program_that_is_not_python_loads_it_without_complaint():
    # The library needs nothing but libc and libdl: a shell (and anything else a child starts) runs unchanged.
    env = dict(os.environ, LD_PRELOAD=_preload.library_path())
    out = subprocess.run(["/bin/sh", "-c", "echo fine"], env=env, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (0, "fine\n", "")


def test_calls_outside_regions_and_pointers_not_ours_are_forwarded():
    body = """
    saver._ensure_initialized()
    assert _native.preload_registered()
    assert _native.preload_routed_tag() is None
    rc, p = malloc(MiB)
    assert rc != 0 and p is None, "outside any region: the runtime's, which fails cleanly without a GPU"
    assert on_thread(lambda: malloc(MiB))[0] != 0
    with saver.region("w"):
        rc, w = malloc(MiB)
    assert rc == 0 and tags() == {w: "w"}
    assert cudaFree(None) != 0, "cudaFree(0) (context creation) is the runtime's"
    assert cudaFree(0x7F0000001000) != 0, "a pointer that is not ours is the runtime's"
    assert cudaFree(w + 4096) != 0, "an address inside ours is not a pointer we handed out"
    assert tags() == {w: "w"}
    assert cudaFree(w) == 0 and tags() == {}
    assert cudaFree(w) != 0, "freed once: a second free is the runtime's"
    assert _native.preload_live_pointers() == 0
    """
    _check(_run(body))


# -- regions ----------------------------------------------------------------------------------------------------


def test_region_allocations_land_in_the_engine_per_thread_and_pause_keeps_data():
    body = """
    with saver.region("weights", enable_cpu_backup=True):
        rc, w = malloc(3 * MiB + 5)
        assert rc == 0
        # A region is per thread, as there: another thread's allocation is the runtime's, or its own region's.
        assert on_thread(lambda: malloc(MiB))[0] != 0
        def in_region():
            with saver.region("scratch"):
                return malloc(MiB)
        rc, s = on_thread(in_region)
        assert rc == 0
        with saver.region("kv"):  # nested: the innermost tag
            rc, kv = malloc(MiB)
        rc, w2 = malloc(MiB)  # back in the outer region
    assert tags() == {w: "weights", s: "scratch", kv: "kv", w2: "weights"}
    data = os.urandom(3 * MiB + 5)
    sim.write(w, data)
    saver.pause("weights")
    assert asleep(w) and asleep(w2) and not asleep(kv)
    assert sim.usage() < 4 * MiB, "the paused memory is released"
    saver.resume("weights")
    assert sim.read(w, len(data)) == data
    saver.pause()
    assert cudaFree(w2) == 0, "freeing a paused pointer releases it"
    saver.resume()
    assert sim.read(w, len(data)) == data
    for p in (w, s, kv):
        assert cudaFree(p) == 0
    assert tags() == {}
    """
    _check(_run(body))


def test_running_out_of_device_memory_is_a_cuda_error_and_nothing_is_kept():
    body = """
    with saver.region("big"):
        rc, p = malloc(65 * MiB)
        assert rc == 2 and p is None, "cudaErrorMemoryAllocation"
        rc, p = malloc(MiB)
    assert rc == 0 and tags() == {p: "big"}
    """
    _check(_run(body))


# -- TMS_INIT_ENABLE and disable() ---------------------------------------------------------------------------------


def test_init_enable_routes_every_thread_and_disable_suspends_it():
    body = """
    saver._ensure_initialized()
    rc, a = malloc(MiB)
    assert rc == 0
    rc, b = on_thread(lambda: malloc(2 * MiB))  # a thread started later (autograd's are): routed too
    assert rc == 0 and tags() == {a: "default", b: "default"}
    with saver.region("grad"):  # a region inside TMS_INIT_ENABLE: its own tag and backup
        rc, g = malloc(MiB)
    assert tags()[g] == "grad"
    with saver.disable():
        assert _native.preload_routed_tag() is None
        assert malloc(MiB)[0] != 0, "inside disable(): the runtime's"
        assert on_thread(lambda: malloc(MiB))[0] == 0, "disable() is per thread"
    assert malloc(MiB)[0] == 0, "routed again after disable()"
    da, db = os.urandom(MiB), os.urandom(2 * MiB)
    sim.write(a, da)
    sim.write(b, db)
    saver.pause()
    assert asleep(a) and asleep(b) and asleep(g)
    assert saver._read_backup(a, MiB) == da, "TMS_INIT_ENABLE_CPU_BACKUP=1: backed up"
    saver.resume()
    assert sim.read(a, MiB) == da and sim.read(b, 2 * MiB) == db
    # torch_memory_saver's C entry points: NULL pauses every tag, a name one tag.
    assert tms_pause(None) == 0 and asleep(a) and asleep(g)
    assert tms_resume(b"default") == 0 and not asleep(a) and asleep(g)
    assert tms_resume(None) == 0 and not asleep(g)
    assert sim.read(b, 2 * MiB) == db
    assert tms_pause(b"\\xff") == 1, "a tag that is not UTF-8: cudaErrorInvalidValue"
    """
    _check(_run(body, TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1"))


def test_pause_with_nothing_but_init_enable_pauses_what_was_routed_since_import():
    """torch_memory_saver's training_engine: no region, no explicit set-up; pause() itself sets the saver up, and
    with it the default tag that TMS_INIT_ENABLE's allocations go to. (On CUDA, memory is routed from import on,
    before any set-up: test_preload_cuda's training engine is the test of that order; the simulated allocator is
    the target only once the saver is set up, here by the first pause.)"""
    body = """
    saver.pause()  # the set-up; nothing routed yet
    rc, a = malloc(MiB)
    assert rc == 0 and tags() == {a: "default"}
    data = os.urandom(MiB)
    sim.write(a, data)
    saver.pause()
    assert asleep(a) and sim.usage() == 0
    saver.resume()
    assert sim.read(a, MiB) == data
    """
    _check(_run(body, TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1"))


def test_init_enable_set_after_import_is_read_at_set_up():
    body = """
    assert _native.preload_routed_tag() is None, "not set at import: nothing routed"
    assert malloc(MiB)[0] != 0
    os.environ["TMS_INIT_ENABLE"] = "1"
    saver._ensure_initialized()
    rc, p = malloc(MiB)
    assert rc == 0 and tags() == {p: "default"}
    """
    _check(_run(body))


@pytest.mark.parametrize("name,value", [("TMS_INIT_ENABLE", "2"), ("TMS_INIT_ENABLE_CPU_BACKUP", "on")])
def test_a_bad_value_routes_nothing_and_is_a_clear_error_at_set_up(name, value):
    body = f"""
    assert _native.preload_routed_tag() is None and malloc(MiB)[0] != 0, "nothing routed"
    try:
        saver._ensure_initialized()
    except CumemValueError as e:
        assert "{name}" in str(e), e
    else:
        raise AssertionError("accepted {name}={value}")
    assert saver._alloc is None
    """
    _check(_run(body, **{"TMS_INIT_ENABLE": "1", name: value}))


def test_init_enable_in_torch_mode_is_refused():
    body = """
    saver.hook_mode = "torch"
    try:
        saver._ensure_initialized()
    except CumemValueError as e:
        assert "TMS_INIT_ENABLE" in str(e) and "preload" in str(e), e
    else:
        raise AssertionError("accepted")
    """
    _check(_run(body, TMS_INIT_ENABLE="1"))


@pytest.mark.parametrize("conf", ["backend:cudaMallocAsync", "max_split_size_mb:64,expandable_segments:True"])
@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_allocator_settings_that_bypass_cudamalloc_are_refused(name, conf):
    body = f"""
    try:
        saver._ensure_initialized()
    except CumemValueError as e:
        assert "{name}" in str(e) and "hook_mode='torch'" in str(e), e
    else:
        raise AssertionError("accepted {conf}")
    assert saver._alloc is None
    saver.hook_mode = "torch"
    saver._ensure_initialized()  # the MemPool path takes them
    """
    _check(_run(body, **{name: conf}))


def test_hook_mode_is_chosen_at_set_up_and_fixed_afterwards():
    body = """
    fresh = TorchMemorySaver(_backend=SimulatedPools(sim))
    fresh._ensure_initialized()
    assert fresh.hook_mode == "preload", "unset, with the library loaded: preload"
    fresh.hook_mode = "preload"
    try:
        fresh.hook_mode = "torch"
    except CumemValueError as e:
        assert "set up" in str(e)
    else:
        raise AssertionError("changed after set-up")
    """
    _check(_run(body))
