"""What the benchmarks share: timing, argument types, the printed table, CSV and PNG output.

* Timing: :func:`time_ms` is the median of timed calls after warm-up; on CUDA it is
  ``kernel_common.timing`` (CUDA events around eager calls, or CUDA-graph replays), on the CPU
  the wall clock of each call.
* Arguments: ``type=`` functions for argparse (:func:`positive_int`, :func:`comma_list`, ...)
  that raise ``argparse.ArgumentTypeError``, so a bad flag is a one-line usage error (exit 2).
* Output: :func:`print_table` (aligned columns), :func:`write_csv` / :func:`read_csv`, and PNG
  plots through :func:`pyplot` / :func:`bar_plot` / :func:`save_figure` (matplotlib, an optional
  dependency: the ``plot`` extra, imported only when a plot is drawn).
* CUDA sources of the floors: :func:`cuda_library` builds one with nvcc for sm_90a.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import hashlib
import importlib.util
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")

RESULTS_DIR = Path(__file__).resolve().parents[2] / "results"
"""``benchmarks/results`` of the source tree: where the result files of the benchmarks live."""


# -- timing ------------------------------------------------------------------------------------


def time_ms(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    rep: int = 10,
    device: torch.device | str = "cuda",
    graph: bool = False,
) -> float:
    """Median milliseconds of ``fn()`` over ``rep`` timed calls, after ``warmup`` untimed ones.

    On a CUDA ``device``: CUDA events around each eager call
    (``kernel_common.timing.cuda_time_ms``), or with ``graph`` one replay of ``fn`` captured in a
    CUDA graph (``cuda_graph_time_ms``: the device time without the host's launch work). On the
    CPU: ``time.perf_counter`` around each call.
    """
    if torch.device(device).type == "cuda":
        from kernel_common.timing import cuda_graph_time_ms, cuda_time_ms

        timer = cuda_graph_time_ms if graph else cuda_time_ms
        return timer(fn, warmup=warmup, rep=rep)
    if graph:
        raise ValueError("time_ms: CUDA-graph timing needs a CUDA device")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def require_cuda(prog: str, hint: str = "") -> None:
    """Exit with a one-line message unless a CUDA GPU is present."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{prog}: needs a CUDA GPU{hint}")


# -- arguments ---------------------------------------------------------------------------------


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line usage errors: ``prog: error: message`` and a pointer to
    ``--help`` on stderr, exit status 2 (argparse's own also prints the whole usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    return _int(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    return _int(text, 0, "an integer >= 0")


def one_of(choices: Sequence[str], what: str) -> Callable[[str], str]:
    """argparse type: one of ``choices`` (the message lists them)."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {text!r}; choose from {', '.join(choices)}"
            )
        return text

    return parse


def comma_list(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """argparse type: a comma-separated list, each entry parsed by ``item`` (duplicates
    dropped, order kept)."""

    def parse(text: str) -> list[T]:
        parts = [p.strip() for p in text.split(",")]
        if not all(parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return list(dict.fromkeys(item(p) for p in parts))

    return parse


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def require_matplotlib(parser: argparse.ArgumentParser, flag: str) -> None:
    """A usage error (before anything runs) if ``flag`` asks for a plot without matplotlib."""
    if not have_matplotlib():
        parser.error(
            f"{flag} needs matplotlib, which is not installed (the workspace's dev group and the "
            "benchmarks' 'plot' extra install it: uv sync --all-packages; elsewhere pip install "
            "matplotlib)"
        )


# -- printed table -----------------------------------------------------------------------------


def fmt_value(v: Any) -> str:
    """A cell: '-' for None, floats with 2 decimals (3 significant digits below 0.01)."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2e}" if abs(v) < 1e-2 and v != 0 else f"{v:.2f}"
    return str(v)


@dataclass(frozen=True)
class Column:
    """One column of :func:`print_table`: the row key, its header (default the key) and how a
    value is written (a ``str.format`` pattern such as ``"{:.3f}"`` or a function; default
    :func:`fmt_value`). Missing and None values print as '-'."""

    key: str
    header: str | None = None
    fmt: str | Callable[[Any], str] | None = None

    def cell(self, row: Mapping[str, Any]) -> str:
        value = row.get(self.key)
        if value is None:
            return "-"
        if self.fmt is None:
            return fmt_value(value)
        return self.fmt.format(value) if isinstance(self.fmt, str) else self.fmt(value)


def format_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[Column | str],
    *,
    drop_empty: bool = False,
) -> str:
    """Rows as aligned text columns: text columns left-aligned, numbers right-aligned.
    ``drop_empty`` leaves out the columns that no row has a value for."""
    cols = [c if isinstance(c, Column) else Column(c) for c in columns]
    if drop_empty:
        cols = [c for c in cols if any(r.get(c.key) is not None for r in rows)]
    heads = [c.header or c.key for c in cols]
    cells = [[c.cell(r) for c in cols] for r in rows]
    widths = [max([len(h), *(len(x[i]) for x in cells)]) for i, h in enumerate(heads)]
    text = [
        all(isinstance(r.get(c.key), str) for r in rows if r.get(c.key) is not None) for c in cols
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.ljust(w) if left else v.rjust(w)
            for v, w, left in zip(values, widths, text, strict=True)
        ).rstrip()

    return "\n".join([line(heads), *(line(x) for x in cells)])


