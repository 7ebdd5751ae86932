"""Wrong calls: each must fail with the documented exception type, say what was wrong, and lose nothing.

Every test first creates `Witness` allocations holding known data under two tags; after the bad call the
witnesses must still be listed unchanged and hold the same bytes.
"""

from __future__ import annotations

import os

import pytest

import cumem_rs
from cumem_rs import ClosedError, CumemError, CumemOutOfMemoryError, CumemTypeError, CumemValueError


class Witness:
    """Two allocations with random data, one per tag, to prove a failed call lost nothing."""

    def __init__(self, a: cumem_rs.Allocator, size: int = 100_000) -> None:
        self.a = a
        self.data: dict[int, bytes] = {}
        for tag in ("weights", "kv_cache"):
            a.push_tag(tag)
            try:
                addr = a.malloc(size)
            finally:
                a.pop_tag()
            payload = os.urandom(size)
            a.write(addr, payload)
            self.data[addr] = payload
        self.rows = self._rows()
        self.usage = a.usage()

    def _rows(self) -> dict[int, dict]:
        return {r["address"]: r for r in self.a.allocations() if r["address"] in self.data}

    def check(self) -> None:
        assert self._rows() == self.rows, "a failed call changed the witness allocations"
        assert self.a.usage() == self.usage
        for addr, payload in self.data.items():
            assert self.a.read(addr, len(payload)) == payload, f"witness {addr:#x} lost its data"

    @property
    def weights(self) -> int:
        return next(a for a, r in self.rows.items() if r["tag"] == "weights")

    @property
    def kv(self) -> int:
        return next(a for a, r in self.rows.items() if r["tag"] == "kv_cache")


@pytest.fixture
def w(alloc) -> Witness:
    return Witness(alloc)


# --- sizes ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, -1, -(1 << 40)])
def test_malloc_non_positive_size(alloc, w, size):
    with pytest.raises(ValueError, match=r"(?i)size"):
        alloc.malloc(size)
    w.check()


def test_malloc_beyond_capacity(alloc, w):
    free, total = alloc.mem_info(0)
    with pytest.raises(CumemOutOfMemoryError, match=r"(?i)memory"):
        alloc.malloc(total + 1)
    w.check()
    if alloc.backend == "sim":  # a GPU's free memory also moves with other processes
        assert alloc.mem_info(0)[0] == free, "a failed malloc kept physical memory"


def test_malloc_absurd_size(alloc, w):
    # Rounding 2**62 up to the granularity must not overflow into a small size.
    with pytest.raises(CumemOutOfMemoryError, match="out of memory"):
        alloc.malloc(1 << 62)
    w.check()


def test_malloc_size_beyond_u64(alloc, w):
    # Documented: ints beyond u64 saturate, so they fail as out-of-memory rather than OverflowError.
    with pytest.raises(CumemOutOfMemoryError, match="out of memory"):
        alloc.malloc(1 << 64)
    w.check()


def test_malloc_unknown_device(alloc, w):
    bad = alloc.device_count()
    with pytest.raises(ValueError, match=rf"device {bad}"):
        alloc.malloc(4096, bad)
    w.check()


@pytest.mark.parametrize("stream", [0xDEADBEEF, -1])
def test_malloc_raw_stream_handle(alloc, w, stream):
    # On CUDA a made-up handle reached cuStreamIsCapturing at free and crashed the process.
    with pytest.raises(ValueError, match="stream"):
        alloc.malloc(4096, 0, stream)
    w.check()


# --- addresses ------------------------------------------------------------------------------------------------


def _unknown_addresses(w: Witness) -> list[int]:
    # Never allocated; inside a live allocation but not its start; just past the end of one.
    r = w.rows[w.weights]
    return [0x1000, w.weights + 1, w.weights + r["size"] + (1 << 40)]


def test_free_unknown_address(alloc, w):
    for addr in _unknown_addresses(w):
        with pytest.raises(ValueError, match=f"{addr:#x}"):
            alloc.free(addr)
    w.check()


def test_double_free(alloc, w):
    addr = alloc.malloc(5000)
    alloc.free(addr)
    with pytest.raises(ValueError, match=f"{addr:#x}"):
        alloc.free(addr)
    w.check()


