"""vLLM's record-level API: `CuMemAllocator.pointer_to_data`, `allocator_and_pools`, `current_tag`, `lib_name`.

The mapping behind `pointer_to_data` (`cumem_rs._records.AllocationRecords`) reads any core allocator, so its
behaviour is checked on the simulated driver here: a live view (never a stale copy), vLLM's field names and
meanings, and what vLLM code measures through it (`mapped_usage` of vLLM's tests). The torch layer's attributes
need a GPU; those tests skip without one.
"""

from __future__ import annotations

import ctypes
import gc

import pytest

torch = pytest.importorskip("torch")

import cumem_rs  # noqa: E402
from cumem_rs import ClosedError, CumemTypeError, CumemValueError  # noqa: E402
from cumem_rs._records import NO_DRIVER_HANDLE, AllocationRecords  # noqa: E402
from conftest import HAS_CUDA, SIM_GRANULARITY  # noqa: E402

MiB = 1 << 20
G = SIM_GRANULARITY


def mapped_usage(records) -> int:
    """What vLLM's tests measure: the bytes of the records that are not asleep."""
    return sum(d.handle[1] for d in records.values() if not d.is_asleep)


def malloc(a, size: int, tag: str) -> int:
    a.push_tag(tag)
    try:
        return a.malloc(size)
    finally:
        a.pop_tag()


# --- the mapping, on the simulated driver ------------------------------------------------------------------------


def test_records_are_a_live_view(sim):
    records = AllocationRecords(sim)  # made before anything exists: every access asks the allocator
    assert len(records) == 0 and list(records) == [] and dict(records.items()) == {}
    w = malloc(sim, G + 1, "weights")
    k = malloc(sim, 3 * G, "kv_cache")
    assert sorted(records) == sorted([w, k]) and len(records) == 2
    data = records[w]
    assert data.handle == (0, 2 * G, w, NO_DRIVER_HANDLE), "size is the mapped (rounded) size, as in vLLM"
    assert data.tag == "weights" and not data.is_asleep and not data.backed_up
    assert data.cpu_backup_tensor is None
    assert {p: d.tag for p, d in records.items()} == {w: "weights", k: "kv_cache"}

    sim.sleep(["weights"])
    assert records[w].is_asleep and records[w].backed_up
    assert records[k].is_asleep and not records[k].backed_up
    assert not data.is_asleep, "a record read earlier keeps what was true then"
    sim.free(k)
    assert k not in records and records.get(k) is None and len(records) == 1
    with pytest.raises(KeyError):
        records[k]


def test_records_answer_only_allocation_starts(sim):
    records = AllocationRecords(sim)
    w = malloc(sim, 2 * G, "weights")
    assert w + G not in records, "vLLM's keys are the pointers my_malloc returned, not addresses inside"
    for key in ("weights", -1, True, None, 1.5):
        assert key not in records
        with pytest.raises(KeyError):
            records[key]
    with pytest.raises(TypeError):
        records[w] = records[w]  # read-only
    for field in ("is_asleep", "cpu_backup_tensor", "tag"):
        with pytest.raises(AttributeError, match="read-only"):
            setattr(records[w], field, None)


def test_walks_agree_with_the_allocation_list(sim):
    records = AllocationRecords(sim)
    tags = ("weights", "kv_cache", "runtime", "workspace")
    ptrs = [malloc(sim, G * (1 + i % 3), tags[i % 4]) for i in range(300)]
    sim.sleep(["weights"])
    want = {a["address"]: (a["size"], a["device"], a["tag"], a["asleep"], a["backed_up"]) for a in sim.allocations()}
    got = {p: (d.handle[1], d.handle[0], d.tag, d.is_asleep, d.backed_up) for p, d in records.items()}
    assert got == want and sorted(records) == sorted(ptrs) == sorted(records.keys())
    assert [d.handle[2] for d in records.values()] == sorted(ptrs)


