"""cumem_rs as vLLM's sleep-mode backend, checked against vLLM 0.33.0's own modules.

vLLM's modules come from `.vllm_src` (`scripts/vllm_files.sh`; `scripts/dev.sh test` fetches them; the environment
variable CUMEM_TEST_VLLM_SRC names another place, e.g. for tests run outside the source tree): its sleep-mode
backend registry, allocator, plugin loader and platform layer, without compiled extensions (as a vLLM build without
CUDA has them). Importing vLLM changes process-wide state (environment variables torch reads, inductor patches), so
every check that imports it runs in a child Python with `.vllm_src` on its PYTHONPATH; the rest of the suite never
sees vLLM. The tests skip, saying why, when those modules are not there.

The GPU test replays a vLLM worker's own calls: allocations through `get_mem_allocator_instance()` under the tags
the worker uses, a CUDA graph captured through `cudagraph_pool()`, and sleep levels 1 and 2 through the backend
that vLLM's factory creates, checking the memory freed and the data kept.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import cumem_rs
import cumem_rs.vllm_plugin

ROOT = Path(__file__).resolve().parent.parent
VLLM_SRC = Path(os.environ.get("CUMEM_TEST_VLLM_SRC") or ROOT / ".vllm_src")
HAS_CUDA = cumem_rs.cuda_available()


def _missing() -> str:
    if sys.version_info < (3, 11):
        return "vLLM 0.33.0 needs Python >= 3.11"
    if not (VLLM_SRC / "VLLM_VERSION").is_file():
        return f"vLLM's modules are not in {VLLM_SRC} (scripts/dev.sh test fetches them: scripts/vllm_files.sh)"
    for module in ("regex", "psutil"):
        if importlib.util.find_spec(module) is None and not (VLLM_SRC / "deps" / module).is_dir():
            return f"{module!r}, which vLLM's modules import, is not installed (pip install regex psutil)"
    return ""


needs_vllm = pytest.mark.skipif(bool(_missing()), reason=_missing() or "-")

# Shared by every child: helpers over the plugin and vLLM's allocator class. The first line (see _child) appends
# DEST/deps of scripts/vllm_files.sh to sys.path: after the installed packages, which win.
PRELUDE = '''
import inspect, logging, os, sys
from types import SimpleNamespace

import cumem_rs
import cumem_rs.vllm_plugin as plugin
from cumem_rs import CumemError


def config(backend):
    """A vLLM config as vLLM's code reads the selection: `model_config.sleep_mode_backend`."""
    return SimpleNamespace(model_config=SimpleNamespace(sleep_mode_backend=backend))


def serving():
    """Whose allocator vLLM's `CuMemAllocator.get_instance()` hands out, "cumem_rs" or "vllm". Without compiled
    extensions vLLM's own raises AssertionError ("cumem allocator is not available"); without a GPU ours raises
    CumemError."""
    from vllm.device_allocator.cumem import CuMemAllocator
    try:
        instance = CuMemAllocator.get_instance()
    except AssertionError:
        return "vllm"
    except CumemError:
        return "cumem_rs"
    return "cumem_rs" if isinstance(instance, cumem_rs.CuMemAllocator) else "vllm"


def our_hooks():
    return [f for f in sys.meta_path if getattr(f, "_cumem_rs_wrapped", False)]
