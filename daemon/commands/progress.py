"""`skilltrain progress`: the loss curve of each run, one row per reported step.

    run  epoch step  sets  craft distance  change   tokens in  out  cost USD
    r7   0     0     4     0.4120          -        ...
    r7   0     1     4     0.3870          -0.0250  ...

The rows are the loss curve as it is on disk (daemon/service/curve.py), whether
the daemon runs or not.

Fast by construction: no litellm, no scan of the writer's folders; the
plotting libraries are imported for the chart only (plotext, terminal) and
for --plot only (matplotlib, Agg backend).
"""
from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from ..core.errors import ConfigError
from ..service.curve import StepRow, collect

PLOT_SUFFIXES = (".svg", ".png")


# ------------------------------------------------------------------ output


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


_COLUMNS = ("run", "epoch", "step", "sets", "craft distance", "change", "contradicted",
            "tokens in", "out", "cached", "cache write", "cost USD")


def render_table(rows: Sequence[StepRow], out: TextIO) -> None:
    """Plain aligned columns: a run of 500 steps prints in milliseconds (rich's
    table takes most of a second for that), and `grep`/`awk` read it as is."""
    cells = [(r.run, str(r.epoch), str(r.step), str(r.sets),
              _fmt(r.craft_distance, ".4f"), _fmt(r.craft_distance_change, "+.4f"),
              _fmt(r.claims_contradicted_share, ".0%"),
              f"{r.tokens_in:,}", f"{r.tokens_out:,}", f"{r.tokens_cached:,}",
              f"{r.tokens_cache_write:,}", _fmt(r.cost_usd, ".4f")) for r in rows]
    widths = [max(len(c[i]) for c in [_COLUMNS, *cells]) for i in range(len(_COLUMNS))]

    def line(values: Sequence[str]) -> str:
        first = values[0].ljust(widths[0])
        return "  ".join([first, *(v.rjust(w) for v, w in zip(values[1:], widths[1:],
                                                                strict=True))])

    out.write("\n".join([line(_COLUMNS), *map(line, cells)]) + "\n")


def _curves(rows: Sequence[StepRow]) -> Iterator[tuple[str, list[int], list[float]]]:
    """Per run: reported-step number (1, 2, ...) and craft distance, where known."""
    for run in sorted({r.run for r in rows}):
        own = [r for r in rows if r.run == run]
        points = [(i, r.craft_distance) for i, r in enumerate(own, 1)
                  if r.craft_distance is not None]
        if points:
            yield run, [p[0] for p in points], [p[1] for p in points]


def render_chart(rows: Sequence[StepRow], out: TextIO) -> None:
    """The curve in the terminal (plotext), one line per run."""
    curves = list(_curves(rows))
    if not curves:
        return
    import plotext

    fig = plotext.figure
    fig.clear()
    width = min(100, shutil.get_terminal_size((100, 24)).columns)
    fig.plot_size(width, 16)
    fig.theme("default" if out.isatty() else "colorless")  # colours tell the runs apart
    fig.title("craft distance per reported step (lower is closer to the human craft)")
    for run, xs, ys in curves:
        signal = fig.signal(xs, ys, marker="braille").lines()
        fig.draw(signal.label(run) if len(curves) > 1 else signal)  # a lone legend hides data
    fig.label("reported step", "x")
    # From 0 (the human craft) up: a lone point must not float in a range around itself.
    fig.ruler("y").lim(0, max(y for _, _, ys in curves for y in ys) * 1.1 or 1.0)
    text = str(fig.build())
    out.write((text if out.isatty() else plotext.uncolorize(text)).rstrip() + "\n")


def write_plot(rows: Sequence[StepRow], path: Path) -> None:
    """The curve as an SVG or PNG file (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for run, xs, ys in _curves(rows):
        # Dots for a few steps; for hundreds they would only thicken the line.
        ax.plot(xs, ys, marker="o" if len(xs) <= 60 else None, markersize=3, label=run)
    ax.set_xlabel("reported step")
    ax.set_ylabel("craft distance (0 = the human craft)")
    ax.set_title("skilltrain: craft distance per reported step")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.savefig(path, format=path.suffix[1:].lower())


def main(config_path: Path | None, run: str | None, as_json: bool, plot: Path | None,
         out: TextIO = sys.stdout) -> int:
    from ..core import config

    if plot is not None and plot.suffix.lower() not in PLOT_SUFFIXES:
        raise ConfigError(f"--plot {plot}: the file name must end in .svg or .png")
    if plot is not None:
        try:  # an extra (~170 MB with numpy and pillow): the daemon needs none of it
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--plot needs matplotlib, which is not installed: "
                              "pip install 'skilltrain[plot]'") from None
    cfg = config.load(config_path)
    rows = collect(cfg.paths.runs, run)
    if plot is not None:
        write_plot(rows, plot)
    if as_json:
        # One object per line: the C encoder (indent= would take the slow one).
        out.write("[\n" + ",\n".join(json.dumps(asdict(r)) for r in rows) + "\n]\n")
        return 0
    if not rows:
        where = f"run {run!r}" if run else str(cfg.paths.runs)
        out.write(f"no reported step yet in {where}\n")
        return 0
    render_table(rows, out)
    render_chart(rows, out)
    if plot is not None:
        out.write(f"wrote {plot}\n")
    return 0
