"""The command line (`python -m cumem_rs {info,demo,bench}`), the reference workload it runs, and the checks that
make the demo fail when data does not survive a sleep/wake cycle."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import cumem_rs
from cumem_rs import Allocator
from cumem_rs.__main__ import main
from cumem_rs.workload import (
    GiB,
    AllocatorWorkload,
    VerificationError,
    fingerprint,
    kv_cache_spec,
    llama3_8b_weights,
    reference_workload,
    sim_granularity,
)

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cumem_rs", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def gpu_usable() -> bool:
    if not cumem_rs.cuda_available():
        return False
    import torch

    return torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------------------------
# The reference workload.


def test_reference_workload_is_llama3_8b_bf16():
    w = llama3_8b_weights(1)
    assert len(w) == 291
    assert abs(sum(nbytes for _, _, nbytes in w) / GiB - 15.0) <= 0.05
    assert len({name for name, _, _ in w}) == 291
    shapes = dict((name, shape) for name, shape, _ in w)
    assert shapes["model.embed_tokens.weight"] == (128256, 4096)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (8 * 128, 4096)
    assert shapes["model.layers.31.mlp.down_proj.weight"] == (4096, 14336)
    for name, shape, nbytes in w:
        n = 2
        for d in shape:
            n *= d
        assert nbytes == n, name
    assert kv_cache_spec(1)[2] == 48 * GiB


def test_scaling_keeps_every_tensor():
    full = sum(nbytes for _, _, nbytes in llama3_8b_weights(1))
    # Every Llama-3-8B dimension is a multiple of 64, so 1/64 is exact.
    assert sum(nbytes for _, _, nbytes in llama3_8b_weights(64)) * 64 == full
    tiny = llama3_8b_weights(10**9)
    assert len(tiny) == 291 and all(nbytes >= 2 for _, _, nbytes in tiny)
    specs = reference_workload(256, kv_gib=48)
    assert [s.tag for s in specs].count("weights") == 291 and specs[-1].tag == "kv_cache"
    assert specs[-1].nbytes == 48 * GiB // 256
    assert all(s.tag == "weights" for s in reference_workload(256, kv_gib=0))
    with pytest.raises(ValueError):
        llama3_8b_weights(0)


def test_sim_granularity_is_a_page_multiple_power_of_two():
    for scale in (1, 3, 64, 100, 256, 10**6):
        g = sim_granularity(scale)
        assert g >= 4096 and g & (g - 1) == 0 and g <= 2 << 20


# ---------------------------------------------------------------------------------------------------------------
# Verification really detects damage (otherwise a passing demo would prove nothing).


def test_allocator_workload_detects_swapped_contents_and_moved_addresses():
    specs = reference_workload(4096, kv_gib=0)[:8]
    a = Allocator.simulated(capacity=64 << 20, granularity=4096)
    try:
        wl = AllocatorWorkload(a, specs, seed=3)
        wl.allocate()
        wl.fill()
        addrs = list(wl.addresses)
        assert wl.verify("weights", addrs) == sum(s.nbytes for s in specs)
        # Layer 0's k_proj content restored into its q_proj (both one 4096-wide row at this scale): the bytes are
        # valid workload data, just at the wrong place, as after a mix-up of two backups.
        i, j = 2, 3
        assert specs[i].nbytes == specs[j].nbytes
        src = a.read(wl.addresses[j], specs[i].nbytes)
        a.write(wl.addresses[i], src)
        with pytest.raises(VerificationError, match=specs[i].name.replace(".", r"\.")):
            wl.verify("weights", addrs)
        wl.fill()
        with pytest.raises(VerificationError, match="addresses changed"):
            wl.verify("weights", addrs[::-1])
        wl.free()
    finally:
        a.close()


def test_fingerprint_detects_a_bit_flip_and_swapped_pages():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 256, (3 * (2 << 20) + 5,), dtype=torch.uint8, generator=g).view(-1)
    f = fingerprint(t)
    assert torch.equal(fingerprint(t.clone()), f)
    flipped = t.clone()
    flipped[12345] ^= 1
    assert not torch.equal(fingerprint(flipped), f)
    swapped = t.clone()
    page = 2 << 20
    swapped[:page], swapped[page : 2 * page] = t[page : 2 * page].clone(), t[:page].clone()
    assert swapped.sum() == t.sum()  # a whole-tensor sum would not see it ...
    assert not torch.equal(fingerprint(swapped), f)  # ... the per-row fingerprint does


# ---------------------------------------------------------------------------------------------------------------
# The command line.


def test_help_lists_the_subcommands():
    p = run_cli("--help")
    assert p.returncode == 0, p.stderr
    for cmd in ("info", "demo", "bench"):
        assert cmd in p.stdout
    for cmd in ("demo", "bench"):
        sub = run_cli(cmd, "--help")
        assert sub.returncode == 0 and "--scale" in sub.stdout and "--backend" in sub.stdout


def test_bench_multi_is_a_subcommand_and_a_module():
    # The multi-device benchmark lives in the bench package (cumem_rs.bench.multi); both ways of running it work.
    p = run_cli("bench-multi", "--help")
    assert p.returncode == 0 and "--devices" in p.stdout, p.stdout + p.stderr
    p = subprocess.run([sys.executable, "-m", "cumem_rs.bench.multi", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "python -m cumem_rs.bench.multi" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("argv", [["demo", "--bogus"], ["bench", "--backend", "tpu"], ["demo", "--scale", "x"], []])
def test_bad_arguments_are_argparse_errors(argv):
    p = run_cli(*argv)
    assert p.returncode == 2
    assert "error:" in p.stderr and "usage:" in p.stderr


def test_info_shows_both_backends():
    p = run_cli("info")
    assert p.returncode == 0, p.stderr
    assert f"cumem_rs {cumem_rs.__version__}" in p.stdout
    assert "cuda backend:" in p.stdout
    assert "sim backend: device 0:" in p.stdout and "granularity 2.00 MiB" in p.stdout


def test_main_is_the_console_entry_point(capsys):
    assert main(["info"]) == 0
    assert "sim backend" in capsys.readouterr().out


def test_demo_on_the_simulated_device_says_what_it_verified_and_no_rates():
    p = run_cli("demo", "--backend", "sim", "--scale", "512")
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    lines = out.rstrip().splitlines()
    assert len(lines) <= 22, out  # the story in about twenty lines
    assert "291 weight tensors" in out and "normal_()*0.02" in out
    assert "say nothing about GPU speed" in out
    # No rate, time or ratio of an emulation.
    for word in ("GB/s", " ms", "µs", "x link", "the link"):
        assert word not in out, word
    assert "codec: sim: zstd" in out
    rows = {ln.split(":")[0].strip(): ln for ln in lines if ln.startswith("  cycle ")}
    assert list(rows) == [f"cycle {c} {call}" for c in (1, 2, 3) for call in ("sleep", "wake")]
    assert "-> 0 B mapped" in rows["cycle 1 sleep"] and "cold" in rows["cycle 1 sleep"]
    assert " 0 B copied" in rows["cycle 2 sleep"]  # unchanged since the wake: a retained backup, nothing copied
    assert "4 layers rewritten" in rows["cycle 3 sleep"]
    for c in (1, 2, 3):
        assert "291 checksums equal, 292 addresses same" in rows[f"cycle {c} wake"]
    assert "every wake verified bit-identical" in out
    summary = lines[lines.index("summary (simulated device: what was checked, not how fast):") + 1:][:3]
    assert [ln.split(":")[0].strip() for ln in summary] == ["sleep", "wake", "host"]
    assert "0 B with the weights unchanged" in summary[0]
    assert out.rstrip().endswith("every wake bit-identical at unchanged addresses")


def test_demo_cycles_and_its_summary_when_the_weights_are_rewritten(capsys):
    from cumem_rs.demo import cycle_kind

    assert [cycle_kind(c, 1) for c in (1,)] == ["cold"]
    assert [cycle_kind(c, 2) for c in (1, 2)] == ["cold", "unchanged"]
    assert [cycle_kind(c, 4) for c in (1, 2, 3, 4)] == ["cold", "unchanged", "unchanged", "rewritten"]
    assert main(["demo", "--backend", "sim", "--scale", "2048", "--kv-gib", "0", "--cycles", "4"]) == 0
    out = capsys.readouterr().out
    copied = {}
    for ln in out.splitlines():
        if ln.startswith("  cycle ") and " sleep:" in ln:
            copied[int(ln.split()[1])] = ln.split(":", 1)[1].split("copied")[0].split()[-2:]
    assert len(copied) == 4
    assert copied[2] == copied[3] == ["0", "B"]  # both steady sleeps of unchanged weights copied nothing
    assert copied[4] != ["0", "B"] and copied[1] != copied[4]


def test_sim_weights_verification_detects_a_changed_byte_and_a_freed_allocation():
    from cumem_rs.demo import SimWeights

    specs = reference_workload(4096, kv_gib=0)[:6]
    sim = SimWeights(specs, 4096, seed=1)
    try:
        sim.allocate()
        sim.fill(list(range(len(specs))), seed=1)
        assert sim.verify() == "6 checksums equal, 6 addresses same"
        a = sim.addresses[3]
        b = sim.alloc.read(a, 1)
        sim.alloc.write(a, bytes([b[0] ^ 1]))
        with pytest.raises(VerificationError, match=specs[3].name.replace(".", r"\.")):
            sim.verify()
        sim.alloc.write(a, b)
        sim.verify()
        sim.alloc.free(sim.addresses[5])
        with pytest.raises(VerificationError, match="not awake at their addresses"):
            sim.verify()
        sim.addresses.pop()
    finally:
        sim.close()


def test_gpu_story_ratios_and_summary_against_the_link(capsys):
    """The GPU run's arithmetic and wording, from figures given: a ratio is the link's time for the raw weight
    bytes over the step's, sleeps against device->host and wakes against host->device."""
    from cumem_rs.demo import Step, Story, _gpu_summary

    story = Story(wbytes=40 * 10**9, link=(50.0, 40.0))  # the link: 0.8 s to the GPU, 1.0 s back
    steps = [Step(1, "cold", "sleep", 1.25, 0, 30 << 30), Step(1, "cold", "wake", 0.8, 0, 30 << 30),
             Step(2, "unchanged", "sleep", 0.2, 0, 28 << 30), Step(2, "unchanged", "wake", 0.5, 0, 28 << 30),
             Step(3, "rewritten", "sleep", 0.5, 0, 28 << 30), Step(3, "rewritten", "wake", 0.8, 0, 28 << 30)]
    for s in steps:
        story.add(s, rewrite_bytes=4 * 10**9)
    assert [round(story.ratio(s), 3) for s in steps] == [0.8, 1.0, 5.0, 1.6, 2.0, 1.0]
    _gpu_summary(story, rewrite_bytes=4 * 10**9)
    out = capsys.readouterr().out
    assert "cycle 3 sleep: 4 layers rewritten (10%)" in out and "  5.00x" in out
    sleep, wake, host = out.rstrip().splitlines()[-3:]
    assert sleep == ("  sleep: 0.80x the link cold; 5.00x with the weights unchanged (0.20x of the copy's time); "
                     "2.00x after 10% were rewritten")
    assert wake == "  wake:  1.30x the link steady (median of 2), 1.00x cold"
    assert host.startswith("  host:  28.00 GiB held while asleep, 0.75x of the raw bytes")


