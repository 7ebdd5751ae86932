"""What every table of the benchmark shares: formatting (also used by the demo), the Results collector, timing,
and the per-run context (backend, arguments, the cached references every ratio is taken against)."""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Optional

from .. import _env

# ---------------------------------------------------------------------------------------------------------------
# Formatting, shared with the demo.


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return ""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: Optional[float]) -> str:
    if s is None:
        return ""
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def print_table(title: str, columns: list[str], rows: list[list[str]], left: Optional[set[int]] = None) -> None:
    """A rich Table when rich is installed (it is an optional dependency), else aligned plain text. Columns of
    `left` (default: the first and the last) are left-justified, the others right-justified."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
        print(title)
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
        for r in rows:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
        return
    console = Console()
    if not console.is_terminal:
        # Piped output gets 80 columns by default, which would wrap the numbers.
        console = Console(width=200)
    table = Table(title=title)
    for i, c in enumerate(columns):
        lefts = {0, len(columns) - 1} if left is None else left
        # The first column names the row: never wrapped, so that a name can be found in the output.
        table.add_column(c, justify="left" if i in lefts else "right", no_wrap=i == 0)
    for r in rows:
        table.add_row(*r)
    console.print(table)


def say(msg: str) -> None:
    print(f"· {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Results: every number goes both into a table row and into a flat metrics dict (for --json).


class Results:
    """Rows grouped in sections (one printed table each, in the order they were opened) plus flat metrics."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.metrics: dict[str, Any] = {}
        self._section = ""
        self._config = ""

    @classmethod
    def from_rows(cls, rows: list[dict]) -> "Results":
        """Results holding `rows` as a JSON of `--json` has them (to print them again)."""
        res = cls()
        res.rows = list(rows)
        return res

    def section(self, title: str) -> None:
        """Rows added from now on belong to the table titled `title` (and state no configuration until
        `configure`)."""
        self._section = title
        self._config = ""

    @property
    def current_section(self) -> str:
        return self._section

    def configure(self, text: str) -> None:
        """The configuration the rows added from now on ran in (`config.short`: "default", or what differs from
        it); set when a table sets its policies, before it measures."""
        self._config = text

    @property
    def current_config(self) -> str:
        return self._config

    def _add(self, **row: Any) -> None:
        self.rows.append(dict(row, table=self._section, config=self._config))

    def bandwidth(self, key: str, name: str, nbytes: int, seconds: float, limit_gbps: Optional[float],
                  vs: str = "") -> float:
        gbps = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
        ratio = gbps / limit_gbps if limit_gbps else None
        self.metrics.update({f"{key}_s": seconds, f"{key}_gbps": gbps})
        if ratio is not None:
            self.metrics[f"{key}_ratio"] = ratio
        self._add(name=name, bytes=nbytes, seconds=seconds, gbps=gbps, ratio=ratio, vs=vs)
        return gbps

    def latency(self, key: str, name: str, seconds_per_op: float, baseline: Optional[float] = None,
                vs: str = "", nbytes: Optional[int] = None) -> None:
        ratio = seconds_per_op / baseline if baseline else None
        self.metrics[f"{key}_s"] = seconds_per_op
        if ratio is not None:
            self.metrics[f"{key}_ratio"] = ratio
        self._add(name=name, bytes=nbytes, seconds=seconds_per_op, gbps=None, ratio=ratio, vs=vs)

    def rate(self, key: str, name: str, count: int, seconds: float, reference_per_s: Optional[float],
             vs: str = "") -> float:
        """A rate that is not bytes (e.g. kernels per second): `count` in `seconds`, as a ratio of
        `reference_per_s`; higher is better, like a bandwidth (the row says so for the chart)."""
        per_s = count / seconds if seconds > 0 else float("inf")
        ratio = per_s / reference_per_s if reference_per_s else None
        self.metrics.update({f"{key}_s": seconds, f"{key}_per_s": per_s})
        if ratio is not None:
            self.metrics[f"{key}_ratio"] = ratio
        self._add(name=name, bytes=None, seconds=seconds, gbps=None, ratio=ratio, vs=vs, higher_is_better=True)
        return per_s

    def value(self, key: str, name: str, nbytes: int, vs: str = "") -> None:
        self.metrics[key] = nbytes
        self._add(name=name, bytes=nbytes, seconds=None, gbps=None, ratio=None, vs=vs)

    def skipped(self, name: str, reason: str) -> None:
        self._add(name=name, bytes=None, seconds=None, gbps=None, ratio=None, vs=f"skipped: {reason}")

    def print(self, title: str, rows: Optional[list[dict]] = None) -> None:
        """Print `rows` (default: all of them) as one table per section."""
        sections: dict[str, list[list[str]]] = {}
        for r in self.rows if rows is None else rows:
            sections.setdefault(r.get("table", ""), []).append([
                r["name"],
                r.get("config") or "",
                fmt_bytes(r["bytes"]),
                fmt_seconds(r["seconds"]),
                f"{r['gbps']:.2f}" if r["gbps"] is not None else "",
                f"{r['ratio']:.3f}x" if r["ratio"] is not None else "",
                r["vs"],
            ])
        for section, cells in sections.items():
            print_table(f"{title}: {section}" if section else title,
                        ["measurement", "config", "bytes", "time", "GB/s", "ratio", "ratio of / note"], cells,
                        left={0, 1, 6})


