"""The RL-loop table's text and chart, from its metrics (`bench --json` keeps them: `--from-json` prints and draws
them again).

Two tables: the steady state (cycles 1..N of every block, compressed and raw side by side per fraction: the one a
user asks for), then every cycle. Ratios are to the link (link time / call time: above 1 is faster than a pinned
copy of the same bytes) and host memory held is against the raw bytes of the weights (below 1 holds less)."""

from __future__ import annotations

import statistics
from typing import Any, Optional

from .common import fmt_bytes, fmt_seconds, print_table

SIM_NOTE = ("simulated device: times are of a host emulation (memcpy, zstd on this machine's cores) and not "
            "meaningful; what counts there is that every wake was verified and the host memory held")


def steady(recs: list[dict], fraction: float, mode: str) -> list[dict]:
    """The records of cycles 1..N (after the block's first sleep) of one fraction and mode."""
    return [r for r in recs if r["fraction"] == fraction and r["mode"] == mode and r["cycle"] > 0]


def fractions(recs: list[dict]) -> list[float]:
    out: list[float] = []
    for r in recs:
        if r["fraction"] not in out:
            out.append(r["fraction"])
    return out


def pct(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def _spread(values: list[float], digits: int = 2) -> str:
    """'median (min-max)' of ratios."""
    if not values:
        return ""
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}x"
    return f"{med:.{digits}f}x ({min(values):.{digits}f}-{max(values):.{digits}f})"


def summary(m: dict) -> list[dict]:
    """Per fraction and mode, the steady cycles' sleep and wake ratios to the link and host held / raw bytes."""
    out = []
    recs = m["records"]
    for f in fractions(recs):
        for mode in ("compressed", "raw"):
            rs = steady(recs, f, mode)
            if rs:
                out.append(dict(fraction=f, mode=mode, sleep=[r["sleep_ratio"] for r in rs],
                                wake=[r["wake_ratio"] for r in rs], held=[r["held_ratio"] for r in rs],
                                verified=all(r["verified"] for r in rs)))
    return out


#: The mode of rl_loop's block with the wake's verification off (rl_loop.VERIFY_OFF).
VERIFY_OFF = "compressed, verify off"


def verify_cost(m: dict) -> Optional[dict]:
    """What the wake's verification costs in the default configuration: the steady wakes of the first fraction,
    compressed, against the same block with verification off in the same run (None without that block)."""
    recs = m["records"]
    off = [r["wake_s"] for r in recs if r["mode"] == VERIFY_OFF and r["cycle"] > 0]
    if not off:
        return None
    fraction = next(r["fraction"] for r in recs if r["mode"] == VERIFY_OFF)
    on = [r["wake_s"] for r in steady(recs, fraction, "compressed")]
    if not on:
        return None
    on_s, off_s = statistics.median(on), statistics.median(off)
    return dict(fraction=fraction, verified_s=on_s, unverified_s=off_s,
                cost=(on_s - off_s) / on_s if on_s > 0 else 0.0)


def _title(m: dict, what: str) -> str:
    return (f"rl_loop ({m['backend']}, scale 1/{m['scale']}, {m['tensors']} tensors, weights "
            f"{fmt_bytes(m['weights_bytes'])}, KV {fmt_bytes(m['kv_bytes'])} discarded at each sleep): {what}")


def header(m: dict) -> list[str]:
    link = m["link"]
    lines = [f"link: pinned copy of {fmt_bytes(link['bytes'])}: device->host {link['d2h_gbps']:.2f} GB/s "
             f"({fmt_seconds(link['bytes'] / link['d2h_gbps'] / 1e9)}), host->device {link['h2d_gbps']:.2f} GB/s "
             f"({fmt_seconds(link['bytes'] / link['h2d_gbps'] / 1e9)})"]
    for mode, text in (m.get("configs") or {}).items():
        lines.append(f"{mode}: {text}")
    lines.append(f"codec: {m.get('codec') or 'none (backups raw)'}")
    lines.append(f"{m['cycles']} cycles per block after its first sleep: wake ({m.get('park_s', 0):g} s parked), "
                 f"verify, rewrite the fraction's {fmt_bytes(m.get('chunk'))} chunks, sleep")
    if not m.get("times_meaningful", True):
        lines.append(SIM_NOTE)
    return lines


