"""Draws the swarm's progress (loss, samples/s, alive peers over time) into a PNG file that is replaced atomically."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from lean_transformer.swarm.aggregation import SwarmStats


def redraw_plot(rows: Sequence[SwarmStats], path: os.PathLike, title: str = "") -> None:
    """Draw ``rows`` into ``path``; a reader (or a crash) never sees a half-written image.

    Uses a standalone ``Figure`` (not pyplot), so nothing is kept in a global figure registry between redraws.
    """
    if not rows:
        return
    path = Path(path)
    start_time = rows[0].time
    minutes = [(row.time - start_time) / 60 for row in rows]
    series = (
        ("loss", [row.loss for row in rows], "tab:blue"),
        ("samples / s", [row.samples_per_second for row in rows], "tab:green"),
        ("alive peers", [row.alive_peers for row in rows], "tab:orange"),
    )

    figure = Figure(figsize=(8, 7), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(series), 1, sharex=True)
    for ax, (label, values, color) in zip(axes, series):
        ax.plot(minutes, values, color=color, marker="." if len(rows) < 50 else None)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].yaxis.set_major_locator(MaxNLocator(integer=True))  # peers are counted in whole numbers
    axes[-1].set_xlabel("minutes since the first logged epoch")
    last = rows[-1]
    figure.suptitle(f"{title}  epoch {last.epoch}, {last.alive_peers} peers".strip())

    temporary = path.with_name(f".{path.name}.tmp")
    figure.savefig(temporary, format="png", dpi=80)
    os.replace(temporary, path)
