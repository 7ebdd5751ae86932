"""The benchmark's tables as one PNG chart (`bench --plot PATH`; `bench --from-json JSON --plot PATH` redraws one
from a JSON written by `bench --json`): first the RL-loop table's three panels (sleep and wake against the link,
host memory held against the raw bytes, per steady cycle, compressed and raw; see rl_report), then per table a
horizontal bar per row that has a ratio, against its reference (the copy limit, the raw driver calls, the peer:
the row says which), the reference drawn at 1.0. Green is better than the reference (a rate above it, a time
below it), blue is not.

matplotlib is optional: without it the benchmark still runs and says how to get the chart."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

from . import rl_report

MISSING = "matplotlib is not installed, so no chart was drawn (pip install matplotlib, then run again)"


def plot_path_arg(text: str) -> str:
    """An argparse type: a writable PNG path, checked before the benchmark spends its time."""
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"--plot writes a PNG file: {text!r} does not end in .png")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"--plot {text!r}: directory {parent!r} does not exist or is not writable")
    return text


LABEL_CHARS = 90


def tables(rows: list[dict]) -> dict[str, list[tuple[str, float, bool]]]:
    """Per table (in order), its rows that carry a ratio: (label, ratio, better than the reference). A rate
    (a row with GB/s, or marked higher_is_better) is better above 1, a time below 1."""
    out: dict[str, list[tuple[str, float, bool]]] = {}
    for r in rows:
        if r.get("ratio") is None:
            continue
        ratio = float(r["ratio"])
        better = ratio >= 1.0 if r.get("gbps") is not None or r.get("higher_is_better") else ratio <= 1.0
        vs = str(r.get("vs") or "").split(";")[0]
        label = f"{r['name']} (of {vs})" if vs else str(r["name"])
        if len(label) > LABEL_CHARS:
            label = label[: LABEL_CHARS - 1] + "…"
        out.setdefault(r.get("table") or "benchmark", []).append((label, ratio, better))
    return out


def plot_file(rows: list[dict], path: str, title: str, rl: Optional[dict] = None) -> Optional[str]:
    """Draw the chart into `path` (with `rl`, the metrics of an RL-loop table, its panels first); returns the
    path, or None (with a message) where matplotlib is missing or there is nothing to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(MISSING, file=sys.stderr)
        return None
    data = tables(rows)
    rl_panels = len(rl_report.PANELS) if rl and rl.get("records") else 0
    if not data and not rl_panels:
        print("no row of this run has a ratio: no chart drawn", file=sys.stderr)
        return None
    heights = [2.4] * rl_panels + [max(1.2, 0.32 * len(items) + 0.9) for items in data.values()]
    fig, axes = plt.subplots(len(heights), 1, figsize=(11, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    if rl_panels:
        rl_report.draw(list(axes[:rl_panels, 0]), rl)  # type: ignore[arg-type]
    for ax, (table, items) in zip(axes[rl_panels:, 0], data.items()):
        names = [label for label, _, _ in items]
        ratios = [ratio for _, ratio, _ in items]
        ax.barh(range(len(items)), ratios, color=["#55a868" if better else "#4c72b0" for _, _, better in items])
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_yticks(range(len(items)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(table, fontsize=9, loc="left")
        for i, x in enumerate(ratios):
            ax.text(x, i, f" {x:.2f}x", va="center", fontsize=7)
        ax.set_xlim(0, max(1.1, max(ratios) * 1.15))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def load_rows(path: str) -> list[dict]:
    """The rows of a JSON written by `bench --json`; SystemExit naming the file when it is not one."""
    return load_json(path)[1]


def load_json(path: str) -> tuple[dict, list[dict]]:
    """(metrics, rows) of a JSON written by `bench --json`; SystemExit naming the file when it is not one."""
    try:
        with open(path) as f:
            data: Any = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot read {path!r}: {e}")
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise SystemExit(f"error: {path!r} is not a benchmark JSON (no 'rows' list)")
    metrics = data.get("metrics")
    return (metrics if isinstance(metrics, dict) else {}), data["rows"]