def test_mapped_usage_follows_sleep_partial_wake_and_discard(sim):
    records = AllocationRecords(sim)
    w = malloc(sim, 4 * G, "weights")
    malloc(sim, 2 * G, "kv_cache")
    malloc(sim, G, "runtime")
    sim.write(w, b"weights!")
    assert mapped_usage(records) == sim.usage() == 7 * G

    sim.sleep(["weights", "runtime"])
    assert mapped_usage(records) == 0 == sim.usage()
    sim.wake_up(["kv_cache", "runtime"])
    assert mapped_usage(records) == 3 * G

    # The second sleep after a partial wake leaves the weights as they are: asleep, their backup kept, not
    # released or copied again.
    second = sim.sleep(["weights", "runtime"])
    assert second["allocations"] == 2, second
    assert records[w].is_asleep and records[w].backed_up
    assert mapped_usage(records) == 0
    sim.wake_up(None)
    assert mapped_usage(records) == 7 * G and sim.read(w, 8) == b"weights!"

    sim.discard(["kv_cache"])
    assert mapped_usage(records) == 5 * G
    assert {d.tag for d in records.values() if d.is_asleep} == {"kv_cache"}


@pytest.mark.usefixtures("raw_backups")
def test_cpu_backup_tensor_is_the_raw_host_backup(sim):
    records = AllocationRecords(sim)
    w = malloc(sim, 2 * G, "weights")
    k = malloc(sim, G, "kv_cache")
    pattern = bytes(range(256)) * 4
    sim.write(w, pattern)
    sim.sleep(["weights"])

    backup = records[w].cpu_backup_tensor
    assert backup is not None and backup.device.type == "cpu" and backup.dtype == torch.uint8
    assert backup.shape == (2 * G,)
    assert bytes(backup[: len(pattern)].tolist()) == pattern
    assert records[w].cpu_backup_tensor.data_ptr() == backup.data_ptr(), "a view of the backup, not a copy"
    assert records[k].cpu_backup_tensor is None, "discarded: no backup"
    # As in vLLM, the tensor is the backup: what is written to it is what the wake restores.
    backup[:4] = 7
    data = records[w]
    sim.wake_up(None)
    assert sim.read(w, 8) == b"\x07" * 4 + pattern[4:8]
    assert data.cpu_backup_tensor is None, "awake now: read again, not from the earlier record"
    assert records[w].cpu_backup_tensor is None


@pytest.mark.usefixtures("codec_on")
def test_cpu_backup_tensor_is_none_where_the_backup_is_not_raw_host_memory(tmp_path):
    a = cumem_rs.Allocator.simulated(capacity=64 * MiB, granularity=G, compress=True)
    try:
        records = AllocationRecords(a)
        a.set_tag_policy("packed", None, "undefined", "auto", "bytes")
        a.set_spill_dir(tmp_path)
        a.set_tag_policy("spilled", None, "undefined", "file", "off")
        packed = malloc(a, 4 * G, "packed")
        spilled = malloc(a, G, "spilled")
        a.write(packed, bytes(4 * G))  # zeros: shrinks
        a.sleep(["packed", "spilled"])
        assert a.stats()["compressed_bytes"] > 0, "the test needs a compressed backup"
        for p in (packed, spilled):
            assert records[p].backed_up and records[p].cpu_backup_tensor is None
        a.wake_up(None)
        assert a.read(packed, 16) == bytes(16)
    finally:
        a.close()


def test_rejected_malloc_leaves_no_record(sim):
    records = AllocationRecords(sim)
    with pytest.raises(CumemValueError):
        sim.malloc(0)
    assert len(records) == 0
    p = malloc(sim, G, "weights")
    assert list(records) == [p] and records[p].handle[1] == G


@pytest.mark.parametrize("address,error", [("x", CumemTypeError), (1.5, CumemTypeError), (-5, CumemValueError),
                                           (2**70, CumemValueError)])
def test_records_refuses_bad_addresses_by_name(sim, address, error):
    with pytest.raises(error, match="address"):
        sim.records(address)
    assert sim.records(0x1000) is None, "no allocation there: None, not an error"


def test_records_of_a_closed_allocator(sim):
    records = AllocationRecords(sim)
    sim.close()
    with pytest.raises(ClosedError):
        len(records)
    with pytest.raises(ClosedError):
        sim.records(0x1000)


