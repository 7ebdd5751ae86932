"""The RL-loop table (`bench --only rl_loop`) on the simulated device at the smallest scale: its records for every
fraction and mode, the verification it relies on (a corruption planted between sleep and wake fails it), the
host-held figures read from the allocator's stats, its arguments, and that a bench run prints it first. No speed
is asserted: on the sim the times are of an emulation."""

from __future__ import annotations

import argparse
import ctypes
import json
import random

import pytest

from cumem_rs import Allocator
from cumem_rs.bench import TABLES, add_arguments
from cumem_rs.bench import main as bench_main
from cumem_rs.bench import rl_loop, rl_report
from cumem_rs.bench.rl_data import SimRlWeights, chunks_to_rewrite
from cumem_rs.workload import WEIGHTS_TAG, VerificationError, reference_workload, sim_granularity, total_bytes

from conftest import HAS_CUDA

#: The smallest scale every tensor still has a row at (the embedding: 128256 / 4096 rows): 3.9 MiB of weights.
SCALE = "4096"


def run_rl(tmp_path, *extra: str) -> dict:
    out = tmp_path / "rl.json"
    assert bench_main(["--backend", "sim", "--scale", SCALE, "--only", "rl_loop", "--kv-gib", "1",
                       "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())["metrics"]


@pytest.mark.usefixtures("codec_on")
def test_every_fraction_and_mode_has_its_cycles_verified(tmp_path, capsys):
    m = run_rl(tmp_path, "--cycles", "2", "--fractions", "100,10")["rl_loop"]
    recs = m["records"]
    w = m["weights_bytes"]
    assert m["fractions"] == [1.0, 0.1] and m["cycles"] == 2 and m["tensors"] == 291
    for f in (1.0, 0.1):
        for mode in rl_loop.MODES:
            rs = [r for r in recs if r["fraction"] == f and r["mode"] == mode]
            assert [r["cycle"] for r in rs] == [0, 1, 2], (f, mode)
            # The first sleep of a block copies everything and has no wake before it; every later cycle woke
            # and was verified.
            assert rs[0]["wake_s"] is None and not rs[0]["verified"] and rs[0]["copied_bytes"] >= w
            assert all(r["verified"] and r["wake_s"] > 0 and r["wake_ratio"] > 0 for r in rs[1:])
            assert all(r["sleep_s"] > 0 and r["sleep_ratio"] > 0 for r in rs)
            # Retained backups are on in both modes: a sleep copies the rewritten chunks, not the rest.
            for r in rs[1:]:
                assert r["rewritten_bytes"] <= r["copied_bytes"], r
                if f == 1.0:
                    assert r["copied_bytes"] >= w
                else:
                    assert r["copied_bytes"] <= 0.2 * w and r["skipped_bytes"] >= 0.7 * w
            assert all(r["discarded_bytes"] > 0 for r in rs)  # the KV cache, released without backup
    # The configuration each mode ran in, read back from the allocator: the default one, and raw.
    assert m["configs"]["compressed"].startswith("default: compress auto, retain on, budget none, host tier")
    assert m["configs"]["raw"] == "compress off, retain on, budget none, host tier"
    # bf16-like weights compress: the compressed backups of the whole weights hold less than the raw ones.
    held = {mode: [r["held_ratio"] for r in recs if r["mode"] == mode and r["fraction"] == 1.0]
            for mode in rl_loop.MODES}
    assert max(held["compressed"]) < min(held["raw"])
    first = {r["mode"]: r["compression_ratio"] for r in recs if r["fraction"] == 1.0 and r["cycle"] == 0}
    assert first["compressed"] < 0.9 and first["raw"] == 1.0
    # The first fraction once more with the wake's verification off: the same cycles, still checked by the bench's
    # checksums, its wakes verifying nothing where the default configuration's verify every restored byte.
    off = [r for r in recs if r["mode"] == rl_loop.VERIFY_OFF]
    assert [(r["fraction"], r["cycle"]) for r in off] == [(1.0, 0), (1.0, 1), (1.0, 2)]
    assert all(r["verified"] and r["wake_verified_bytes"] == 0 for r in off[1:])
    on = [r for r in recs if r["mode"] == "compressed" and r["fraction"] == 1.0 and r["cycle"] > 0]
    assert all(r["wake_verified_bytes"] >= w for r in on)
    assert m["configs"][rl_loop.VERIFY_OFF].endswith("verify off")
    cost = m["verify_wake_cost"]
    assert cost["fraction"] == 1.0 and cost["verified_s"] > 0 and cost["unverified_s"] > 0
    out = capsys.readouterr().out
    assert "steady state" in out and "every cycle" in out and rl_report.SIM_NOTE[:40] in out
    assert "verification in the default configuration, 100% rewritten" in out


def test_verify_fails_on_a_backup_corrupted_between_sleep_and_wake():
    specs = reference_workload(int(SCALE), kv_gib=0)
    gran = sim_granularity(int(SCALE))
    a = Allocator.simulated(capacity=4 * total_bytes(specs), granularity=gran)
    try:
        a.set_tag_policy(WEIGHTS_TAG, compress="off")  # a raw backup: its bytes can be reached while asleep
        w = SimRlWeights(a, specs, gran)
        w.allocate()
        w.fill()
        a.sleep(WEIGHTS_TAG)
        a.wake_up()
        w.verify()  # the round trip itself is clean
        a.sleep(WEIGHTS_TAG)
        addr, _ = w.spans()[5]
        view = a.view_backup(addr, 64)  # writable: the allocator restores what is written there
        byte = ctypes.c_ubyte.from_address(view.address + 17)
        byte.value ^= 0x40
        a.wake_up()
        with pytest.raises(VerificationError, match="contents differ"):
            w.verify()
    finally:
        a.close()


def test_verify_fails_on_one_byte_changed_after_a_rewrite():
    specs = reference_workload(int(SCALE), kv_gib=0)
    gran = sim_granularity(int(SCALE))
    a = Allocator.simulated(capacity=4 * total_bytes(specs), granularity=gran)
    try:
        w = SimRlWeights(a, specs, gran)
        w.allocate()
        w.fill()
        written = w.rewrite(0.1, random.Random(1))
        assert 0 < written < total_bytes(specs)
        w.verify()  # the rewrite updated what verify expects
        addr, n = w.spans()[-1]
        old = a.read(addr + n - 1, 1)
        a.write(addr + n - 1, bytes([old[0] ^ 1]))
        with pytest.raises(VerificationError):
            w.verify()
    finally:
        a.close()


def test_host_held_is_the_allocators_in_use_plus_cached(tmp_path):
    specs = reference_workload(int(SCALE), kv_gib=0)
    gran = sim_granularity(int(SCALE))
    a = Allocator.simulated(capacity=4 * total_bytes(specs), granularity=gran)
    try:
        a.set_tag_policy(WEIGHTS_TAG, compress="off")
        w = SimRlWeights(a, specs, gran)
        w.allocate()
        w.fill()
        assert rl_loop.host_held(a) == dict(in_use=0, cached=0, held=0, host_bytes=0)
        a.sleep(WEIGHTS_TAG)
        h = rl_loop.host_held(a)
        s = a.stats()
        assert h["in_use"] == s["host_backup_bytes"] >= total_bytes(specs)
        assert h["cached"] == s["host_cached_bytes"]
        assert h["held"] == h["in_use"] + h["cached"] == a.host_bytes() == h["host_bytes"]
        a.wake_up()
        a.set_retain_backups(False)  # drops the retained backups: their arena becomes cached
        h = rl_loop.host_held(a)
        assert h["in_use"] == a.stats()["host_backup_bytes"] and h["cached"] == a.stats()["host_cached_bytes"] > 0
        assert h["held"] == a.host_bytes()
    finally:
        a.close()


def test_the_tables_host_figures_are_those_stats(tmp_path):
    m = run_rl(tmp_path, "--cycles", "1", "--fractions", "50")["rl_loop"]
    for r in m["records"]:
        assert r["held"] == r["in_use"] + r["cached"] == r["host_bytes"], r
        assert r["held_ratio"] == pytest.approx(r["held"] / m["weights_bytes"])
        assert r["in_use"] > 0  # asleep with a backup


def test_cycles_default_to_five_here_and_three_elsewhere(tmp_path):
    metrics = run_rl(tmp_path, "--fractions", "1")
    m = metrics["rl_loop"]
    assert m["cycles"] == 5 and max(r["cycle"] for r in m["records"]) == 5
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([])
    assert args.cycles is None and args.fractions == list(rl_loop.DEFAULT_FRACTIONS)


@pytest.mark.parametrize("text, message", [("0", "percent in"), ("150", "percent in"), ("ten", "not a number")])
def test_bad_fractions_are_refused(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        rl_loop.parse_fractions(text)


def test_fractions_parse_as_percents():
    assert rl_loop.parse_fractions("100, 50,10%,1") == [1.0, 0.5, 0.1, 0.01]


def test_rewritten_chunks_spread_over_every_tensor_and_merge():
    spans = [(i * 1 << 20, 1 << 20) for i in range(0, 40, 2)]  # 20 tensors of 1 MiB, gaps between them
    chunk = 64 << 10
    picked = chunks_to_rewrite(spans, chunk, 0.5, random.Random(0))
    total = sum(n for _, n in picked)
    assert total == 0.5 * 20 * (1 << 20)
    hit = {i for i, (a, n) in enumerate(spans) if any(lo < a + n and a < lo + m for lo, m in picked)}
    assert len(hit) >= 15  # at random over all chunks, not the first half of the tensors
    # Neighbouring chunks are one range; no two ranges touch.
    assert all(picked[k][0] + picked[k][1] < picked[k + 1][0] for k in range(len(picked) - 1))
    assert chunks_to_rewrite(spans, chunk, 1.0, random.Random(0)) == [(a, n) for a, n in spans]


def test_rl_loop_is_the_first_table_a_bench_run_prints(tmp_path, capsys):
    # With no arguments every table runs, in TABLES order; asked in another order they still run in it.
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).only == list(TABLES)
    assert bench_main(["--backend", "sim", "--scale", SCALE, "--only", "malloc,rl_loop,peer", "--cycles", "1",
                       "--fractions", "10", "--malloc-count", "10", "--kv-gib", "1"]) == 0
    out = capsys.readouterr().out
    titled = [line for line in out.splitlines() if "benchmark (sim" in line or "rl_loop (sim" in line]
    # The peer runs first but prints nothing then (no GPU here; its rows come at the end): the RL loop's
    # steady-state table is the first table printed, during the run and again in the final listing.
    assert titled and "rl_loop (sim" in titled[0] and "steady state" in titled[0]
    final = out.rindex("steady state")
    assert final > out.index("malloc/free") and out.index("malloc/free", final) > final


def test_from_json_prints_the_table_again(tmp_path, capsys):
    run_rl(tmp_path, "--cycles", "1", "--fractions", "10")
    capsys.readouterr()
    assert bench_main(["--from-json", str(tmp_path / "rl.json")]) == 0
    out = capsys.readouterr().out
    assert "rl_loop (sim" in out and "steady state" in out and "10%" in out


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (cuda_available() is False)")
def test_gpu_verify_fails_on_a_modified_tensor():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from cumem_rs import CuMemAllocator
    from cumem_rs.bench.rl_data import GpuRlWeights
    from cumem_rs.workload import TorchWorkload

    cumem = CuMemAllocator.get_instance()
    wl = TorchWorkload(reference_workload(64, kv_gib=0.5), device=torch.cuda.current_device())
    wl.allocate(cumem)
    try:
        w = GpuRlWeights(torch, wl, 2 << 20)
        w.fill()
        cumem.sleep(offload_tags=WEIGHTS_TAG)
        cumem.wake_up()
        w.verify()
        w.rewrite(0.1, random.Random(0))
        cumem.sleep(offload_tags=WEIGHTS_TAG)
        cumem.wake_up()
        w.verify()
        wl.tensors[3].view(-1)[7] += 1
        with pytest.raises(VerificationError):
            w.verify()
    finally:
        wl.release()
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        cumem.native.trim_host()


def _gpu_usable() -> bool:
    if not HAS_CUDA:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _gpu_usable(), reason="needs a CUDA GPU and CUDA torch")
def test_rl_loop_on_the_gpu(tmp_path):
    """The table through CuMemAllocator at a small scale, in a child process (a fresh process-wide allocator):
    every cycle verified, retained backups copying only the rewritten chunks, the weights' backups compressed
    where a codec is active and raw under compress="off". No speed is asserted."""
    import subprocess
    import sys

    out = tmp_path / "rl.json"
    p = subprocess.run([sys.executable, "-m", "cumem_rs", "bench", "--backend", "cuda", "--scale", "16",
                        "--kv-gib", "4", "--cycles", "2", "--fractions", "100,1", "--only", "rl_loop",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    metrics = json.loads(out.read_text())["metrics"]
    m = metrics["rl_loop"]
    assert metrics["errors"] == [] and m["times_meaningful"] and m["chunk"] == 2 << 20
    w = m["weights_bytes"]
    recs = m["records"]
    assert len(recs) == 2 * 2 * 3
    assert all(r["verified"] for r in recs if r["cycle"] > 0)
    assert all(r["discarded_bytes"] >= 4 * (1 << 30) // 16 for r in recs)  # the KV cache
    one = [r for r in recs if r["fraction"] == 0.01 and r["cycle"] > 0]
    assert one and all(r["copied_bytes"] <= 0.05 * w for r in one)
    assert m["configs"]["raw"].startswith("compress off, retain on")
    if m["codec"]:
        assert m["configs"]["compressed"].startswith("default: compress auto")
        # bf16-like weights shrink (about 2/3 with nvCOMP's ANS); raw backups are never "compressed".
        first = {r["mode"]: r["compression_ratio"] for r in recs if r["fraction"] == 1.0 and r["cycle"] == 0}
        assert first["compressed"] < 0.9 and first["raw"] == 1.0