def show(m: dict) -> None:
    for line in header(m):
        print(f"  {line}")
    rows: list[list[str]] = []
    by = {(s["fraction"], s["mode"]): s for s in summary(m)}
    for f in fractions(m["records"]):
        c, r = by.get((f, "compressed")), by.get((f, "raw"))
        row = [pct(f)]
        for key in ("sleep", "wake", "held"):
            row += [_spread(c[key]) if c else "", _spread(r[key]) if r else ""]
        row.append("yes" if all(s and s["verified"] for s in (c, r)) else "NO")
        rows.append(row)
    print_table(_title(m, "steady state, median (min-max) of the cycles after the first sleep"),
                ["rewritten", "sleep x link, compressed", "sleep x link, raw", "wake x link, compressed",
                 "wake x link, raw", "host held x raw, compressed", "host held x raw, raw", "verified"], rows)
    cost = verify_cost(m)  # from the records: a JSON of a run before the block existed has none
    if cost:
        target = " (target <= 5%)" if m.get("times_meaningful", True) else ""
        print(f"  verification in the default configuration, {pct(cost['fraction'])} rewritten, steady wake "
              f"median: verified {fmt_seconds(cost['verified_s'])}, verification off "
              f"{fmt_seconds(cost['unverified_s'])}: verification is {100 * cost['cost']:+.1f}% of the verified "
              f"wake's time{target}")
    cells: list[list[str]] = []
    for rec in m["records"]:
        cells.append([
            pct(rec["fraction"]), rec["mode"], str(rec["cycle"]) if rec["cycle"] else "0 (first)",
            fmt_seconds(rec["sleep_s"]), f"{rec['sleep_ratio']:.2f}x", fmt_bytes(rec["copied_bytes"]),
            fmt_seconds(rec["wake_s"]), "" if rec["wake_ratio"] is None else f"{rec['wake_ratio']:.2f}x",
            f"{fmt_bytes(rec['in_use'])} + {fmt_bytes(rec['cached'])}", f"{rec['held_ratio']:.3f}x",
            "yes" if rec["verified"] else "-",
        ])
    print_table(_title(m, "every cycle"),
                ["rewritten", "mode", "cycle", "sleep", "x link", "copied", "wake", "x link",
                 "host held (in use + cached)", "x raw", "verified"], cells)


# ---------------------------------------------------------------------------------------------------------------
# The chart: three panels (sleep, wake, host held), the steady cycles of each fraction in a group along x.

PANELS = (("sleep_ratio", "sleep: link time / sleep time (higher is better)"),
          ("wake_ratio", "wake: link time / wake time (higher is better)"),
          ("held_ratio", "host memory held after the sleep / raw bytes (lower is better)"))
COLORS = {"compressed": "#55a868", "raw": "#4c72b0"}


def series(m: dict, key: str, mode: str) -> tuple[list[float], list[Optional[float]]]:
    """x positions and values of `key` over the steady cycles, fraction after fraction (None between groups, so
    that no line joins two fractions)."""
    xs: list[float] = []
    ys: list[Optional[float]] = []
    for g, f in enumerate(fractions(m["records"])):
        for r in steady(m["records"], f, mode):
            xs.append(g * (m["cycles"] + 1) + r["cycle"])
            ys.append(r[key])
        xs.append(g * (m["cycles"] + 1) + m["cycles"] + 0.5)
        ys.append(None)
    return xs, ys


def draw(axes: list, m: dict) -> None:
    """The three panels into `axes` (matplotlib Axes)."""
    fr = fractions(m["records"])
    n = m["cycles"]
    centers = [g * (n + 1) + (n + 1) / 2 for g in range(len(fr))]
    suffix = " (simulated device: times not meaningful)" if not m.get("times_meaningful", True) else ""
    for ax, (key, what) in zip(axes, PANELS):
        top = 1.1
        for mode in ("compressed", "raw"):
            xs, ys = series(m, key, mode)
            vals = [y for y in ys if y is not None]
            if not vals:
                continue
            top = max(top, max(vals) * 1.15)
            ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", markersize=3,
                    color=COLORS[mode], label=mode)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_ylim(0, top)
        ax.set_xticks(centers, [f"{pct(f)} rewritten" for f in fr], fontsize=7)
        ax.set_title(f"rl_loop, {what}{suffix if key != 'held_ratio' else ''}", fontsize=9, loc="left")
        ax.legend(fontsize=7, loc="upper right")