def test_double_free_of_asleep(alloc, w):
    alloc.push_tag("other")
    addr = alloc.malloc(5000)
    alloc.pop_tag()
    alloc.sleep(["other", "weights", "kv_cache"])  # offload the witnesses too
    alloc.free(addr)
    with pytest.raises(ValueError, match=f"{addr:#x}"):
        alloc.free(addr)
    alloc.wake_up()
    w.check()


@pytest.mark.parametrize("bad", ["0x1000", 1.5, None, b"\x00"])
def test_address_wrong_type(alloc, w, bad):
    for call in (lambda: alloc.free(bad), lambda: alloc.read(bad, 4), lambda: alloc.write(bad, b"abcd")):
        with pytest.raises(TypeError, match=f"address must be an int, not {type(bad).__name__}"):
            call()
    w.check()


def test_read_write_outside_allocation(alloc, w):
    r = w.rows[w.weights]
    end = w.weights + r["size"]
    for addr, n in [(end - 4, 8), (w.weights - 4, 8), (0x1000, 4), (end + (1 << 40), 4)]:
        with pytest.raises(ValueError, match=f"{addr:#x}"):
            alloc.read(addr, n)
        with pytest.raises(ValueError, match=f"{addr:#x}"):
            alloc.write(addr, b"\xff" * n)
    w.check()


def test_read_negative_size(alloc, w):
    with pytest.raises(ValueError, match="size.*-1"):
        alloc.read(w.weights, -1)
    w.check()


def test_read_write_asleep(alloc, w):
    alloc.sleep("weights")
    # A state error, not a bad argument: CumemError (a RuntimeError), naming the state.
    for addr in (w.weights, w.kv):
        with pytest.raises(CumemError, match=f"{addr:#x}.*asleep"):
            alloc.read(addr, 4)
        with pytest.raises(CumemError, match=f"{addr:#x}.*asleep"):
            alloc.write(addr, b"\x00" * 4)
    alloc.wake_up()
    # kv_cache was not offloaded: only the weights witness keeps its data.
    assert alloc.read(w.weights, len(w.data[w.weights])) == w.data[w.weights]


# --- tags -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [1, None, b"weights", ["weights"]])
def test_push_tag_not_str(alloc, w, bad):
    with pytest.raises(TypeError, match="tag must be a str"):
        alloc.push_tag(bad)
    assert alloc.current_tag() == "default"
    w.check()


@pytest.mark.parametrize("method", ["sleep", "wake_up", "discard"])
@pytest.mark.parametrize("bad", [1, [1], ["weights", None], b"weights", [b"weights"]])
def test_tags_not_str(alloc, w, method, bad):
    with pytest.raises(TypeError, match="tags? must be a str"):
        getattr(alloc, method)(bad)
    assert all(not r["asleep"] for r in alloc.allocations() if r["address"] in w.data)
    w.check()


def test_empty_tag(alloc, w):
    with pytest.raises(ValueError, match="(?i)tag"):
        alloc.push_tag("")
    assert alloc.current_tag() == "default"
    for method in ("sleep", "wake_up", "discard"):
        for bad in ("", ["weights", ""]):
            with pytest.raises(ValueError, match="(?i)tag"):
                getattr(alloc, method)(bad)
    w.check()


def test_pop_tag_on_empty_stack(alloc, w):
    alloc.push_tag("weights")
    assert alloc.pop_tag() == "weights"
    with pytest.raises(CumemError, match="pop_tag without a matching push_tag"):
        alloc.pop_tag()
    assert alloc.current_tag() == "default"
    w.check()


# --- sleep / wake out of order --------------------------------------------------------------------------------


def _byte_counts(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "seconds" and isinstance(v, int)}


def test_wake_without_sleep_is_noop(alloc, w):
    report = alloc.wake_up()
    assert _byte_counts(report) and all(v == 0 for v in _byte_counts(report).values()), report
    report = alloc.wake_up(["weights", "kv_cache"])
    assert all(v == 0 for v in _byte_counts(report).values()), report
    w.check()


def test_sleep_twice(alloc, w):
    first = alloc.sleep("weights")
    assert first["copied_bytes"] > 0 and first["discarded_bytes"] > 0
    host = alloc.host_bytes()
    # Already asleep: nothing to back up or drop again, and "weights" keeps its backup even though this call
    # would not offload it.
    second = alloc.sleep("kv_cache")
    assert (second["copied_bytes"], second["discarded_bytes"], second["allocations"]) == (0, 0, 0), second
    assert alloc.host_bytes() == host
    alloc.wake_up()
    assert alloc.read(w.weights, len(w.data[w.weights])) == w.data[w.weights]
    if alloc.backend == "sim":  # a GPU may hand back the same physical pages, old data included
        assert alloc.read(w.kv, len(w.data[w.kv])) != w.data[w.kv]