'''


def _child(code: str, vllm_path: Path = VLLM_SRC, timeout: float = 600) -> str:
    env = dict(os.environ)
    env.pop(cumem_rs.vllm_plugin.ENV_VAR, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(vllm_path), env.get("PYTHONPATH", "")) if p)
    deps = f"import sys; sys.path.append({str(vllm_path / 'deps')!r})\n"
    r = subprocess.run([sys.executable, "-c", deps + PRELUDE + textwrap.dedent(code)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"child failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-6000:]}"
    return r.stdout


def test_entry_point_is_in_the_installed_metadata() -> None:
    eps = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "cumem_rs"]
    assert [ep.value for ep in eps] == ["cumem_rs.vllm_plugin:register"], (
        "the vllm.general_plugins entry point of pyproject.toml is not installed: rebuild (scripts/dev.sh build)"
    )


@needs_vllm
def test_vllm_sources_hold_what_the_plugin_relies_on() -> None:
    """What the plugin assumes about vLLM modules that cannot be imported here (they need vLLM's full dependencies)."""

    def tree(rel: str) -> ast.Module:
        return ast.parse((VLLM_SRC / rel).read_text(), rel)

    def member(node: ast.AST, name: str) -> ast.AST:
        return next(n for n in ast.iter_child_nodes(node) if getattr(n, "name", None) == name)

    # Source 2 of selected(): the getter of vLLM's current config.
    config = tree("vllm/config/vllm.py")
    for name in ("set_current_vllm_config", "get_current_vllm_config_or_none"):
        member(config, name)
    # Source 3: WorkerBase.__init__ stores the worker's config as self.vllm_config.
    init = member(member(tree("vllm/v1/worker/worker_base.py"), "WorkerBase"), "__init__")
    stored = [t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"]
    assert "vllm_config" in stored
    # Why source 3 is needed: Worker.load_model enters the weights pool before it makes its config current.
    load_model = member(member(tree("vllm/v1/worker/gpu_worker.py"), "Worker"), "load_model")
    with_node = next(n for n in ast.walk(load_model) if isinstance(n, ast.With))
    entered = [ast.unparse(item.context_expr.func) for item in with_node.items
               if isinstance(item.context_expr, ast.Call)]
    assert entered.index("self._maybe_get_memory_pool_context") < entered.index("set_current_vllm_config")
    # The routing point: every CUDA caller of get_mem_allocator_instance() ends in CuMemAllocator.get_instance().
    getter = member(tree("vllm/device_allocator/__init__.py"), "get_mem_allocator_instance")
    assert "CuMemAllocator.get_instance()" in ast.unparse(getter)


@needs_vllm
def test_vllm_loads_the_plugin_and_resolves_the_backend() -> None:
    _child('''
        import torch
        import vllm.plugins
        from vllm.device_allocator.sleep_mode_backend import CuMemBackend, SleepModeBackend, SleepModeBackendFactory

        vllm.plugins.load_general_plugins()
        # Cheap: nothing of CUDA, of cumem_rs's torch layer, or of the vLLM modules it wraps was imported.
        assert not torch.cuda.is_initialized()
        for name in ("vllm.device_allocator.cumem", "vllm.v1.worker.worker_base", "cumem_rs.allocator"):
            assert name not in sys.modules, name
        assert sorted(f.name for f in our_hooks()) == ["vllm.device_allocator.cumem", "vllm.v1.worker.worker_base"]

        cls = SleepModeBackendFactory.get_backend_class("cumem_rs")
        from cumem_rs.vllm_backend import CumemRsBackend
        assert cls is CumemRsBackend and issubclass(cls, SleepModeBackend) and not inspect.isabstract(cls)
        assert cls.preserves_communicators() and cls.preserves_compiled_artifacts()
        assert cls.preserves_graphs_with_communicators() and not cls.supports_durable_storage()
        assert cls.is_supported() == cumem_rs.cuda_available()
        assert SleepModeBackendFactory.get_backend_class("cumem") is CuMemBackend

        # vLLM's own checks when it creates the selected backend.
        selection = SimpleNamespace(sleep_mode_backend="cumem_rs")
        if cumem_rs.cuda_available():
            backend = SleepModeBackendFactory.create_backend(selection)
            assert isinstance(backend, cls) and backend.state() == "RUNNING"
        else:
            try:
                SleepModeBackendFactory.create_backend(selection)
                raise AssertionError("created without a GPU")
            except ValueError as e:
                assert "not supported on this platform" in str(e), e

        # Loaded again (vLLM does so per process, possibly several times): harmless, nothing doubled.
        hooks = our_hooks()
        plugin.register()
        vllm.plugins.plugins_loaded = False
        vllm.plugins.load_general_plugins()
        assert our_hooks() == hooks
        assert SleepModeBackendFactory.get_backend_class("cumem_rs") is cls
        try:
            SleepModeBackendFactory.get_backend_class("unknown")
        except ValueError as e:
            assert "Registered backends: cumem, cumem_rs." in str(e), e

        # Our CuMemAllocator takes every call vLLM makes on its own: the MemAllocator protocol with compatible
        # parameters, and every public name of vLLM's CuMemAllocator.
        from vllm.device_allocator import MemAllocator
        import vllm.device_allocator.cumem as vllm_cumem
        from cumem_rs.allocator import CuMemAllocator
        declared = sorted(n for n, v in vars(MemAllocator).items() if callable(v) and not n.startswith("_"))
        assert declared == ["discard", "get_current_usage", "sleep", "use_memory_pool", "wake_up"], declared
        for name in declared:
            ours = inspect.signature(getattr(CuMemAllocator, name)).parameters
            for p in inspect.signature(getattr(MemAllocator, name)).parameters.values():
                assert p.name in ours, (name, p.name)
                if p.default is not inspect.Parameter.empty:
                    assert ours[p.name].default == p.default, (name, p.name)
        public = {n for n in vars(vllm_cumem.CuMemAllocator) if not n.startswith("_")}
        assert public <= set(dir(CuMemAllocator)), public - set(dir(CuMemAllocator))
        assert CuMemAllocator.default_tag == vllm_cumem.CuMemAllocator.default_tag
        assert CuMemAllocator.use_cudagraph_pool is CuMemAllocator.cudagraph_pool
    ''')


@needs_vllm
def test_backend_asks_the_allocator_what_vllms_own_backend_asks() -> None:
    """Against vLLM 0.33's `CuMemBackend`: each level backs up the same tags (runtime state and graph memory at both,
    weights at level 1 only), resume and discard pass their tags on as they are, and every capability flag that
    `SleepModeBackend` defines is answered by our backend itself. An allocator that records the calls stands in for
    both backends' allocator (no GPU: the calls, not the memory, are compared here; the GPU test runs them)."""
    _child('''
        import vllm.device_allocator
        from vllm.device_allocator.sleep_mode_backend import CuMemBackend, SleepModeBackend
        from cumem_rs.vllm_backend import CumemRsBackend

        class Recorder:
            def __init__(self):
                self.calls = []
                self.native = SimpleNamespace(allocations=lambda: [])
            def sleep(self, offload_tags=None):
                self.calls.append(("sleep", frozenset(offload_tags)))
            def wake_up(self, tags=None):
                self.calls.append(("wake_up", tags))
            def discard(self, tags):
                self.calls.append(("discard", tuple(tags)))

        def calls_of(backend, recorder):
            for level in (1, 2):
                backend.suspend(level)
                backend.resume(["weights"])
                backend.resume(None)
            backend.discard(("kv_cache",))
            return recorder.calls

        theirs, ours = Recorder(), Recorder()
        vllm.device_allocator.get_mem_allocator_instance = lambda: theirs  # CuMemBackend imports it per call

        class Ours(CumemRsBackend):
            def _allocator(self):
                return ours

        assert calls_of(CuMemBackend(), theirs) == calls_of(Ours(), ours), (theirs.calls, ours.calls)
        assert theirs.calls[0] == ("sleep", {"weights", "runtime", "cudagraph"}), theirs.calls
        assert theirs.calls[3] == ("sleep", {"runtime", "cudagraph"}), theirs.calls

        flags = sorted(n for n, v in vars(SleepModeBackend).items() if isinstance(v, classmethod))
        assert flags == ["is_supported", "preserves_communicators", "preserves_compiled_artifacts",
                         "preserves_graphs_with_communicators", "supports_durable_storage"], flags
        for name in flags:
            assert name in vars(CumemRsBackend), f"{name} is SleepModeBackend's default, not ours"
    ''')


@needs_vllm
def test_allocator_routing_follows_the_selection() -> None:
    _child('''
        import types
        import vllm.plugins
        vllm.plugins.load_general_plugins()
        import vllm.device_allocator.cumem as vllm_cumem  # the plugin wraps get_instance as vLLM imports it
        wrapped = vllm_cumem.CuMemAllocator.get_instance
        assert not hasattr(wrapped.__wrapped__, "__wrapped__"), "wrapped twice"
        assert [f.name for f in our_hooks()] == ["vllm.v1.worker.worker_base"]  # the allocator's hook is done

        # Without a selection vLLM keeps its own allocator.
        assert not plugin.selected() and serving() == "vllm"
        assert vllm_cumem.CuMemAllocator.instance is None

        # Source 3: the config of the vLLM worker built in this process. This stands in for vLLM's WorkerBase
        # (its __init__ stores the config the same way: test_vllm_sources_hold_what_the_plugin_relies_on).
        class WorkerBase:
            def __init__(self, vllm_config, local_rank=0):
                self.vllm_config = vllm_config

        class Worker(WorkerBase):
            def __init__(self, vllm_config):
                super().__init__(vllm_config)

        plugin.record_worker_selection(WorkerBase)
        plugin.record_worker_selection(WorkerBase)
        assert not hasattr(WorkerBase.__init__.__wrapped__, "__wrapped__"), "wrapped twice"
        Worker(config("cumem"))
        assert not plugin.selected() and serving() == "vllm"
        Worker(config("cumem_rs"))
        assert plugin.selected() and serving() == "cumem_rs"

        # Source 1, the environment, overrides the config either way.
        os.environ["CUMEM_RS_VLLM"] = "0"
        assert serving() == "vllm"
        Worker(config("cumem"))
        os.environ["CUMEM_RS_VLLM"] = "1"
        assert serving() == "cumem_rs"
        os.environ["CUMEM_RS_VLLM"] = "maybe"
        try:
            serving()
            raise AssertionError("accepted CUMEM_RS_VLLM=maybe")
        except ValueError as e:
            assert "CUMEM_RS_VLLM='maybe'" in str(e), e
        del os.environ["CUMEM_RS_VLLM"]
        assert serving() == "vllm"

        # Source 2, vLLM's current config. vLLM's config module needs its full dependencies, so a module with
        # the same getter stands in (the getter's presence in vLLM is checked on its source).
        current = types.ModuleType("vllm.config.vllm")
        current.get_current_vllm_config_or_none = lambda: None
        sys.modules["vllm.config.vllm"] = current
        assert serving() == "vllm"
        current.get_current_vllm_config_or_none = lambda: config("cumem_rs")
        assert serving() == "cumem_rs"
        Worker(config("cumem_rs"))
        current.get_current_vllm_config_or_none = lambda: config("cumem")
        assert serving() == "vllm", "the current config outranks the worker's"
        current.get_current_vllm_config_or_none = lambda: SimpleNamespace(model_config=None)
        assert serving() == "cumem_rs", "a config without a model config leaves it to the worker's"
        del sys.modules["vllm.config.vllm"]

        # Memory already in vLLM's own allocator cannot follow a late switch: a clear error, not a silent split.
        class Holding:
            def get_current_usage(self):
                return 1 << 20
        vllm_cumem.CuMemAllocator.instance = Holding()
        try:
            vllm_cumem.CuMemAllocator.get_instance()
            raise AssertionError("switched with memory in vLLM's allocator")
        except RuntimeError as e:
            assert "1048576 bytes" in str(e) and "CUMEM_RS_VLLM=1" in str(e), e
        vllm_cumem.CuMemAllocator.instance = None
    ''')


@needs_vllm
def test_wraps_apply_to_vllm_modules_imported_before_the_plugin() -> None:
    _child('''
        import vllm.device_allocator.cumem as vllm_cumem
        original = vllm_cumem.CuMemAllocator.get_instance
        plugin.register()
        assert vllm_cumem.CuMemAllocator.get_instance.__wrapped__ is original
        assert [f.name for f in our_hooks()] == ["vllm.v1.worker.worker_base"]
        assert serving() == "vllm"
        os.environ["CUMEM_RS_VLLM"] = "1"
        assert serving() == "cumem_rs"
    ''')


@needs_vllm
def test_older_vllm_without_the_backend_registry(tmp_path: Path) -> None:
    # The same vLLM modules minus the registry: what the plugin finds in vLLM < 0.33.
    old = tmp_path / "vllm_src"
    shutil.copytree(VLLM_SRC, old)
    (old / "vllm" / "device_allocator" / "sleep_mode_backend.py").unlink()
    out = _child('''
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("cumem_rs").addHandler(handler)
        logging.getLogger("cumem_rs").setLevel(logging.DEBUG)

        import vllm.plugins
        vllm.plugins.load_general_plugins()
        plugin.register()
        print(*[r.getMessage() for r in records], sep="\\n")
        assert len(records) == 1 and "no sleep-mode backend registry" in records[0].getMessage()
        assert not our_hooks()
        import torch
        assert not torch.cuda.is_initialized()
        import vllm.device_allocator.cumem as vllm_cumem
        assert not hasattr(vllm_cumem.CuMemAllocator.get_instance, "__wrapped__")
        os.environ["CUMEM_RS_VLLM"] = "1"
        assert serving() == "vllm"
    ''', vllm_path=old)
    assert "does nothing" in out


@needs_vllm
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (cuda_available() is False)")
def test_worker_call_sequence_on_gpu() -> None:
    print(_child('''
        import torch
        import vllm.platforms

        try:  # a full vLLM install: its own CUDA platform
            import vllm.platforms.cuda
        except Exception:  # vLLM's modules without its compiled kernels: the platform object says CUDA all the same
            from vllm.platforms.interface import Platform, PlatformEnum

            class CudaWithoutKernels(Platform):
                _enum = PlatformEnum.CUDA
                device_name = device_type = "cuda"
                dispatch_key = "CUDA"

            vllm.platforms._current_platform = CudaWithoutKernels()

        import vllm.plugins
        vllm.plugins.load_general_plugins()
        plugin.register()  # in case the installed metadata lacks the entry point (checked on its own elsewhere)
        from vllm.device_allocator import get_mem_allocator_instance
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
        from cumem_rs.allocator import CuMemAllocator

        MiB = 1 << 20
        dev = torch.device("cuda", 0)
        model_config = SimpleNamespace(sleep_mode_backend="cumem_rs")
        plugin.note_worker_config(SimpleNamespace(model_config=model_config))  # what vLLM's WorkerBase notes

        allocator = get_mem_allocator_instance()
        assert isinstance(allocator, CuMemAllocator), allocator
        assert allocator.get_current_usage() == 0  # the worker's own check before loading weights
        torch.manual_seed(0)
        with allocator.use_memory_pool(tag="weights"):
            weights = [torch.randn(2048, 8192, device=dev) for _ in range(4)]  # 4 x 64 MiB
        with get_mem_allocator_instance().use_memory_pool(tag="runtime"):  # as the worker nests KV set-up
            with get_mem_allocator_instance().use_memory_pool(tag="kv_cache"):
                kv_cache = torch.ones(128 * MiB, dtype=torch.float32, device=dev)  # 512 MiB
            runtime = torch.arange(16 * MiB, dtype=torch.float32, device=dev)  # 64 MiB
        with get_mem_allocator_instance().use_memory_pool(tag="workspace"):
            workspace = torch.zeros(64 * MiB, dtype=torch.uint8, device=dev)
        assert get_mem_allocator_instance() is allocator
        weights_ref = [w.cpu() for w in weights]
        runtime_ref = runtime.cpu()

        x = torch.randn(8192, 64, device=dev)  # torch's own memory, untouched by sleep
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            weights[0] @ x
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with allocator.cudagraph_pool() as pool:
            with torch.cuda.graph(graph, pool=pool):
                y = torch.relu(weights[0] @ x) + weights[1][:, :64]
        graph.replay()
        torch.cuda.synchronize()
        y_ref = y.clone()

        backend = SleepModeBackendFactory.create_backend(model_config)
        assert type(backend).__name__ == "CumemRsBackend" and backend.state() == "RUNNING"
        held = allocator.get_current_usage()
        assert held >= 896 * MiB, held

        def suspend(level, kept):
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
            backend.suspend(level)
            freed = torch.cuda.mem_get_info()[0] - free_before
            # Slack: a sleep may load cumem_rs's fingerprint kernel and its staging buffer onto the device.
            assert freed >= held - 32 * MiB, (level, freed, held)
            records = allocator.native.allocations()
            assert all(a["asleep"] for a in records)
            assert {a["tag"] for a in records if a["backed_up"]} == kept, records
            assert backend.state() == "SUSPENDED"
            print(f"suspend({level}) freed {freed / MiB:.0f} MiB of {held / MiB:.0f} MiB held")

        def asleep():
            return {a["tag"] for a in allocator.native.allocations() if a["asleep"]}

        suspend(1, {"weights", "runtime", "cudagraph"})
        backend.resume(["weights"])  # runtime, workspace and graph memory wake with it: they are not deferrable
        assert asleep() == {"kv_cache"} and backend.state() == "SUSPENDED"
        assert all(torch.equal(w.cpu(), r) for w, r in zip(weights, weights_ref))
        assert torch.equal(runtime.cpu(), runtime_ref)
        backend.resume(["kv_cache"])
        assert not asleep() and backend.state() == "RUNNING"
        kv_cache.fill_(1)  # discarded at sleep: refilled before use
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, y_ref)

        backend.discard(("kv_cache",))
        assert asleep() == {"kv_cache"} and backend.state() == "SUSPENDED"
        backend.resume(["kv_cache"])
        assert backend.state() == "RUNNING"

        suspend(2, {"runtime", "cudagraph"})
        backend.resume()
        assert not asleep() and backend.state() == "RUNNING"
        assert torch.equal(runtime.cpu(), runtime_ref)
        for w, r in zip(weights, weights_ref):  # level 2 discards weights: vLLM reloads them
            w.copy_(r)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, y_ref)
        assert vllm.device_allocator.cumem.CuMemAllocator.instance is None  # vLLM's own allocator never used
        print("worker sequence ok")
    '''))