class _FakeCuda:
    """torch.cuda's mem_get_info alone (choose_scale reads nothing else)."""

    def __init__(self, free: int):
        self.cuda = self
        self.free = free

    def mem_get_info(self, device):
        return self.free, 2 * self.free


def test_demo_scales_down_only_on_a_gpu_too_small():
    from cumem_rs.demo import choose_scale

    assert choose_scale(_FakeCuda(140 * GiB), 0, None, 48.0) == (1, None)
    scale, why = choose_scale(_FakeCuda(40 * GiB), 0, None, 48.0)
    assert scale == 2 and "40.00 GiB free" in why
    assert choose_scale(_FakeCuda(40 * GiB), 0, 4, 48.0) == (4, None)
    with pytest.raises(SystemExit, match="--scale"):
        choose_scale(_FakeCuda(40 * GiB), 0, 1, 48.0)


def test_demo_rejects_a_bad_scale():
    p = run_cli("demo", "--backend", "sim", "--scale", "0")
    assert p.returncode != 0 and "--scale" in p.stderr


def test_bench_on_the_simulated_device(tmp_path):
    out = tmp_path / "bench.json"
    p = run_cli("bench", "--backend", "sim", "--scale", "512", "--cycles", "2", "--only", "sleep_wake,malloc",
                "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    for row in ("host memcpy", "sleep, cold first", "sleep, steady (median of 2)", "wake, steady",
                "keep_host_memory=False", "discard kv_cache", "Allocator.malloc"):
        assert row in p.stdout, row
    data = json.loads(out.read_text())
    m = data["metrics"]
    assert m["backend"] == "sim" and m["tensors"] == 292
    assert len(m["sleep_all_s"]) == 3 and len(m["wake_all_s"]) == 3
    assert m["sleep_gbps"] > 0 and m["sleep_ratio"] > 0 and m["wake_ratio"] > 0
    # The host backup is kept for the next sleep by default and given back under keep_host_memory=False.
    assert m["host_bytes_after_wake_keep"] >= m["weights_bytes"]
    assert m["host_bytes_after_wake_nokeep"] == 0
    assert m["errors"] == []
    assert any(r["name"].startswith("sleep, steady") for r in data["rows"])
    # The copy path: every steady sleep copied every byte.
    assert m["sleep_skipped_all_bytes"] == [0, 0, 0]
    # The steady wake again without the wake's verification, same run.
    assert "wake, steady, verification off (median of 2)" in p.stdout and len(m["wake_unverified_all_s"]) == 2
    assert "verify_wake_cost" in m
    assert m["tables"] == ["sleep_wake", "malloc"] and set(m["table_seconds"]) == {"sleep_wake", "malloc"}
    assert not any(k.startswith(("retained_", "alloc_count_")) for k in m)