# --- the library with the C entry points (no GPU needed to load it) ------------------------------------------------


def test_lib_name_is_the_library_with_the_entry_points():
    from cumem_rs import allocator

    assert allocator.lib_name == cumem_rs._native.__file__
    lib = ctypes.CDLL(allocator.lib_name)
    lib.my_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.my_malloc.restype = ctypes.c_void_p
    assert lib.my_malloc(0, 0, None) is None, "a zero-sized request is refused with NULL"
    assert callable(lib.my_free)


# --- the torch layer, on a GPU -------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(
    not (HAS_CUDA and torch.cuda.is_available()), reason="needs a CUDA GPU visible to both torch and cumem_rs"
)


@pytest.fixture
def cumem():
    from cumem_rs import CuMemAllocator

    allocator = CuMemAllocator.get_instance()
    yield allocator
    allocator.wake_up()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _tag_bytes(cumem, tag: str) -> int:
    return sum(d.handle[1] for d in cumem.pointer_to_data.values() if d.tag == tag and not d.is_asleep)


@needs_gpu
def test_pointer_to_data_of_torch_tensors(cumem):
    records = cumem.pointer_to_data
    assert cumem.pointer_to_data is records
    with cumem.use_memory_pool("p2d_weights"):
        assert cumem.current_tag == "p2d_weights"
        t = torch.full((4 * MiB,), 3, dtype=torch.uint8, device="cuda")
    assert cumem.current_tag == "default"
    data = records[t.data_ptr()]  # a large tensor starts its segment: the pointer my_malloc returned
    assert data.tag == "p2d_weights" and not data.is_asleep and data.handle[1] >= t.nbytes
    assert data.handle[0] == t.device.index and data.handle[2] == t.data_ptr()
    cumem.sleep(offload_tags="p2d_weights")
    data = records[t.data_ptr()]
    assert data.is_asleep and data.backed_up
    backup = data.cpu_backup_tensor  # None where the backup was compressed (nvCOMP present)
    if backup is not None:
        assert torch.all(backup[: t.nbytes] == 3)
    cumem.wake_up()
    assert not records[t.data_ptr()].is_asleep and torch.all(t == 3)
    ptr = t.data_ptr()
    del t
    torch.cuda.empty_cache()
    assert ptr not in records


@needs_gpu
def test_allocation_after_a_rejected_my_malloc(cumem):
    lib = ctypes.CDLL(cumem_rs.allocator.lib_name)
    lib.my_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.my_malloc.restype = ctypes.c_void_p
    assert lib.my_malloc(0, torch.cuda.current_device(), None) is None
    with cumem.use_memory_pool():
        t = torch.ones(1024, dtype=torch.uint8, device="cuda")
    assert t.data_ptr() in cumem.pointer_to_data and torch.all(t == 1)


@needs_gpu
@pytest.mark.parametrize("x_alive", [False, True], ids=["x-freed", "x-alive"])
def test_reentered_tag_returns_dead_segments(cumem, x_alive):
    """vLLM's re-entered tag: two blocks of one tag, the first one's tensor dies; entering the tag again returns its
    memory (a dropped pool's segment would otherwise stay cached in torch until some empty_cache)."""
    tag, nbytes = f"p2d_reentered_{x_alive}", 64 * MiB
    with cumem.use_memory_pool(tag):
        xs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda")]
        if not x_alive:
            xs.clear()
    with cumem.use_memory_pool(tag):
        y = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    # Both pools while X holds memory of the first; a pool torch holds nothing of any more is forgotten.
    assert len(cumem.allocator_and_pools[tag]) == (2 if x_alive else 1)
    xs.clear()
    gc.collect()
    with cumem.use_memory_pool(tag):
        pass
    assert _tag_bytes(cumem, tag) == nbytes
    y.fill_(1)
    cumem.sleep(offload_tags=tag)
    cumem.wake_up()
    assert int(y.sum()) == y.numel()
    del y
    cumem.release_pools()
    assert tag not in cumem.allocator_and_pools
