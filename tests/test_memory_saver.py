"""cumem_rs.memory_saver without a GPU: the torch_memory_saver 0.0.10 API is all there, bad arguments and what is
not implemented raise at the call, and a machine without a GPU gets a clear error instead of a crash.

The behaviour on a GPU (regions, pause/resume, graphs, disable, backups) is in test_memory_saver_cuda.py; pause,
resume, backups and the TMS_* environment over the simulated device in test_memory_saver_sim.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import inspect

import pytest

torch = pytest.importorskip("torch")

import cumem_rs  # noqa: E402
from cumem_rs import CumemError  # noqa: E402
from cumem_rs._sim_pools import SimulatedPools  # noqa: E402
from cumem_rs.memory_saver import TorchMemorySaver, configure_subprocess, torch_memory_saver  # noqa: E402

HAS_CUDA = cumem_rs.cuda_available()

# The public methods of torch_memory_saver 0.0.10's TorchMemorySaver: parameter names and defaults, in order.
TMS_0_0_10_METHODS = {
    "region": [("tag", "default"), ("enable_cpu_backup", False), ("enable_disk_backup", False),
               ("cpu_backup_backend", None)],
    "cuda_graph": [("cuda_graph", inspect.Parameter.empty), ("pool", None), ("stream", None),
                   ("capture_error_mode", "global"), ("tag", "default"), ("enable_cpu_backup", False),
                   ("cpu_backup_backend", None)],
    "disable": [],
    "pause": [("tag", None)],
    "resume": [("tag", None)],
    "get_cpu_backup": [("x", inspect.Parameter.empty), ("zero_copy", False)],
    "set_disk_backup_dir": [("path", inspect.Parameter.empty)],
    "_ensure_initialized": [],
}
TMS_0_0_10_PROPERTIES = ["enabled", "hook_mode", "memory_margin_bytes", "retain_cpu_backup"]


@pytest.mark.parametrize("name", sorted(TMS_0_0_10_METHODS))
def test_every_method_of_0_0_10_with_its_parameters(name):
    params = list(inspect.signature(getattr(TorchMemorySaver, name)).parameters.values())[1:]
    assert [(p.name, p.default) for p in params] == TMS_0_0_10_METHODS[name]


@pytest.mark.parametrize("name", TMS_0_0_10_PROPERTIES)
def test_every_property_of_0_0_10_is_settable(name):
    prop = getattr(TorchMemorySaver, name)
    assert isinstance(prop, property)
    assert name == "enabled" or prop.fset is not None


def test_module_level_names():
    assert isinstance(torch_memory_saver, TorchMemorySaver)
    assert torch_memory_saver.enabled is True
    with configure_subprocess():  # LD_PRELOAD for children: the preload hook library (test_preload.py)
        pass


@pytest.fixture
def saver() -> Iterator[TorchMemorySaver]:
    """A fresh saver (settings are per object) that has not touched the GPU. A test that initialises it sets the
    shared allocator's process-wide keep_host_memory (torch_memory_saver's retain_cpu_backup): put back after it,
    to the allocator's default (True), so that later modules see it."""
    s = TorchMemorySaver()
    yield s
    if s._alloc is not None:
        s._alloc.native.set_keep_host_memory(True)


def test_disk_backup_arguments_are_checked_at_the_call(saver):
    # Disk backup is the file tier now (test_memory_saver_sim.py); what is refused is refused before any set-up.
    with pytest.raises(ValueError, match="mutually exclusive"):
        saver.region(tag="weights", enable_cpu_backup=True, enable_disk_backup=True)
    with pytest.raises(TypeError, match="path"):
        saver.set_disk_backup_dir(7)  # type: ignore[arg-type]
    assert saver._alloc is None, "refusing must not initialise the allocator"


