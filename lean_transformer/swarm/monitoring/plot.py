"""Draws the swarm's progress (training and validation loss, samples/s, alive peers over time) into a PNG file that is
replaced atomically."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from lean_transformer.swarm.monitoring.aggregation import SwarmStats
from lean_transformer.swarm.monitoring.evaluation import Evaluation


def redraw_plot(rows: Sequence[SwarmStats], path: os.PathLike, title: str = "",
                evaluations: Sequence[Evaluation] = ()) -> Optional[Figure]:
    """Draw ``rows`` (and the checkpoints' validation losses, on the loss panel) into ``path`` and return the
    figure; a reader (or a crash) never sees a half-written image. Nothing is drawn without rows.

    Uses a standalone ``Figure`` (not pyplot), so nothing is kept in a global figure registry between redraws.
    """
    if not rows:
        return None
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
        ax.plot(minutes, values, color=color, marker="." if len(rows) < 50 else None, label=f"training {label}")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if evaluations:
        axes[0].plot([(evaluation.time - start_time) / 60 for evaluation in evaluations],
                     [evaluation.validation_loss for evaluation in evaluations], color="tab:red", marker="o",
                     label="validation loss (checkpoints)")
        axes[0].legend(loc="upper right")
    axes[-1].yaxis.set_major_locator(MaxNLocator(integer=True))  # peers are counted in whole numbers
    axes[-1].set_xlabel("minutes since the first logged epoch")
    last = rows[-1]
    figure.suptitle(f"{title}  epoch {last.epoch}, {last.alive_peers} peers".strip())

    temporary = path.with_name(f".{path.name}.tmp")
    figure.savefig(temporary, format="png", dpi=80)
    os.replace(temporary, path)
    return figure