def test_discard_of_asleep_is_noop(alloc, w):
    alloc.sleep(["weights", "kv_cache"])
    report = alloc.discard(["weights", "kv_cache"])
    assert all(v == 0 for v in _byte_counts(report).values()), report
    assert all(r["backed_up"] for r in alloc.allocations() if r["address"] in w.data)
    alloc.wake_up()
    w.check()


def test_discard_unknown_tag_is_noop(alloc, w):
    report = alloc.discard("no-such-tag")
    assert all(v == 0 for v in _byte_counts(report).values()), report
    w.check()


# --- closed allocator (sim: the CUDA allocator is process-wide and never closed) ------------------------------


CLOSED_CALLS = [
    ("malloc", (4096,)),
    ("free", (0x1000,)),
    ("sleep", ("weights",)),
    ("wake_up", ()),
    ("discard", ("weights",)),
    ("read", (0x1000, 4)),
    ("write", (0x1000, b"x")),
    ("usage", ()),
    ("allocations", ()),
    ("reserve_host", (4096,)),
    ("set_pin_chunk", (4096,)),
    ("push_tag", ("weights",)),
    ("pop_tag", ()),
    ("current_tag", ()),
    ("trim_host", ()),
    ("stop_pinning_ahead", ()),
    ("retains_backups", ()),
    ("keep_host_memory", ()),
    ("pin_ahead_status", ()),
]


@pytest.mark.parametrize("method,args", CLOSED_CALLS, ids=[c[0] for c in CLOSED_CALLS])
def test_calls_after_close(sim, method, args):
    addr = sim.malloc(4096)
    sim.close()
    sim.close()  # idempotent
    assert sim.closed
    with pytest.raises(ClosedError, match="(?i)closed"):
        getattr(sim, method)(*args)
    with pytest.raises(ClosedError):
        sim.free(addr)


# --- fault injection arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,bad",
    [
        (("no_such_op",), "no_such_op"),
        (("create", 1, "no_such_error"), "no_such_error"),
        (("create", 0), "nth"),
        (("create", 2**64 - 1), "nth"),  # would wrap around past the call counter and never fire
    ],
    ids=["op", "error", "nth", "nth-too-far"],
)
def test_inject_fault_bad_arguments(sim, args, bad):
    w = Witness(sim)
    with pytest.raises(ValueError, match=bad):
        sim.inject_fault(*args)
    # Nothing was armed: every operation still works.
    addr = sim.malloc(4096)
    sim.sleep(["weights", "kv_cache"])
    sim.wake_up()
    sim.free(addr)
    w.check()


def test_inject_fault_on_cuda_refused(backend, alloc):
    if backend != "cuda":
        pytest.skip("the simulated driver accepts faults")
    with pytest.raises(CumemError, match="(?i)sim"):
        alloc.inject_fault(cumem_rs.FAULT_OPS[0])


@pytest.mark.parametrize("devices", [2**32, 2**40])
def test_simulated_with_absurd_device_count_is_a_value_error(devices):
    # Must not abort the process (a vector of 2**40 counters) nor wrap to 0 devices through a 32-bit cast.
    with pytest.raises(ValueError, match=str(devices)):
        cumem_rs.Allocator.simulated(devices=devices)


# --- exception classes: a bad argument is a CumemError and a ValueError / TypeError ----------------------------


def test_bad_values_are_cumem_value_errors(alloc, w):
    # One refused by the bindings, one by the engine (unknown address), one by the engine's device check.
    for call in (lambda: alloc.malloc(0), lambda: alloc.free(0x1000), lambda: alloc.push_tag(""),
                 lambda: alloc.granularity(alloc.device_count())):
        with pytest.raises(CumemValueError) as e:
            call()
        assert isinstance(e.value, CumemError) and isinstance(e.value, ValueError), type(e.value).__mro__
    w.check()


def test_wrong_types_are_cumem_type_errors(alloc, w):
    for call in (lambda: alloc.malloc("4096"), lambda: alloc.sleep(1), lambda: alloc.set_keep_host_memory(1),
                 lambda: alloc.write(w.weights, 1.5)):
        with pytest.raises(CumemTypeError) as e:
            call()
        assert isinstance(e.value, CumemError) and isinstance(e.value, TypeError), type(e.value).__mro__
    w.check()