BAD_BACKUP_ARGUMENTS = [
    ({"cpu_backup_backend": "mmap"}, ValueError, "requires enable_cpu_backup=True"),
    ({"enable_cpu_backup": True, "cpu_backup_backend": "disk"}, ValueError, "cpu_backup_backend"),
    ({"enable_cpu_backup": "yes"}, TypeError, "enable_cpu_backup"),
    ({"tag": 3}, TypeError, "tag"),
    ({"tag": ""}, ValueError, "tag"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_BACKUP_ARGUMENTS + [({"enable_disk_backup": 1}, TypeError, "disk")])
def test_bad_region_arguments_raise_at_the_call(saver, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        saver.region(**kwargs)
    assert saver._alloc is None


@pytest.mark.parametrize("kwargs,exc,match", BAD_BACKUP_ARGUMENTS)
def test_bad_cuda_graph_arguments_raise_at_the_call(saver, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        saver.cuda_graph(None, **kwargs)
    assert saver._alloc is None


@pytest.mark.parametrize("pool", ["pool", (1, 2, 3), 7])
def test_cuda_graph_pool_must_be_a_pool_token(saver, pool):
    with pytest.raises(TypeError, match="pool"):
        saver.cuda_graph(None, pool=pool)


@pytest.mark.parametrize("backend", ["pinned", "mmap"])
def test_cpu_backup_backends_are_accepted(saver, backend):
    """Both of torch_memory_saver's backends are accepted before any set-up, and a region of either (over the
    simulated device) reports it as torch_memory_saver's getter does and backs its memory up to host memory."""
    saver.region(enable_cpu_backup=True, cpu_backup_backend=backend)  # validated, not entered
    assert saver._alloc is None, "validating a region must not set the saver up"
    sim = cumem_rs.Allocator.simulated(devices=1)
    try:
        on_sim = TorchMemorySaver(_backend=SimulatedPools(sim))
        getters = on_sim._impl._binary_wrapper.cdll
        with on_sim.region("w", enable_cpu_backup=True, cpu_backup_backend=backend):
            assert getters.tms_get_cpu_backup_backend() == backend.encode()
            assert getters.tms_get_enable_cpu_backup()
            p = sim.malloc(4096)
        sim.write(p, b"tms" * 100)
        on_sim.pause("w")
        assert sim.read_backup(p, 300) == b"tms" * 100, "the region's memory was backed up"
        on_sim.resume("w")
        assert sim.read(p, 300) == b"tms" * 100
    finally:
        sim.close()


def test_hook_mode_is_accepted_and_checked(saver):
    assert saver.hook_mode == "preload"
    saver.hook_mode = "torch"
    assert saver.hook_mode == "torch"
    with pytest.raises(ValueError, match="hook_mode"):
        saver.hook_mode = "ld_preload"  # type: ignore[assignment]
    assert saver.hook_mode == "torch"


def test_memory_margin_bytes_is_checked(saver):
    assert saver.memory_margin_bytes == 0
    saver.memory_margin_bytes = 1 << 30
    assert saver.memory_margin_bytes == 1 << 30
    for bad, exc in ((-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="memory_margin_bytes"):
            saver.memory_margin_bytes = bad  # type: ignore[assignment]
    assert saver.memory_margin_bytes == 1 << 30


@pytest.mark.skipif(HAS_CUDA, reason="asserts the behaviour without a GPU; this machine has one")
def test_without_a_gpu_every_allocator_call_raises_a_clear_error(saver):
    with pytest.raises(CumemError, match="GPU"):
        with saver.region(tag="weights"):
            pass
    for call in (saver.pause, saver.resume, lambda: saver.retain_cpu_backup):
        with pytest.raises(CumemError, match="GPU"):
            call()
    with pytest.raises(ValueError, match="CUDA tensor"):
        saver.get_cpu_backup(torch.zeros(4))
    with pytest.raises(TypeError, match="Tensor"):
        saver.get_cpu_backup([1, 2])  # type: ignore[arg-type]
