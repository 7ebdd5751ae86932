"""The benchmark's chart (`bench --plot`, `bench --from-json`): what it draws, and the checks of its arguments."""

from __future__ import annotations

import argparse
import json

import pytest

from cumem_rs.bench import main as bench_main
from cumem_rs.bench import Results, plot

ROWS = [
    dict(table="sleep/wake", name="sleep, steady", bytes=1 << 30, seconds=0.02, gbps=53.0, ratio=0.96,
         vs="device->host copy"),
    dict(table="sleep/wake", name="wake, steady", bytes=1 << 30, seconds=0.02, gbps=60.0, ratio=1.08,
         vs="host->device copy; compressed"),
    dict(table="malloc", name="malloc+free", bytes=None, seconds=1e-5, gbps=None, ratio=0.9, vs="raw driver calls"),
    dict(table="malloc", name="free of a big one", bytes=None, seconds=1e-3, gbps=None, ratio=1.4, vs="raw"),
    dict(table="malloc", name="a value", bytes=5, seconds=None, gbps=None, ratio=None, vs=""),
]


def test_tables_keep_rows_with_a_ratio_and_say_which_beat_their_reference():
    t = plot.tables(ROWS)
    assert list(t) == ["sleep/wake", "malloc"]
    # A rate beats its reference above 1, a time below 1; the note after ';' is left out of the label.
    assert [(label, better) for label, _, better in t["sleep/wake"]] == [
        ("sleep, steady (of device->host copy)", False),
        ("wake, steady (of host->device copy)", True),
    ]
    assert [better for _, _, better in t["malloc"]] == [True, False]
    assert all(len(label) <= plot.LABEL_CHARS for items in t.values() for label, _, _ in items)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "chart.png"
    assert plot.plot_file(ROWS, str(out), "test") == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_rows_without_ratios_draws_nothing(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "chart.png"
    assert plot.plot_file([ROWS[-1]], str(out), "test") is None
    assert not out.exists()
    assert "no row" in capsys.readouterr().err


def test_plot_path_is_checked_before_anything_runs(tmp_path):
    with pytest.raises(argparse.ArgumentTypeError, match="PNG"):
        plot.plot_path_arg(str(tmp_path / "chart.jpg"))
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        plot.plot_path_arg(str(tmp_path / "missing" / "chart.png"))
    assert plot.plot_path_arg(str(tmp_path / "chart.png")) == str(tmp_path / "chart.png")


def test_from_json_redraws_a_saved_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps({"metrics": {}, "rows": ROWS, "partial": False}))
    out = tmp_path / "chart.png"
    assert bench_main(["--from-json", str(saved), "--plot", str(out)]) == 0
    assert out.exists()
    assert "wake, steady" in capsys.readouterr().out


def test_from_json_of_something_else_names_the_file(tmp_path):
    other = tmp_path / "other.json"
    other.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="other.json"):
        bench_main(["--from-json", str(other)])


def test_a_rate_row_is_better_above_its_reference(capsys):
    # A rate that is not bytes (the matmul loop beside a compressed pause): higher is better, like a bandwidth,
    # though the row has no GB/s.
    res = Results()
    res.section("compress")
    res.rate("loop_busy", "loop while pausing", 90, 1.0, 100.0, "the loop alone")
    res.rate("loop_fast", "loop, faster", 110, 1.0, 100.0, "the loop alone")
    assert res.metrics["loop_busy_ratio"] == pytest.approx(0.9) and res.metrics["loop_busy_per_s"] == 90
    assert [better for _, _, better in plot.tables(res.rows)["compress"]] == [False, True]
    res.print("t")
    assert "0.900x" in capsys.readouterr().out


def _rl_metrics() -> dict:
    """RL-loop metrics as `bench --json` writes them: two fractions, two modes, a first sleep and 2 cycles."""
    recs = []
    for f in (1.0, 0.1):
        for mode, held in (("compressed", 0.7), ("raw", 1.0)):
            for cycle in range(3):
                recs.append(dict(fraction=f, mode=mode, config="default", cycle=cycle, sleep_s=0.3,
                                 sleep_ratio=1.0 + cycle / 10, wake_s=None if cycle == 0 else 0.2,
                                 wake_ratio=None if cycle == 0 else 1.4, rewritten_bytes=1, copied_bytes=1,
                                 skipped_bytes=0, discarded_bytes=1, compression_ratio=0.7, held_ratio=held,
                                 verified=cycle > 0, in_use=7, cached=0, held=7, host_bytes=7))
    return dict(backend="cuda", scale=1, tensors=291, weights_bytes=10, kv_bytes=48, cycles=2, fractions=[1.0, 0.1],
                link=dict(bytes=10, d2h_gbps=55.0, h2d_gbps=55.0), times_meaningful=True, park_s=1.0, chunk=2 << 20,
                records=recs, configs={"compressed": "default: ...", "raw": "compress off, ..."}, codec="nvcomp")


def test_rl_series_leave_out_first_sleeps_and_break_between_fractions():
    from cumem_rs.bench import rl_report

    xs, ys = rl_report.series(_rl_metrics(), "sleep_ratio", "raw")
    # Cycles 1 and 2 of each fraction (not the first sleep), a gap (None) after each group.
    assert ys == [1.1, 1.2, None, 1.1, 1.2, None]
    assert xs[:2] == [1, 2] and xs[3:5] == [4, 5]


def test_plot_draws_the_rl_panels_with_or_without_other_rows(tmp_path):
    pytest.importorskip("matplotlib")
    only = tmp_path / "rl.png"
    assert plot.plot_file([], str(only), "test", _rl_metrics()) == str(only)
    both = tmp_path / "both.png"
    assert plot.plot_file(ROWS, str(both), "test", _rl_metrics()) == str(both)
    for p in (only, both):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_from_json_prints_and_draws_the_rl_table(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps({"metrics": {"rl_loop": _rl_metrics()}, "rows": [], "partial": False}))
    out = tmp_path / "chart.png"
    assert bench_main(["--from-json", str(saved), "--plot", str(out)]) == 0
    assert out.exists()
    text = capsys.readouterr().out
    assert "steady state" in text and "every cycle" in text and "100%" in text and "10%" in text
