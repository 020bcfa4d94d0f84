"""Plots of what the meter and the collector recorded (matplotlib, inline; works on Colab)."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from .memory import MiB

__all__ = ["plot_timeline", "GENERATION_COLOURS"]

GENERATION_COLOURS = {0: "tab:green", 1: "tab:orange", 2: "tab:red"}


def _collection_positions(meter, collections):
    """Place each collection on the timeline's x axis (points are numbered 0, 1, ...)."""
    seconds = np.array([p.seconds for p in meter.timeline])
    starts = np.array([c.start - meter.started for c in collections])
    if seconds.size == 0:
        return np.zeros_like(starts)
    # a collection that started between point k-1 and point k is drawn at k - 0.5
    return np.searchsorted(seconds, starts) - 0.5


def plot_timeline(meter, collections=(), ax=None, title=None, xlabel="iteration"):
    """Memory held (MiB) at each recorded point, with the budget, the OOM and collections.

    `collections` is a list of `gclab.gcwatch.Collection` (for example `watch.collections`).
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.5))
    mib = [p.allocated / MiB for p in meter.timeline]
    ax.plot(range(len(mib)), mib, color="tab:blue", lw=1.5, label="live tensor memory")
    if meter.budget:
        kind = "simulated budget" if meter.simulated else "device budget"
        ax.axhline(meter.budget / MiB, color="black", ls="--", lw=1, label=kind)
    drawn = set()
    for x, c in zip(_collection_positions(meter, collections), collections):
        gen = min(c.generation, 2)
        label = None if gen in drawn else f"gen {gen} collection"
        drawn.add(gen)
        ax.axvline(x, color=GENERATION_COLOURS[gen], lw=0.8, alpha=0.7, label=label)
    oom = [i for i, p in enumerate(meter.timeline) if p.label == "OOM"]
    if oom:
        ax.plot(oom, [mib[i] for i in oom], "x", color="red", ms=12, mew=3, label="out of memory")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MiB held by tensors")
    top = max(mib + [meter.budget / MiB if meter.budget else 0, 1e-3])
    ax.set_ylim(-0.03 * top, 1.08 * top)   # a line flat at zero stays visible above the axis
    ax.set_title(title or f"Tensor memory on {meter.device}")
    ax.legend(loc="upper left", fontsize="small")
    return ax