def test_exception_classes_are_exported():
    assert issubclass(cumem_rs.CumemValueError, cumem_rs.CumemError)
    assert issubclass(cumem_rs.CumemValueError, ValueError)
    assert issubclass(cumem_rs.CumemTypeError, cumem_rs.CumemError)
    assert issubclass(cumem_rs.CumemTypeError, TypeError)
    assert not issubclass(cumem_rs.CumemValueError, TypeError)


# --- integers out of range: a CumemValueError naming the argument and the value, never OverflowError ------------

# Every integer argument of the module: (label, call with the value, the argument's name in the message).
INT_ARGS = [
    ("malloc device", lambda a, w, v: a.malloc(4096, device=v), "device"),
    ("granularity", lambda a, w, v: a.granularity(v), "device"),
    ("mem_info", lambda a, w, v: a.mem_info(v), "device"),
    ("usage", lambda a, w, v: a.usage(v), "device"),
    ("free", lambda a, w, v: a.free(v), "address"),
    ("read address", lambda a, w, v: a.read(v, 4), "address"),
    ("read size", lambda a, w, v: a.read(w.weights, v), "size"),
    ("write address", lambda a, w, v: a.write(v, b"x"), "address"),
    ("read_backup address", lambda a, w, v: a.read_backup(v, 4), "address"),
    ("read_backup size", lambda a, w, v: a.read_backup(w.weights, v), "size"),
    ("fingerprints address", lambda a, w, v: a.fingerprints(v, 16), "address"),
    ("fingerprints length", lambda a, w, v: a.fingerprints(w.weights, v), "length"),
    ("reserve_host", lambda a, w, v: a.reserve_host(v), "nbytes"),
    ("reserve_host background", lambda a, w, v: a.reserve_host(v, background=True), "nbytes"),
    ("set_pin_chunk", lambda a, w, v: a.set_pin_chunk(v), "nbytes"),
    ("set_fingerprint_chunk", lambda a, w, v: a.set_fingerprint_chunk(v), "nbytes"),
    ("set_wake_group_bytes", lambda a, w, v: a.set_wake_group_bytes(v), "nbytes"),
    ("fingerprint_bytes chunk", lambda a, w, v: cumem_rs._native.fingerprint_bytes(b"\0" * 16, v), "chunk"),
    ("simulated devices", lambda a, w, v: cumem_rs.Allocator.simulated(devices=v), "devices"),
    ("simulated capacity", lambda a, w, v: cumem_rs.Allocator.simulated(capacity=v), "capacity"),
    ("simulated granularity", lambda a, w, v: cumem_rs.Allocator.simulated(granularity=v), "granularity"),
    ("simulated host_memory", lambda a, w, v: cumem_rs.Allocator.simulated(host_memory=v), "host_memory"),
]
SIM_INT_ARGS = [
    ("inject_fault nth", lambda a, w, v: a.inject_fault("create", v), "nth"),
    ("inject_panic nth", lambda a, w, v: a.inject_panic("create", v), "nth"),
]
OUT_OF_RANGE = [2**64, 2**70, -(2**70), 2**200]


def _refused_naming_value(call, name: str, value: int) -> None:
    with pytest.raises(CumemValueError) as e:
        call()
    assert not isinstance(e.value, OverflowError)
    assert name in str(e.value), f"{e.value} does not name {name}"
    assert str(value) in str(e.value), f"{e.value} does not show the value given"


@pytest.mark.parametrize("value", OUT_OF_RANGE)
@pytest.mark.parametrize("label,call,name", INT_ARGS, ids=[a[0] for a in INT_ARGS])
def test_int_argument_out_of_range(alloc, w, label, call, name, value):
    _refused_naming_value(lambda: call(alloc, w, value), name, value)
    w.check()


@pytest.mark.parametrize("value", OUT_OF_RANGE)
@pytest.mark.parametrize("label,call,name", SIM_INT_ARGS, ids=[a[0] for a in SIM_INT_ARGS])
def test_sim_int_argument_out_of_range(sim, label, call, name, value):
    w = Witness(sim)
    _refused_naming_value(lambda: call(sim, w, value), name, value)
    sim.free(sim.malloc(4096))  # nothing armed
    w.check()


