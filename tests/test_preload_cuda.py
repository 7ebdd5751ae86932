"""hook_mode="preload" on a GPU: torch's own caching allocator, in child processes started inside
`configure_subprocess()` (the hook library in LD_PRELOAD), routed into cumem_rs.

* A training engine (torch_memory_saver's `training_engine` example, here with a real optimizer): with
  TMS_INIT_ENABLE=1 and TMS_INIT_ENABLE_CPU_BACKUP=1, params, grads (made on autograd's backward thread) and Adam's
  states are all paused, GPU memory drops to within the initial level + 200 MiB, and resume brings them back
  bit-identical; training goes on.
* Regions, disable(), a CUDA graph and raw cudaMalloc/tms_pause through ctypes, without TMS_INIT_ENABLE.

Skipped unless torch sees a GPU and cumem_rs can load the CUDA driver. The simulated-driver tests of the same hooks
are in test_preload.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

import cumem_rs  # noqa: E402
from cumem_rs.memory_saver import configure_subprocess  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and cumem_rs.cuda_available()),
    reason="needs a CUDA GPU visible to both torch and cumem_rs",
)

PRELUDE = textwrap.dedent(
    """
    import ctypes, threading
    import torch
    from cumem_rs import Allocator, _native
    from cumem_rs.memory_saver import torch_memory_saver as tms

    MiB = 1 << 20
    assert _native.preload_registered(), "the hook library is loaded and the hooks installed"

    def used():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free

    def tag_of(t):
        ptr = t.data_ptr()
        rows = Allocator.cuda().allocations()
        return next((r["tag"] for r in rows if r["address"] <= ptr < r["address"] + r["size"]), None)
    """
)


def _run(body: str, **env: str) -> None:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_")}
    child_env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    child_env.update(env)
    script = PRELUDE + textwrap.dedent(body) + '\nprint("ok")\n'
    with configure_subprocess():
        child_env["LD_PRELOAD"] = os.environ["LD_PRELOAD"]
        out = subprocess.run(
            [sys.executable, "-c", script], env=child_env, capture_output=True, text=True, timeout=600
        )
    assert out.returncode == 0 and out.stdout.rstrip().endswith("ok"), (out.returncode, out.stdout, out.stderr)


def test_training_engine_params_grads_and_adam_states_pause_to_the_initial_level():
    body = """
    assert _native.preload_init_enable()
    # One small step first, so that the context and the lazily loaded kernel code (not pausable: not allocations)
    # exist before the initial level is taken; its memory is cumem_rs's too and pauses with the rest.
    warm = torch.nn.Linear(4096, 4096).cuda()
    warm_opt = torch.optim.Adam(warm.parameters())
    warm(torch.randn(256, 4096, device="cuda")).square().mean().backward()
    warm_opt.step()
    del warm, warm_opt
    initial = used()
    torch.manual_seed(0)
    # ~805 MB of fp32 params; grads and Adam's two states make ~3.2 GB.
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(12)]).cuda()
    opt = torch.optim.Adam(model.parameters())
    backward_threads = set()
    for p in model.parameters():
        p.register_hook(lambda g: backward_threads.add(threading.get_ident()) or g)
    x = torch.randn(256, 4096, device="cuda")
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
    assert backward_threads and threading.get_ident() not in backward_threads, "autograd's own thread made grads"
    params = list(model.parameters())
    states = [s for st in opt.state.values() for s in st.values() if torch.is_tensor(s) and s.is_cuda]
    tensors = params + [p.grad for p in params] + states
    assert len(states) == 2 * len(params)
    assert {tag_of(t) for t in tensors} == {"default"}, "every one is cumem_rs memory under the default tag"
    snapshot = [t.detach().cpu().clone() for t in tensors]
    peak = used()
    assert peak > initial + 3 * 10**9, (initial, peak)

    tms.pause()
    paused = used()
    assert paused < initial + 200 * MiB, f"paused at {paused / MiB:.0f} MiB, initial {initial / MiB:.0f} MiB"
    with tms.disable():  # torch's own memory meanwhile, as there
        scratch = torch.full((256 * MiB,), 5, dtype=torch.uint8, device="cuda")
        assert tag_of(scratch) is None and int(scratch.sum()) == 5 * 256 * MiB
        del scratch
    tms.resume()
    assert all(torch.equal(t.detach().cpu(), s) for t, s in zip(tensors, snapshot)), "bit-identical after resume"
    model(x).square().mean().backward()
    opt.step()
    torch.cuda.synchronize()
    """
    _run(body, TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")


def test_regions_disable_graphs_and_raw_cudamalloc_through_the_hook():
    body = """
    assert tms.hook_mode == "preload" and not _native.preload_init_enable()
    with tms.region("pl_weights", enable_cpu_backup=True):
        w = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8, device="cuda")
        with tms.disable():
            d = torch.ones(MiB, device="cuda")
    with tms.region("pl_kv"):
        kv = torch.ones(16 * MiB, device="cuda")
    outside = torch.ones(MiB, device="cuda")
    assert (tag_of(w), tag_of(kv), tag_of(d), tag_of(outside)) == ("pl_weights", "pl_kv", None, None)
    ref = w.cpu()
    before = used()
    tms.pause()
    assert used() < before - 100 * MiB
    outside += 1  # memory not ours keeps working while paused
    tms.resume()
    assert torch.equal(w.cpu(), ref) and float(outside[0]) == 2.0

    static_in = torch.full((MiB,), 1.0, device="cuda")
    g = torch.cuda.CUDAGraph()
    with tms.cuda_graph(g, tag="pl_graph"):
        out = static_in * 2
    assert tag_of(out) == "pl_graph"
    tms.pause("pl_graph")
    tms.resume("pl_graph")
    static_in.fill_(3.0)
    g.replay()
    assert float(out[0]) == 6.0

    # torch_memory_saver's cuda_vmm_granularity example: an unaligned raw cudaMalloc, tms_pause/tms_resume.
    api = ctypes.CDLL(None)
    api.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    api.cudaFree.argtypes = [ctypes.c_void_p]
    api.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    api.tms_pause.argtypes = api.tms_resume.argtypes = [ctypes.c_char_p]
    p = ctypes.c_void_p()
    with tms.region("pl_raw", enable_cpu_backup=True):
        assert api.cudaMalloc(ctypes.byref(p), 6912) == 0
    src, dst = ctypes.c_ubyte(0xA5), ctypes.c_ubyte()
    assert api.cudaMemcpy(p, ctypes.byref(src), 1, 1) == 0
    assert api.tms_pause(b"pl_raw") == 0 and api.tms_resume(b"pl_raw") == 0
    assert api.cudaMemcpy(ctypes.byref(dst), p, 1, 2) == 0 and dst.value == 0xA5
    assert api.cudaFree(p) == 0 and _native.preload_live_pointers() > 0  # torch's segments stay ours
    """
    _run(body)


def test_a_region_entered_while_its_tag_is_paused_gets_fresh_memory():
    """A region's pool in preload mode lives across its blocks and keeps its segments' free blocks. After a pause
    they lie in unmapped memory: torch would hand the next tensor of that region one of them, and its first write
    would end the CUDA context. The region takes a fresh pool instead; the paused tensor resumes intact."""
    body = """
    with tms.region("pl_paused", enable_cpu_backup=True):
        a = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda")
        b = torch.empty((1 << 20,), dtype=torch.uint8, device="cuda")  # 1 MiB each: one 2 MiB segment
    b_ptr = b.data_ptr()
    del b  # its block stays cached in the region's pool, inside the segment the pause unmaps
    tms.pause("pl_paused")
    with tms.region("pl_paused", enable_cpu_backup=True):
        c = torch.empty((1 << 20,), dtype=torch.uint8, device="cuda")
    assert c.data_ptr() != b_ptr, "handed the cached block of a paused segment"
    c.fill_(3)
    torch.cuda.synchronize()
    assert tag_of(c) is not None
    tms.resume("pl_paused")
    assert torch.equal(a.cpu(), torch.full((1 << 20,), 7, dtype=torch.uint8))
    assert int(c.sum()) == 3 << 20
    """
    _run(body)