def print_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[Column | str],
    *,
    drop_empty: bool = False,
) -> None:
    print(format_table(rows, columns, drop_empty=drop_empty), flush=True)


def named(row: Mapping[str, Any], keys: Sequence[str]) -> str:
    """``key=value`` pairs of ``row`` (a progress line that names its columns)."""
    return " ".join(f"{k}={fmt_value(row.get(k))}" for k in keys)


# -- CSV ---------------------------------------------------------------------------------------


def write_csv(
    rows: Sequence[Mapping[str, Any]], path: Path, fields: Sequence[str] | None = None
) -> Path:
    """Write ``rows`` as CSV (None as an empty cell). ``fields`` default to every key of the
    rows, in the order they first appear."""
    if fields is None:
        fields = list(dict.fromkeys(k for r in rows for k in r))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_csv(
    path: Path, types: Mapping[str, Callable[[str], Any]] | None = None
) -> list[dict[str, Any]]:
    """Rows of a CSV written by :func:`write_csv`. A column named in ``types`` is converted by
    its function; any other is parsed as a number (int, else float) or kept as text. Empty
    cells are left out."""
    types = types or {}
    with Path(path).open(newline="") as f:
        return [
            {k: types[k](v) if k in types else _value(v) for k, v in r.items() if v != ""}
            for r in csv.DictReader(f)
        ]


# -- plots -------------------------------------------------------------------------------------


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (ImportError without
    matplotlib: callers that plot after a long run catch it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, *, dpi: int = 120) -> Path:
    """Lay out, write and close ``fig`` (the folder is created)."""
    plt = pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def bar_plot(
    path: Path,
    labels: Sequence[str],
    series: Sequence[tuple[str, Sequence[float | None]]],
    *,
    ylabel: str,
    title: str,
    figsize: tuple[float, float],
    log: bool = True,
    label_fontsize: float = 7,
    legend_fontsize: float | None = None,
    dpi: int = 120,
) -> Path:
    """Grouped bars: one group per label, one bar per ``(name, values)`` series (None: no bar;
    a series without any value is left out)."""
    plt = pyplot()
    series = [(n, v) for n, v in series if any(x is not None for x in v)]
    fig, ax = plt.subplots(figsize=figsize)
    width = 0.8 / max(1, len(series))
    xs = range(len(labels))
    for i, (name, values) in enumerate(series):
        offset = (i - (len(series) - 1) / 2) * width
        heights = [float("nan") if v is None else v for v in values]
        ax.bar([x + offset for x in xs], heights, width, label=name)
    ax.set_xticks(list(xs), labels, fontsize=label_fontsize)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=legend_fontsize)
    return save_figure(fig, path, dpi=dpi)


# -- CUDA sources -------------------------------------------------------------------------------


def cuda_library(source_name: str) -> ctypes.CDLL | str:
    """The CUDA source ``source_name`` of this package (``gather_copy.cu``, ``reduce_add.cu``)
    built for sm_90a with nvcc (once per source text, in the temp folder), or why it cannot be."""
    nvcc = shutil.which("nvcc")
    if os.environ.get("CUDA_HOME"):
        nvcc = shutil.which(str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")) or nvcc
    if nvcc is None:
        return "no nvcc (set CUDA_HOME or PATH)"
    source = Path(__file__).with_name(source_name)
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    lib = Path(tempfile.gettempdir()) / f"dsa_bench_{source.stem}_{digest}.so"
    if not lib.exists():
        part = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static"]
        cmd += ["-gencode=arch=compute_90a,code=sm_90a", str(source), "-o", str(part)]
        built = subprocess.run(cmd, capture_output=True, text=True)
        if built.returncode:
            return f"nvcc failed: {built.stderr.strip()[-400:]}"
        part.replace(lib)
    return ctypes.CDLL(str(lib))
