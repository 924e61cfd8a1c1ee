"""Loss curves from trainer_log.jsonl, drawn with matplotlib (no display needed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tiletune.train.callbacks import LOG_NAME


def smooth(values: list[float]) -> list[float]:
    """Exponential moving average, bias-corrected; the fewer the points, the lighter the smoothing."""
    weight = 0.9 * (1 - math.exp(-len(values) / 40))
    out, average = [], 0.0
    for count, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**count))
    return out


def plot_loss(output_dir: str | Path) -> list[Path]:
    """Write training_loss.png (and eval_loss.png when evaluated) into `output_dir`; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    records = [json.loads(line) for line in (output_dir / LOG_NAME).read_text().splitlines() if line.strip()]
    written = []
    for key in ("loss", "eval_loss"):
        points = [(r["step"], r[key]) for r in records if key in r]
        if not points:
            continue
        steps, values = zip(*points)
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
        ax.plot(steps, values, color="#1f77b4", alpha=0.35, label="original")
        if len(values) > 2:
            ax.plot(steps, smooth(list(values)), color="#1f77b4", label="smoothed")
        if min(values) > 0 and max(values) / min(values) > 100:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(f"{key} of {output_dir.name}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = output_dir / ("training_loss.png" if key == "loss" else "eval_loss.png")
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
