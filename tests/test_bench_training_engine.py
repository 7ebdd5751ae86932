"""benches/bench_training_engine.py without timing anything: its arguments, the model it plans, the checksum that
verifies each resume, one training step of its engine on the CPU, the table and ratios it prints from result dicts
of the shape its children write, and its clear skip on a machine without a GPU."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import cumem_rs

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benches" / "bench_training_engine.py"
MiB = 1 << 20

pytestmark = pytest.mark.skipif(not BENCH.is_file(), reason="needs the source tree (benches/)")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_training_engine", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpu_usable() -> bool:
    if not cumem_rs.cuda_available():
        return False
    import torch

    return torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------------------------
# Arguments and the model's plan.


def test_defaults_and_counts_written_as_people_write_them(bench):
    args = bench.parse_args([])
    assert (args.params, args.cycles, args.impl, args.json) == (10**9, 3, list(bench.IMPLS), None)
    assert bench.parse_args(["--params", "2.5e8"]).params == 250_000_000
    assert bench.parse_args(["--params", "1_000_000", "--cycles", "1"]).params == 1_000_000
    assert bench.parse_args(["--impl", "cumem", "tms"]).impl == ["cumem", "tms"]


@pytest.mark.parametrize(
    "argv, name",
    [
        (["--params", "many"], "--params"),
        (["--params", "0"], "--params"),
        (["--params", "-1e9"], "--params"),
        (["--params", "1e3"], "--params"),
        (["--params", "inf"], "--params"),
        (["--params", "nan"], "--params"),
        (["--cycles", "0"], "--cycles"),
        (["--cycles", "2.5"], "--cycles"),
        (["--impl", "vllm"], "--impl"),
        (["--child", "cumem"], "--json"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(bench, capsys, argv, name):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert name in capsys.readouterr().err


@pytest.mark.parametrize("params", [10**4, 10**5, 10**6, 3 * 10**7, 10**8, 10**9, 7 * 10**9])
def test_plan_is_the_nearest_whole_number_of_layers(bench, params):
    width, layers = bench.plan(params)
    per_layer = bench.layer_params(width)
    assert width % 64 == 0 and 64 <= width <= bench.MAX_WIDTH
    assert width * width <= params
    assert layers >= 1 and abs(layers * per_layer - params) <= per_layer / 2
    if params >= bench.MAX_WIDTH**2:
        assert width == bench.MAX_WIDTH


def test_the_default_model_is_about_a_billion_parameters_of_4096_wide_layers(bench):
    width, layers = bench.plan(10**9)
    assert (width, layers) == (4096, 60)
    assert 0.99e9 < layers * bench.layer_params(width) < 1.01e9


# ---------------------------------------------------------------------------------------------------------------
# What each cycle verifies, on the CPU.


def test_checksum_sees_a_changed_word_and_two_swapped_ones(bench):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(1)
    a = (torch.arange(1000) / 7).to(torch.bfloat16)
    b = torch.randn(333, generator=gen)
    base = bench.checksum(torch, [a, b], chunk_words=128)
    assert base.device.type == "cpu" and base.dtype == torch.int64
    assert torch.equal(bench.checksum(torch, [a.clone(), b.clone()], chunk_words=128), base)
    flipped = b.clone()
    flipped.view(torch.int32)[200] ^= 1  # one bit of one word
    assert not torch.equal(bench.checksum(torch, [a, flipped], chunk_words=128), base)
    swapped = a.clone()
    swapped[[3, 100]] = swapped[[100, 3]]  # the same words in another order, inside one chunk
    assert not torch.equal(swapped, a)
    assert not torch.equal(bench.checksum(torch, [swapped, b], chunk_words=128), base)


def test_a_training_step_makes_and_changes_every_state_tensor(bench):
    torch = pytest.importorskip("torch")
    regions = []

    def region(tag):
        regions.append(tag)
        return contextlib.nullcontext()

    torch.manual_seed(0)
    engine = bench.TrainingEngine(torch, 64, 2, region, device="cpu", batch=8)
    assert regions == [bench.PARAMS_TAG, bench.OPTIM_TAG]
    # AdamW has no state before its first step.
    assert [id(t) for t in engine.state()] == [id(t) for t in [*engine.params, *engine.master]]
    loss = engine.step()
    assert loss > 0 and regions[-1] == bench.OPTIM_TAG
    assert engine.grad_threads == {threading.get_ident()}  # on the CPU autograd runs on the caller's thread
    state = engine.state()
    n = len(engine.params)
    # bf16 params, their fp32 master copies, and per master param AdamW's step, exp_avg and exp_avg_sq.
    assert len(state) == 2 * n + 3 * n
    assert all(p.dtype == torch.bfloat16 for p in engine.params) and len(engine.grads()) == n
    assert all(t.dtype == torch.float32 for t in state[n:])
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(engine.params, engine.master))
    assert all(m.grad is None for m in engine.master)  # the step's fp32 grads are freed after it
    before = [t.clone() for t in state]
    sums = bench.checksum(torch, state, chunk_words=1024)
    engine.step()
    changed = [not torch.equal(t, b) for t, b in zip(engine.state(), before)]
    assert all(changed[n:]), "master params and every AdamW state change in a step"
    assert any(changed[:n])
    assert not torch.equal(bench.checksum(torch, engine.state(), chunk_words=1024), sums)


# ---------------------------------------------------------------------------------------------------------------
# The report, from results of the shape the children write.


def fake(impl, label, pause, resume, at_pause_above, allocator=None):
    initial = 3 * (1 << 30)
    return dict(
        impl=impl, label=label, params=1_006_878_720, width=4096, layers=60, layout="x",
        state_bytes=14 * 10**9, grad_bytes=2 * 10**9, limit_bytes=14 * 10**9,
        copy_h2d_gbps=50.0, copy_d2h_gbps=56.0, gpu_used_initial=initial,
        pause_s=pause, resume_s=resume,
        gpu_used_before_pause=[initial + 20 * 10**9] * len(pause),
        gpu_used_at_pause=[initial + at_pause_above] * len(pause),
        gpu_used_after_resume=[initial + 20 * 10**9] * len(pause),
        rss_growth_at_pause=[14 * 10**9] + [0] * (len(pause) - 1),
        allocator_pause=[allocator] * len(pause), losses=[1.0] * (len(pause) + 1), grads_off_caller_thread=True,
    )


def results():
    alloc = dict(copied_bytes=14 * 10**9, skipped_bytes=0, discarded_bytes=6 * 10**9, allocations=42, seconds=0.5)
    return {
        "cumem": fake("cumem", "cumem_rs 0.1", [1.0, 0.5, 0.5], [0.28, 0.28, 0.35], 50 * MiB, alloc),
        "tms": fake("tms", "torch_memory_saver 0.0.10", [7.0, 7.0, 6.0], [2.8, 2.8, 2.8], 300 * MiB),
    }


def test_ratios_are_of_the_copy_limit_and_of_cumem_rs_with_the_same_setting(bench):
    q = bench.ratios(results())
    # 14 GB in 1 s = 14 GB/s of a 56 GB/s limit; steady: the median of cycles 2-3.
    assert q["cumem"]["pause_first_vs_copy"] == pytest.approx(0.25)
    assert q["cumem"]["pause_steady_vs_copy"] == pytest.approx(0.50)
    assert q["cumem"]["resume_first_vs_copy"] == pytest.approx(1.0)
    assert q["cumem"]["resume_steady_vs_copy"] == pytest.approx(14 / 0.315 / 50)
    assert q["cumem"]["pause_first_vs_cumem"] == pytest.approx(1.0)
    assert q["tms"]["pause_first_vs_cumem"] == pytest.approx(7.0)
    assert q["tms"]["pause_steady_vs_cumem"] == pytest.approx(6.5 / 0.5)
    assert q["tms"]["resume_steady_vs_cumem"] == pytest.approx(2.8 / 0.315)
    # Without cumem_rs's run there is nothing to compare with; with one cycle there is no steady figure.
    alone = bench.ratios({"tms": results()["tms"]})
    assert alone["tms"]["pause_first_vs_cumem"] is None
    one = fake("cumem", "c", [1.0], [0.5], 0)
    assert bench.ratios({"cumem": one})["cumem"]["pause_steady_vs_copy"] is None


def test_the_retain_peers_compare_with_cumem_rs_retaining(bench):
    r = results()
    r["cumem-retain"] = fake("cumem-retain", "cumem_rs, retain", [1.0, 0.25, 0.25], [0.3] * 3, 0)
    r["tms-retain"] = fake("tms-retain", "tms, retain", [6.0, 0.5, 0.5], [0.4] * 3, 0)
    assert bench.ratios(r)["tms-retain"]["pause_steady_vs_cumem"] == pytest.approx(2.0)


def test_report_rows(bench, capsys):
    skipped = {"tms-retain": "torch_memory_saver is not installed"}
    failed = {"cumem-retain": "RuntimeError: boom"}
    rows = bench.report(results(), skipped, failed)
    assert all(len(r) == len(bench.COLUMNS) for r in rows)
    by = {(r[0], r[1]): r for r in rows}
    c, t = "cumem_rs 0.1", "torch_memory_saver 0.0.10"
    assert by[(c, "pinned copy_ limit, d2h / h2d GB/s")][3] == "56.0 / 50.0"
    assert by[(c, "pause, cycle 1")][2:6] == ["1.000 s", "14.0", "0.25x", ""]
    assert by[(c, "pause, steady (median of 2)")][2:6] == ["500.00 ms", "28.0", "0.50x", ""]
    assert by[(t, "pause, cycle 1")][5] == "7.00x"
    assert by[(t, "resume, steady (median of 2)")][5] == f"{2.8 / 0.315:.2f}x"
    assert by[(c, "pause/resume per cycle")][6] == "1000.0/280.0, 500.0/280.0, 500.0/350.0 ms"
    assert by[(c, "GPU memory at pause, above initial")][2] == "50.00 MiB"
    assert by[(c, "GPU memory at pause, above initial")][6].startswith("ok (target < 200.00 MiB)")
    assert by[(t, "GPU memory at pause, above initial")][6].startswith("over")
    assert by[(c, "backed up, cycle 1 (allocator)")][2] == "13.04 GiB"
    assert (t, "backed up, cycle 1 (allocator)") not in by  # torch_memory_saver reports no count
    assert by[(c, "state backed up (tensors)")][6].endswith("no backup, made on autograd's thread")
    assert by[("tms-retain", "skipped")][6] == "torch_memory_saver is not installed"
    assert by[("cumem-retain", "FAILED")][6] == "RuntimeError: boom"
    assert not any(r[1] == "child process exit" for r in rows)
    noisy = results()
    noisy["tms"]["exit_error"] = "exit code 1 after the run: CUDA error at teardown"
    assert [r[6] for r in bench.report(noisy, {}, {}) if r[1] == "child process exit"] == [noisy["tms"]["exit_error"]]
    args = bench.parse_args(["--cycles", "3"])
    bench.print_table(bench.title(results(), args), bench.COLUMNS, rows)
    out = capsys.readouterr().out
    assert "1.01B params (60 x Linear(4096, 4096))" in out and "TMS_INIT_ENABLE=1" in out
    assert "0.25x" in out and "7.00x" in out


def test_counts_in_the_title(bench):
    assert [bench.fmt_count(n) for n in (262_656, 12_000_000, 1_006_878_720, 999)] == [
        "262.66k", "12.00M", "1.01B", "999"]


def test_only_a_failure_of_cumem_rs_fails_the_run(bench):
    assert bench.exit_code({}) == 0
    assert bench.exit_code({"tms": "its own bug"}) == 0
    assert bench.exit_code({"cumem-retain": "ours"}) == 1


# ---------------------------------------------------------------------------------------------------------------
# Without a GPU.


@pytest.mark.skipif(gpu_usable(), reason="a GPU is present (the benchmark would run)")
def test_without_a_gpu_it_says_why_and_exits_0(tmp_path):
    out = tmp_path / "te.json"
    p = subprocess.run([sys.executable, str(BENCH), "--params", "1e6", "--json", str(out)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("skipped: ") and "GPU" in p.stdout.splitlines()[0]
    assert "GPU" in json.loads(out.read_text())["skipped"]["all"]