@pytest.mark.parametrize(
    "call",
    [lambda a: a.malloc(1, device=2**31), lambda a: a.granularity(2**40), lambda a: a.usage(2**40),
     lambda a: a.mem_info(-(2**40)), lambda a: a.malloc(1, device=-(2**31) - 1)],
    ids=["malloc", "granularity", "usage", "mem_info", "malloc-below-i32"],
)
def test_device_beyond_32_bits(alloc, w, call):
    # These raised OverflowError ("out of range integral type conversion attempted").
    with pytest.raises(CumemValueError, match="device"):
        call(alloc)
    w.check()


@pytest.mark.parametrize("nbytes,background", [(2**70, False), (2**64, True), (2**64, False)])
def test_reserve_host_beyond_64_bits(alloc, w, nbytes, background):
    # These were an out-of-memory error for a saturated 18446744073709551615 bytes.
    with pytest.raises(CumemValueError, match=f"nbytes.*{nbytes}") as e:
        alloc.reserve_host(nbytes, background=background)
    assert "18446744073709551615" not in str(e.value)
    assert not alloc.pin_ahead_status()["running"]
    w.check()


@pytest.mark.parametrize("size", [2**64, 2**70, 2**200])
def test_malloc_size_beyond_64_bits_shows_the_size_asked_for(alloc, w, size):
    # Out of memory, as documented (no device holds it), but with the size given, not a saturated one.
    with pytest.raises(CumemOutOfMemoryError, match=f"out of memory.*{size}"):
        alloc.malloc(size)
    w.check()


def test_stream_beyond_64_bits(alloc, w):
    with pytest.raises(CumemValueError, match="stream"):
        alloc.malloc(4096, stream=2**64)
    w.check()


# --- wrong types of the other scalar arguments: CumemTypeError naming the argument ------------------------------

TYPED_ARGS = [
    ("device", lambda a: a.granularity("0")),
    ("device", lambda a: a.usage(1.0)),
    ("device", lambda a: a.malloc(4096, device=True)),
    ("keep", lambda a: a.set_keep_host_memory(1)),
    ("background", lambda a: a.reserve_host(4096, background="yes")),
    ("on", lambda a: a.set_retain_backups(None)),
    ("wake_fill", lambda a: a.set_tag_policy("weights", wake_fill=0)),
    ("nbytes", lambda a: a.set_pin_chunk(4096.0)),
    ("data", lambda a: cumem_rs._native.fingerprint_bytes("0" * 16, 16)),
    ("host_register_delay", lambda a: cumem_rs.Allocator.simulated(host_register_delay="1")),
]
SIM_TYPED_ARGS = [
    ("op", lambda a: a.inject_fault(1)),
    ("nth", lambda a: a.inject_fault("create", "1")),
    ("error", lambda a: a.inject_fault("create", 1, 999)),
    ("op", lambda a: a.inject_panic(None)),
]


@pytest.mark.parametrize("name,call", TYPED_ARGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(TYPED_ARGS)])
def test_scalar_argument_wrong_type(alloc, w, name, call):
    with pytest.raises(CumemTypeError, match=f"{name} must be"):
        call(alloc)
    w.check()


@pytest.mark.parametrize("name,call", SIM_TYPED_ARGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SIM_TYPED_ARGS)])
def test_sim_scalar_argument_wrong_type(sim, name, call):
    w = Witness(sim)
    with pytest.raises(CumemTypeError, match=f"{name} must be"):
        call(sim)
    sim.free(sim.malloc(4096))  # nothing armed
    w.check()


def test_numpy_integers_are_ints(alloc, w):
    # Integer types with a lossless __index__ (numpy's) are taken as PyO3's own conversion took them; floats and
    # bools are not, and a numpy int out of range is refused like a Python int.
    np = pytest.importorskip("numpy")
    assert alloc.granularity(np.int64(0)) == alloc.granularity(0)
    addr = alloc.malloc(np.int64(4096), device=np.int32(0))
    assert alloc.read(addr, np.uint16(4)) == alloc.read(addr, 4)
    alloc.free(np.uint64(addr))
    with pytest.raises(CumemTypeError, match="size must be an int, not float64"):
        alloc.malloc(np.float64(4096))
    with pytest.raises(CumemTypeError, match="device must be an int"):
        alloc.granularity(np.bool_(False))
    with pytest.raises(CumemValueError, match=f"device {2**40}"):
        alloc.granularity(np.int64(2**40))
    w.check()
