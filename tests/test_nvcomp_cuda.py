"""The nvCOMP codec on a GPU: compressed round trips of weight-like, random and zero bytes, then sleep/wake of
an Allocator with compression on.

Skipped without a GPU visible to torch and cumem_rs, or without nvCOMP 6 (install cumem_rs[nvcomp-cu13], or point
CUMEM_RS_NVCOMP_LIB at libnvcomp.so.6). The round trips go through `_native._codec_round_trip`, a diagnostic that
drives the CUDA codec directly (compress device ranges into pinned host memory, restore them elsewhere), so they
test the codec apart from the backup store; the sleep/wake test goes through the store. About 1 GiB of GPU memory,
a few seconds on an H200.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import cumem_rs  # noqa: E402
from cumem_rs import _native  # noqa: E402

MiB = 1 << 20


def _why_no_codec() -> str:
    """Why the codec cannot run here ("" when it can): no GPU, or the codec's own status (what did not load)."""
    if not (torch.cuda.is_available() and cumem_rs.cuda_available()):
        return "needs a CUDA GPU visible to torch and cumem_rs"
    cumem_rs.Allocator.cuda().mem_info(0)  # sets device 0 up: its staging ring is taken there
    active, text = _native.cuda_codec_status()
    return "" if active else f"needs nvCOMP 6 (cumem_rs[nvcomp-cu13] or [nvcomp-cu12], as dev.sh test installs): {text}"


_NO_CODEC = _why_no_codec()
pytestmark = pytest.mark.skipif(bool(_NO_CODEC), reason=_NO_CODEC or "-")


def _round_trip(data: "torch.Tensor", kind: str) -> tuple[list[tuple[int, bool]], "torch.Tensor"]:
    """Compress `data` (a CUDA tensor) through the codec and restore it into a fresh tensor of the same size."""
    raw = data.reshape(-1).view(torch.uint8)
    out = torch.full_like(raw, 0x5A)
    torch.cuda.synchronize()
    stored = _native._codec_round_trip(raw.device.index, raw.data_ptr(), out.data_ptr(), raw.numel(), kind)
    return stored, out


def _ratio(stored: list[tuple[int, bool]], nbytes: int) -> float:
    return sum(n for n, _ in stored) / nbytes


def test_the_codec_is_active_and_says_where_it_comes_from():
    active, text = _native.cuda_codec_status()
    assert active
    assert "nvCOMP 6." in text and "libnvcomp" in text
    ring = _native.cuda_codec_device_bytes(0)
    assert 8 * MiB <= ring <= 512 * MiB, ring


def test_bf16_weights_compress_to_two_thirds_and_come_back_bit_identical():
    torch.manual_seed(0)
    # 64 MiB plus an odd tail: the last range is shorter than 2 MiB and than one nvCOMP chunk.
    w = torch.empty(32 * MiB + 12_345, dtype=torch.bfloat16, device="cuda").normal_() * 0.02
    stored, out = _round_trip(w, "bits16")
    raw = w.view(torch.uint8).reshape(-1)
    assert torch.equal(out, raw)
    assert len(stored) == -(-raw.numel() // (2 * MiB))
    assert not any(r for _, r in stored[:-1])
    assert _ratio(stored, raw.numel()) < 0.72


def test_fp8_weights_compress_in_8_bit_mode():
    torch.manual_seed(1)
    x = torch.randn(32 * MiB, device="cuda") * 0.02
    f8 = (x / x.abs().max() * 448).to(torch.float8_e4m3fn)
    stored, out = _round_trip(f8, "bits8")
    assert torch.equal(out, f8.view(torch.uint8).reshape(-1))
    assert _ratio(stored, f8.numel()) < 0.92


def test_random_bytes_are_stored_raw_and_restored():
    raw = torch.randint(0, 256, (48 * MiB + 16,), dtype=torch.uint8, device="cuda")
    stored, out = _round_trip(raw, "bytes")
    assert torch.equal(out, raw)
    assert all(r for _, r in stored), "random bytes never shrink below 0.95x"
    assert sum(n for n, _ in stored) == raw.numel()


def test_zeros_shrink_to_almost_nothing():
    z = torch.zeros(16 * MiB, dtype=torch.bfloat16, device="cuda")
    stored, out = _round_trip(z, "bits16")
    assert torch.equal(out, z.view(torch.uint8).reshape(-1))
    # Compressed, not raw, though far from nothing: nvCOMP's ANS stored 2 MiB of zero bf16 in 1065536 bytes
    # (0.51) on an H200; an entropy coder with per-chunk tables, not a run-length coder.
    assert not any(r for _, r in stored)
    assert _ratio(stored, 32 * MiB) < 0.6


def test_a_bad_kind_is_a_value_error_naming_it():
    w = torch.zeros(1024, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="kind"):
        _native._codec_round_trip(0, w.data_ptr(), w.data_ptr() + 512, 512, "int4")


def test_sleep_and_wake_with_compression_keep_every_bit():
    """Through the backup store: bf16 weights, random bytes and zeros under "weights", slept and woken twice with
    compression on (the default where nvCOMP loads), bit-identical after each wake."""
    a = cumem_rs.Allocator.cuda()
    a.set_tag_policy("weights", compress="auto")
    errors = len(a.errors())  # the CUDA allocator is shared: only what this test adds counts
    torch.manual_seed(2)
    sizes = [64 * MiB, 32 * MiB, 16 * MiB]
    addrs = []
    a.push_tag("weights")
    try:
        for n in sizes:
            addrs.append(a.malloc(n, 0))
    finally:
        a.pop_tag()

    class _View:
        def __init__(self, ptr: int, n: int):
            self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False),
                                             "strides": None, "version": 2}

    try:
        views = [torch.as_tensor(_View(p, n), device="cuda") for p, n in zip(addrs, sizes)]
        views[0].view(torch.bfloat16).normal_().mul_(0.02)
        views[1].random_()
        views[2].zero_()
        want = [v.clone() for v in views]
        raw = sum(sizes)
        for _ in range(2):
            torch.cuda.synchronize()
            a.sleep(["weights"])
            s = a.stats()
            a.wake_up(None)
            for v, w in zip(views, want):
                assert torch.equal(v, w)
            # Raw, the backup is the 112 MiB; with the codec the bf16 and zero parts shrink (random stays raw).
            # Read from the compressed backups' own counts: host_bytes() of the shared allocator also holds what
            # other tests left cached or retained.
            assert s["compressed_raw_bytes"] >= raw - 1, s
            assert s["compressed_bytes"] < 0.9 * raw, f"{s['compressed_bytes']} bytes stored for {raw} raw: {s}"
    finally:
        for p in addrs:
            a.free(p)
        a.set_tag_policy("weights")
        assert a.errors()[errors:] == []