def _median_report(cycles: list, field: str) -> float:
    values = sorted(c["report"][field] for c in cycles)
    return values[len(values) // 2]


def test_bench_every_table_on_the_simulated_device(tmp_path):
    out = tmp_path / "bench.json"
    p = run_cli("bench", "--backend", "sim", "--scale", "1024", "--cycles", "1", "--json", str(out), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    for title in ("the limit: pinned copies", "sleep/wake, copy path", "retained backups", "allocation count",
                  "malloc/free", "CuMemAllocator wall time", "torch_memory_saver", "pinning ahead", "file tier",
                  "compress: backups compressed", "swap: two processes on one GPU"):
        assert title in p.stdout, title
    data = json.loads(out.read_text())
    m = data["metrics"]
    assert m["errors"] == []
    assert set(m["table_seconds"]) == {"peer", "rl_loop", "sleep_wake", "retained", "wall", "pin_ahead",
                                       "alloc_count", "malloc", "file_tier", "compress", "swap"}
    # With no --only, the RL loop is the first table printed (the peer, first to run, prints nothing then); a
    # given --cycles is its cycles too.
    assert p.stdout.index("rl_loop (sim") < p.stdout.index("the limit: pinned copies")
    assert m["rl_loop"]["cycles"] == 1
    assert {r["mode"] for r in m["rl_loop"]["records"]} == {"compressed", "raw", "compressed, verify off"}
    w = m["weights_bytes"]
    check_file_tier_metrics(m)

    # Retained backups on: an unchanged sleep copies nothing; 1% of the chunks rewritten copies about 1%; all
    # rewritten copies (almost) everything (chunks of rounding padding stay unchanged).
    on = m["retained_core_on_cycles"]
    assert _median_report(on["unchanged"], "copied_bytes") == 0
    assert _median_report(on["unchanged"], "skipped_bytes") >= w
    assert 0 < _median_report(on["one_percent"], "copied_bytes") <= 0.05 * w
    assert _median_report(on["all"], "copied_bytes") >= 0.99 * w
    assert all(c["report"]["chunks_checked"] > 0 for kind in on.values() for c in kind)
    # Off: every sleep copies every byte, no fingerprints.
    off = m["retained_core_off_cycles"]
    for kind in ("unchanged", "one_percent", "all"):
        assert _median_report(off[kind], "skipped_bytes") == 0
        assert _median_report(off[kind], "copied_bytes") >= w
        assert _median_report(off[kind], "chunks_checked") == 0
    for key in ("unchanged", "one_percent"):
        assert m[f"retained_core_on_sleep_{key}_ratio"] > 0
    assert m["retained_core_on_sleep_all_ratio"] > 0 and m["retained_core_on_wake_ratio"] > 0

    for n in (16, 128, 1024, 6144):
        assert m[f"alloc_count_core_{n}_sleep_ratio"] > 0 and m[f"alloc_count_core_{n}_wake_ratio"] > 0
    skipped = {r["name"] for r in data["rows"] if r["vs"] == "skipped: no GPU"}
    assert {"CuMemAllocator (torch tensors)", "torch_memory_saver",
            "CuMemAllocator sleep / wake_up / discard wall time"} <= skipped


#: Rows the compress table adds to its raw / bf16 / fp8 rows, and the swap table's (issue 23's targets).
COMPRESS_ROWS = (
    "sleep, retained compressed backups, bf16, weights unchanged since the wake",
    "wake with no pause after that sleep",
    "sleep, random bytes (torch.randint 0-255), compress='off'",
    "sleep, random bytes (torch.randint 0-255), compress='auto'",
    "after the sleep, random bytes (torch.randint 0-255), compress='auto'",  # "wake 1 s after" on a GPU
    "matmul loop on another tag while the weights pause and resume compressed",
    "first sleep, compressed, pin ahead off (cold)",
    "first sleep, compressed, 0.2 s after pinning ahead began",
)
SWAP_ROWS = ("both at once, two streams (the limit)", "A sleeps, then B wakes, compress='off'",
             "A sleeps while B wakes, compress='off'", "A sleeps while B wakes, compress='auto'")


def check_compress_rows_metrics(m: dict) -> None:
    """The compress table's further rows and the swap table, on any backend (no timed assertions)."""
    w = m["weights_bytes"]
    # Retained compressed backups: an unchanged sleep copies nothing and keeps every byte's backup.
    kept = m["compress_bf16_auto_retained_cycles"]
    assert kept and all(c["copied"] == 0 and c["skipped"] >= w for c in kept)
    for key in ("retained_sleep_unchanged", "retained_wake_at_once", "retained_wake"):
        assert m[f"compress_bf16_auto_{key}_ratio"] > 0
    # Random bytes go through the codec and are stored raw: about their own size.
    for call in ("sleep", "wake"):
        assert m[f"compress_random_auto_{call}_ratio"] > 0 and m[f"compress_random_off_{call}_ratio"] > 0
    assert m["compress_random_auto_host_bytes"] >= 0.95 * w
    # 1024 allocations of bf16-like data: compressed, they hold less host memory than raw.
    for mode in ("off", "auto"):
        assert m[f"compress_many_{mode}_sleep_ratio"] > 0 and m[f"compress_many_{mode}_wake_ratio"] > 0
    assert m["compress_many_auto_host_bytes"] < m["compress_many_off_host_bytes"]
    # The first sleep: nothing pinned ahead when off, the worker pinned some when on.
    assert m["compress_first_sleep_cold_pinned_ahead"] == 0
    assert m["compress_first_sleep_pin_ahead_2s_pinned_ahead"] > 0
    assert m["compress_first_sleep_cold_ratio"] > 0 and m["compress_first_sleep_pin_ahead_2s_ratio"] > 0
    # The loop ran beside at least one whole pause and resume.
    assert m["compress_matmul_during_pause_ratio"] > 0 and len(m["compress_matmul_pause_cycles_s"]) >= 1
    # Swap: both processes ran every cycle, alone and at once (B verified its weights after each wake, A after
    # each reset), and A held its backup while asleep.
    assert m["swap_copy_both_gbps"] > 0
    for mode in ("off", "auto"):
        cycles = m[f"swap_{mode}_cycles"]
        assert len(cycles) >= 1
        assert all(min(c["a_s"], c["b_s"], c["a_alone_s"], c["b_alone_s"]) > 0 for c in cycles)
        assert all(c["a_held"] > 0 for c in cycles)
        assert m[f"swap_{mode}_at_once_ratio"] > 0 and m[f"swap_{mode}_one_after_other_ratio"] > 0


def test_bench_compress_rows_and_swap_on_the_simulated_device(tmp_path):
    out = tmp_path / "bench.json"
    p = run_cli("bench", "--backend", "sim", "--scale", "1024", "--cycles", "1", "--only", "compress,swap",
                "--json", str(out), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "compress: backups compressed" in p.stdout and "swap: two processes on one GPU" in p.stdout
    data = json.loads(out.read_text())
    check_rows_named(data["rows"], COMPRESS_ROWS + SWAP_ROWS + ("1024 x 12.00 KiB, bf16, compress='auto'",))
    m = data["metrics"]
    assert m["errors"] == [] and m["tables"] == ["compress", "swap"]
    check_compress_rows_metrics(m)


def check_rows_named(rows: list, wanted: tuple) -> None:
    """Every name of `wanted` begins or is part of a row that was measured (not skipped). The JSON's rows are the
    printed tables' (whose long names the terminal table wraps over lines)."""
    measured = [r["name"] for r in rows if not str(r["vs"]).startswith("skipped")]
    for name in wanted:
        assert any(name in n for n in measured), (name, measured)


def check_file_tier_metrics(m: dict) -> None:
    """The file_tier table's promises, on any backend: the file system's rates measured, every sleep of the
    weights with tier "file" wrote all of them to files and every wake read them back (the bench verifies the data
    after each), the "auto" reference case with its budget kept the rest in files for 3 cycles, and the host memory
    held while asleep stayed within ring + budget."""
    w = m["weights_bytes"]
    assert m["file_tier_fs_write_gbps"] > 0 and m["file_tier_fs_read_gbps"] > 0
    for case in ("file", "auto"):
        assert m[f"file_tier_{case}_sleep_ratio"] > 0 and m[f"file_tier_{case}_wake_ratio"] > 0
        assert 0 < m[f"file_tier_{case}_host_held_bytes"] <= m[f"file_tier_{case}_host_bound_bytes"]
    every = m["file_tier_file_cycles"]
    assert every and all(c["written"] >= w and c["read"] == c["written"] for c in every)
    assert all(c["host_tier_bytes"] == 0 and c["file_bytes"] == c["written"] for c in every)
    assert m["file_tier_file_host_bound_bytes"] == m["file_tier_staging_bytes"]
    # Retained file backups: an unchanged sleep writes nothing, 1% of the chunks rewritten writes about 1%.
    kept = m["file_tier_retained_cycles"]
    assert all(c["report"]["written_bytes"] == 0 and c["report"]["skipped_bytes"] >= w for c in kept["unchanged"])
    assert all(0 < c["report"]["written_bytes"] <= 0.05 * w for c in kept["one_percent"])
    auto = m["file_tier_auto_cycles"]
    assert len(auto) >= 3
    assert all(0 < c["host_tier_bytes"] and c["written"] > 0 and c["read"] == c["written"] for c in auto)
    assert all(c["host_tier_bytes"] + c["file_bytes"] >= w for c in auto)


def test_bench_file_tier_in_a_given_spill_dir(tmp_path):
    out = tmp_path / "bench.json"
    spill = tmp_path / "spill"
    spill.mkdir()
    p = run_cli("bench", "--backend", "sim", "--scale", "1024", "--cycles", "1", "--only", "file_tier",
                "--spill-dir", str(spill), "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    for row in ("file system: sequential pwrite", "file system: sequential pread", 'sleep, tier "file"',
                "sleep, retained file backups, weights unchanged",
                'wake, "auto"', "pinned host memory held while asleep"):
        assert row in p.stdout, row
    m = json.loads(out.read_text())["metrics"]
    assert m["tables"] == ["file_tier"] and m["errors"] == []
    check_file_tier_metrics(m)
    assert list(spill.iterdir()) == [], "the spill and reference files are unlinked"


@pytest.mark.parametrize("argv, message", [
    (["--only", "sleep_wake,bogus"], "unknown table(s) bogus"),
    (["--spill-dir", "/nonexistent/spill"], "--spill-dir '/nonexistent/spill' is not a directory"),
    (["--alloc-counts", "16,x"], "comma-separated positive counts"),
    (["--alloc-counts", "0"], "comma-separated positive counts"),
])
def test_bench_rejects_bad_table_arguments(argv, message):
    p = run_cli("bench", "--backend", "sim", *argv)
    assert p.returncode == 2 and message in p.stderr, p.stderr


def test_rewrites_touch_exactly_the_chosen_chunks():
    """The benchmark's in-place rewrites (its 1% row) change exactly the bytes of the chosen chunks, and a
    verification against the checksums taken before the rewrite fails until they are taken again."""
    torch = pytest.importorskip("torch")
    import contextlib
    import random

    from cumem_rs.bench.subjects import TensorSubject, choose_chunks
    from cumem_rs.workload import TorchWorkload

    class HostPools:  # plain host tensors: the rewrite logic is the same on any device
        def use_memory_pool(self, tag):
            return contextlib.nullcontext()

    specs = reference_workload(1024, kv_gib=0)[:12]
    wl = TorchWorkload(specs, device="cpu")
    wl.allocate(HostPools())
    wl.fill("weights")
    subject = TensorSubject(wl)
    subject.remember()
    before = [t.reshape(-1).view(torch.uint8).clone() for t in wl.tensors]
    chunk = 4096
    ranges = choose_chunks(subject.spans(), chunk, 0.1, random.Random(3))
    ids = {k for a, n in subject.spans() for k in range(a // chunk, (a + n - 1) // chunk + 1)}
    assert len(ranges) == round(len(ids) * 0.1)
    assert all(n == chunk and lo % chunk == 0 and lo // chunk in ids for lo, n in ranges)
    subject.rewrite(ranges)
    with pytest.raises(VerificationError):
        subject.verify()
    subject.remember()
    subject.verify()
    chosen = torch.tensor(sorted(lo for lo, _ in ranges))
    for t, old in zip(wl.tensors, before):
        new = t.reshape(-1).view(torch.uint8)
        inside = torch.isin((torch.arange(new.numel()) + t.data_ptr()) // chunk * chunk, chosen)
        assert torch.equal(new[inside], old[inside] + 1)
        assert torch.equal(new[~inside], old[~inside])
    subject.rewrite(subject.spans())  # "all weights rewritten": every byte changes
    assert all(not torch.equal(t.reshape(-1).view(torch.uint8), o) for t, o in zip(wl.tensors, before))


@pytest.mark.skipif(not (ROOT / "benches").is_dir(), reason="needs the source tree (benches/)")
def test_bench_script_wrapper(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "benches" / "bench_sleep_wake.py"), "--backend", "sim",
                        "--scale", "2048", "--cycles", "1", "--kv-gib", "0", "--only", "sleep_wake"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "sleep, steady (median of 1)" in p.stdout


@pytest.mark.skipif(gpu_usable(), reason="a GPU is present")
def test_cuda_backend_without_a_gpu_is_a_clear_error():
    p = run_cli("demo", "--backend", "cuda")
    assert p.returncode == 1
    assert "--backend cuda" in p.stderr


@pytest.mark.skipif(not gpu_usable(), reason="needs a CUDA GPU and CUDA torch")
def test_demo_on_the_gpu():
    p = run_cli("demo", "--backend", "cuda", "--scale", "16", "--kv-gib", "4", timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "the link: torch copy_ of the same" in out and "codec: " in out
    rows = [ln for ln in out.splitlines() if ln.startswith("  cycle ")]
    assert len(rows) == 6 and all("x  " in r for r in rows), rows  # each step: time, ratio to the link, host
    assert "every wake verified bit-identical" in out
    summary = out.rstrip().splitlines()[-4:-1]
    assert [ln.split(":")[0].strip() for ln in summary] == ["sleep", "wake", "host"], out
    assert out.rstrip().endswith("every wake bit-identical at unchanged addresses")


@pytest.mark.skipif(not gpu_usable(), reason="needs a CUDA GPU and CUDA torch")
def test_bench_on_the_gpu(tmp_path):
    out = tmp_path / "bench.json"
    p = run_cli("bench", "--backend", "cuda", "--scale", "16", "--kv-gib", "4", "--cycles", "2",
                "--malloc-count", "50", "--only", "sleep_wake,malloc", "--json", str(out), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    m = json.loads(out.read_text())["metrics"]
    assert m["copy_d2h_gbps"] > 0 and m["sleep_ratio"] > 0 and m["host_bytes_after_wake_nokeep"] == 0
    assert m["sleep_skipped_all_bytes"] == [0, 0, 0] and m["errors"] == []


@pytest.mark.skipif(not gpu_usable(), reason="needs a CUDA GPU and CUDA torch")
def test_bench_new_tables_on_the_gpu(tmp_path):
    """Retained backups through both layers (in-place rewrites by torch kernels, data verified after every wake),
    the wall-time table and a short allocation-count table, at a small scale."""
    out = tmp_path / "bench.json"
    p = run_cli("bench", "--backend", "cuda", "--scale", "16", "--kv-gib", "4", "--cycles", "1", "--only",
                "retained,wall,alloc_count", "--alloc-counts", "16,128", "--json", str(out), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    m = json.loads(out.read_text())["metrics"]
    assert m["errors"] == []
    w = m["weights_bytes"]
    for layer in ("core", "torch"):
        on, off = m[f"retained_{layer}_on_cycles"], m[f"retained_{layer}_off_cycles"]
        assert _median_report(on["unchanged"], "copied_bytes") == 0
        assert _median_report(on["unchanged"], "skipped_bytes") >= w
        assert 0 < _median_report(on["one_percent"], "copied_bytes") <= 0.05 * w
        assert _median_report(on["all"], "copied_bytes") >= 0.99 * w
        for kind in ("unchanged", "one_percent", "all"):
            assert _median_report(off[kind], "skipped_bytes") == 0
        assert m[f"retained_{layer}_on_wake_ratio"] > 0
    for call in ("sleep", "wake", "discard"):
        assert m[f"wall_{call}_wall_s"] >= m[f"wall_{call}_core_s"] > 0
    assert m["wall_gc_collect_s"] >= 0
    for layer in ("core", "torch"):
        for n in (16, 128):
            assert m[f"alloc_count_{layer}_{n}_sleep_ratio"] > 0 and m[f"alloc_count_{layer}_{n}_wake_ratio"] > 0


@pytest.mark.skipif(not gpu_usable(), reason="needs a CUDA GPU and CUDA torch")
def test_bench_file_tier_on_the_gpu(tmp_path):
    """The file tier through the process-wide CUDA allocator: the file system measured with pinned torch memory,
    weights spilled and restored bit-identical, host memory within ring + budget; the allocator left as it was."""
    out = tmp_path / "bench.json"
    p = run_cli("bench", "--backend", "cuda", "--scale", "16", "--kv-gib", "0", "--cycles", "1", "--only",
                "file_tier", "--spill-dir", str(tmp_path), "--json", str(out), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    m = json.loads(out.read_text())["metrics"]
    assert m["errors"] == []
    check_file_tier_metrics(m)


@pytest.mark.skipif(not gpu_usable(), reason="needs a CUDA GPU and CUDA torch")
def test_bench_compress_rows_and_swap_on_the_gpu(tmp_path):
    """The compress table's further rows and the swap table (two processes on the GPU) at a small scale; with no
    codec (nvCOMP not installed) the compressed rows say so and only swap's uncompressed rows run."""
    out = tmp_path / "bench.json"
    p = run_cli("bench", "--backend", "cuda", "--scale", "16", "--cycles", "1", "--only", "compress,swap",
                "--no-tms", "--json", str(out), timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(out.read_text())
    m = data["metrics"]
    assert m["errors"] == []
    if "compress_bf16_auto_sleep_ratio" in m:
        check_rows_named(data["rows"], tuple(r for r in COMPRESS_ROWS if "0.2 s" not in r) + SWAP_ROWS +
                         ("first sleep, compressed, 2 s after the weights pool closed",))
        check_compress_rows_metrics(m)
    else:
        assert any("no codec" in str(r["vs"]) for r in data["rows"])
        assert m["swap_off_at_once_ratio"] > 0 and m["swap_off_one_after_other_ratio"] > 0