def timed(fn: Callable[[], Any], sync: Callable[[], None] = lambda: None) -> tuple[Any, float]:
    """Run `fn` between two synchronisations and return (result, wall seconds)."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def each(fn: Callable[[Any], None], items: list) -> None:
    for x in items:
        fn(x)


def report_seconds(report: Any) -> Optional[float]:
    """The core's own time from a sleep/wake/discard report (None when the callable returned no report)."""
    return float(report["seconds"]) if isinstance(report, dict) and "seconds" in report else None


def retain_default() -> bool:
    """The retained-backup policy an allocator starts with (the switch CUMEM_RS_RETAIN_BACKUPS, read as the
    engine reads it)."""
    return _env.flag(_env.RETAIN_BACKUPS, True)


# ---------------------------------------------------------------------------------------------------------------
# The run.


class Context:
    """One benchmark run: its arguments, backend, results, and references measured once and shared by every table
    that takes a ratio against them (same run, same machine)."""

    def __init__(self, args: argparse.Namespace, backend: str, res: Results, scale: int):
        self.args = args
        self.backend = backend
        self.res = res
        self.scale = scale
        self.cycles: int = args.cycles
        self._cache: dict[Any, Any] = {}
        self.errors: list[str] = []
        self.torch: Any = None
        self.device = 0
        if backend == "cuda":
            import torch

            self.torch = torch
            self.device = torch.cuda.current_device()

    @property
    def gpu(self) -> bool:
        return self.backend == "cuda"

    def sync(self) -> None:
        if self.torch is not None:
            self.torch.cuda.synchronize()

    def add_errors(self, errors: list[str]) -> None:
        """Errors an allocator recorded (calls that could not raise); the run reports them all."""
        self.errors.extend(errors)

    def check_fits(self, nbytes: int, what: str = "the workload") -> None:
        """On the GPU: exit with a clear message unless `nbytes` of device memory are free."""
        if not self.gpu:
            return
        free, _ = self.torch.cuda.mem_get_info(self.device)
        if nbytes > free:
            raise SystemExit(f"error: {what} needs {fmt_bytes(nbytes)} of GPU memory, {fmt_bytes(free)} is free; "
                             f"use --scale or --kv-gib")

    def cached(self, key: Any, measure: Callable[[], Any]) -> Any:
        """`measure()` once per run and `key`; later calls return the same figure."""
        if key not in self._cache:
            self._cache[key] = measure()
        return self._cache[key]
