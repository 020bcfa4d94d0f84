"""Plots of what the meter and the collector recorded (matplotlib, inline; works on Colab)."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from .memory import MiB

__all__ = ["plot_timeline", "held_after_collections", "plot_ratchet", "plot_floors", "panel_below", "plot_latency",
           "plot_allocated_reserved",
           "plot_latency_spread", "plot_requests", "plot_held_by_run", "plot_counts", "mark_collections", "plot_collector_counts", "plot_durations",
           "plot_panels", "plot_paired_bars", "plot_readings",
           "plot_time_and_peak", "GENERATION_COLOURS"]

GENERATION_COLOURS = {0: "tab:green", 1: "tab:orange", 2: "tab:red"}


def _collection_positions(meter, collections):
    """Place each collection on the timeline's x axis (points are numbered 0, 1, ...)."""
    seconds = np.array([p.seconds for p in meter.timeline])
    starts = np.array([c.start - meter.started for c in collections])
    if seconds.size == 0:
        return np.zeros_like(starts)
    # a collection that started between point k-1 and point k is drawn at k - 0.5
    return np.searchsorted(seconds, starts) - 0.5


def plot_timeline(meter, collections=(), ax=None, title=None, xlabel="iteration", faint=()):
    """Memory held (MiB) at each recorded point, with the budget, the OOM and collections.

    `collections` is a list of `gclab.gcwatch.Collection` (for example `watch.collections`);
    collections of the generations in `faint` are drawn thin and pale (many of them).  The
    out-of-memory cross sits at the budget, where the allocation that failed would have
    taken memory; the point recorded after the error shows what was held by then.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.5))
    mib = [_held_mib(meter, p.allocated) for p in meter.timeline]
    ax.plot(range(len(mib)), mib, color="tab:blue", lw=1.5, label="live tensor memory")
    if meter.budget:
        kind = "simulated budget" if meter.simulated else "device budget"
        ax.axhline(meter.budget / MiB, color="black", ls="--", lw=1, label=kind)
    drawn = set()
    for x, c in sorted(zip(_collection_positions(meter, collections), collections),
                       key=lambda xc: min(xc[1].generation, 2)):
        gen = min(c.generation, 2)
        label = None if gen in drawn else f"gen {gen} collection"
        drawn.add(gen)
        if gen in faint:
            ax.axvline(x, color=GENERATION_COLOURS[gen], lw=0.5, alpha=0.25, label=label)
        else:
            ax.axvline(x, color=GENERATION_COLOURS[gen], lw=1.2 if faint else 0.8, alpha=0.8, label=label)
    oom = [i for i, p in enumerate(meter.timeline) if p.label == "OOM"]
    if oom:
        at = [max(mib[i], meter.budget / MiB) if meter.budget else mib[i] for i in oom]
        ax.plot(oom, at, "x", color="red", ms=12, mew=3, label="out of memory")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MiB held by tensors")
    top = max(mib + [meter.budget / MiB if meter.budget else 0, 1e-3])
    ax.set_ylim(-0.03 * top, 1.08 * top)   # a line flat at zero stays visible above the axis
    ax.set_title(title or f"Tensor memory on {meter.device}")
    ax.legend(loc="upper left", fontsize="small")
    return ax


def _held_mib(meter, allocated: int) -> float:
    """MiB held above the meter's start: on CUDA `allocated` is the whole device's count (the data and
    models of earlier cells too), while a budget is counted from the meter's start, as on the CPU."""
    return (allocated - meter.baseline) / MiB


def held_after_collections(meter, collections):
    """For each collection, `(x, bytes, generation)`: where it sits on the timeline's x axis
    and the memory recorded at the first point after it (the floor it left).  A collection
    after the last recorded point is left out."""
    timeline = meter.timeline
    held = []
    for x, c in zip(_collection_positions(meter, collections), collections):
        after = int(x + 0.5)
        if 0 <= after < len(timeline):
            held.append((float(x), timeline[after].allocated, c.generation))
    return held


def panel_below(ax, height_ratios=(2, 1)):
    """An Axes under `ax`, in the slot `ax` had in its figure, sharing its x axis; made on
    the first call and cleared and reused on later ones (so a figure that is redrawn, as
    `gclab.widgets.Explorer` redraws, keeps two panels)."""
    below = getattr(ax, "_gclab_panel_below", None)
    if below is not None and below.figure is ax.figure and below in ax.figure.axes:
        below.clear()
        return below
    spec = ax.get_subplotspec()
    if spec is None:
        raise ValueError("panel_below needs an Axes placed in a grid (plt.subplots, add_subplot)")
    grid = spec.subgridspec(2, 1, height_ratios=height_ratios, hspace=0.08)
    ax.set_subplotspec(grid[0])
    below = ax.figure.add_subplot(grid[1], sharex=ax)
    ax._gclab_panel_below = below
    return below


def plot_ratchet(meter, collections=(), ax=None, title=None, xlabel="iteration"):
    """The timeline (`plot_timeline`) above, and below it the memory held just after each
    collection, a dot per collection coloured by generation, with a line through those left
    by collections of generation 1 and older: where garbage that survived into an older
    generation waits, that line climbs.  Returns (timeline Axes, floor Axes)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 5.5))
    below = panel_below(ax)
    plot_timeline(meter, collections, ax=ax, title=title, xlabel="", faint=(0,))
    ax.tick_params(labelbottom=False)
    held = held_after_collections(meter, collections)
    for gen in sorted({min(g, 2) for _, _, g in held}):
        xs = [x for x, _, g in held if min(g, 2) == gen]
        ys = [_held_mib(meter, b) for _, b, g in held if min(g, 2) == gen]
        below.plot(xs, ys, "o", ms=3 if gen == 0 else 6, color=GENERATION_COLOURS[gen],
                   label=f"after a gen {gen} collection", zorder=3 if gen else 2)
    older = [(x, _held_mib(meter, b)) for x, b, g in held if g >= 1]
    if older:
        xs, ys = zip(*older)
        last = len(meter.timeline) - 1
        below.step([0.0, *xs, max(last, xs[-1])], [0.0, *ys, ys[-1]], where="post", color="black", lw=1,
                   label="floor left by gen 1+ collections")
    below.set_xlabel(xlabel)
    below.set_ylabel("MiB held\nafter a collection")
    top = max([y for _, y in older] + [_held_mib(meter, b) for _, b, _ in held] + [1e-3])
    below.set_ylim(-0.05 * top, 1.15 * top)
    if held:
        below.legend(loc="upper left", fontsize="x-small", ncol=3)
    return ax, below


def plot_floors(runs, ax=None, title="Memory held just after each generation-1 or older collection",
                xlabel="iteration"):
    """Several runs' floors side by side: for each, the memory held just after each
    collection of generation 1 or older, as a step line, with full collections ringed.

    `runs` maps a label to `(meter, collections)`."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.2))
    full_drawn = False
    for label, (meter, collections) in runs.items():
        older = [(x, _held_mib(meter, b), g) for x, b, g in held_after_collections(meter, collections) if g >= 1]
        last = max(len(meter.timeline) - 1, 0)
        xs = [0.0] + [x for x, _, _ in older] + [last]
        ys = [0.0] + [y for _, y, _ in older]
        line, = ax.step(xs, ys + ys[-1:], where="post", lw=1.5, label=label)
        ax.plot([x for x, _, _ in older], [y for _, y, _ in older], "o", ms=4, color=line.get_color())
        full = [(x, y) for x, y, g in older if g >= 2]
        if full:
            ax.plot(*zip(*full), "o", ms=11, mfc="none", mec=GENERATION_COLOURS[2], mew=2,
                    label=None if full_drawn else "full collection")
            full_drawn = True
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MiB held")
    ax.set_ylim(bottom=-0.05 * max(ax.get_ylim()[1], 1e-3))
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize="small")
    return ax


# -- serving: latency per policy, and requests on a timeline ----------------------------
def plot_latency(runs, ax=None, budget_ms=None, title="Request latency (from the scheduled send time)"):
    """P50, P95, P99 and the maximum of each run, side by side.

    `runs` maps a name (a policy) to a `gclab.serving.LoadResult`.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.5))
    points = (50, 95, 99, 100)
    width = 0.8 / max(1, len(runs))
    for k, (name, load) in enumerate(runs.items()):
        values = [load.percentiles(points)[p] for p in points]
        bars = ax.bar(np.arange(len(points)) + (k - (len(runs) - 1) / 2) * width, values, width, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize="x-small", padding=1)
    if budget_ms is not None:
        ax.axhline(budget_ms, color="black", ls="--", lw=1, label="P99 budget")
    ax.set_xticks(range(len(points)), ["P50", "P95", "P99", "max"])
    ax.set_ylabel("latency (ms)")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return ax


def plot_latency_spread(runs, ax=None, points=(50, 99), title="Latency over repeated runs: median, and the range"):
    """P50 and P99 of each configuration over repeated runs: a bar at the median, a line from the
    lowest to the highest run, and each run as a dot.

    `runs` maps a name to a list of `gclab.serving.ServedRun` (as `gclab.serving.compare` returns).
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.5))
    width = 0.8 / max(1, len(runs))
    for k, (name, seen) in enumerate(runs.items()):
        x = np.arange(len(points)) + (k - (len(runs) - 1) / 2) * width
        values = np.array([[run.load.percentiles(points)[p] for p in points] for run in seen])
        median = np.median(values, axis=0)
        bars = ax.bar(x, median, width, label=name, alpha=0.85)
        colour = bars.patches[0].get_facecolor()
        ax.vlines(x, values.min(axis=0), values.max(axis=0), color="black", lw=1)
        for row in values:
            ax.plot(x, row, ".", color="black", ms=3)
        ax.bar_label(bars, labels=[f"{m:.0f}" for m in median], fontsize="x-small", padding=1, color=colour)
    ax.set_xticks(range(len(points)), [f"P{p}" if p < 100 else "max" for p in points])
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return ax


def _lanes(intervals):
    """Give each (start, end) interval the lowest lane free at its start, so overlaps stack."""
    lane_ends, lanes = [], []
    for start, end in intervals:
        for lane, free_at in enumerate(lane_ends):
            if free_at <= start:
                lane_ends[lane] = end
                lanes.append(lane)
                break
        else:
            lane_ends.append(end)
            lanes.append(len(lane_ends) - 1)
    return lanes


def plot_requests(trace, load=None, ax=None, window=None, title="Requests and collections"):
    """Each request as a bar from when it was due to be sent to when the server finished it
    (the waiting part pale), stacked so that requests in flight together sit one above the
    other; each collection as a band across all of them, coloured by generation.

    `trace` is a `gclab.serving.Trace`; `load` (its `LoadResult`) adds the waiting part;
    `window` = (start, end) in seconds from the first request limits the view.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.5))
    if not trace.requests:
        ax.set_title(title + " (no requests)")
        return ax
    due = dict(enumerate(load.scheduled)) if load is not None else {}     # request i was due at scheduled[i]
    rows = sorted((due.get(rid, start), start, end) for rid, start, end in trace.requests)
    origin = rows[0][0]
    lo, hi = window if window else (0.0, max(end for _, _, end in rows) - origin)
    shown = [(d - origin, s - origin, e - origin) for d, s, e in rows if e - origin >= lo and d - origin <= hi]
    lanes = _lanes([(d, e) for d, _, e in shown])
    for (d, s, e), lane in zip(shown, lanes):
        if s > d:
            ax.plot([d * 1e3, s * 1e3], [lane, lane], color="tab:blue", alpha=0.3, lw=3, solid_capstyle="butt")
        ax.plot([s * 1e3, e * 1e3], [lane, lane], color="tab:blue", lw=3, solid_capstyle="butt")
    drawn = set()
    for c in trace.collections:
        start = c.start - origin
        if start + c.duration < lo or start > hi:
            continue
        gen = min(c.generation, 2)
        ax.axvspan(start * 1e3, (start + max(c.duration, 2e-4)) * 1e3, color=GENERATION_COLOURS[gen],
                   alpha=0.35, label=None if gen in drawn else f"gen {gen} collection")
        drawn.add(gen)
    ax.set_xlim(lo * 1e3, hi * 1e3)
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("requests in flight")
    ax.yaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.set_title(title)
    if drawn:
        ax.legend(loc="upper right", fontsize="small")
    return ax


def plot_allocated_reserved(run, ax=None, title=None, max_ticks=14):
    """A recorded run (`gclab.traces.RecordedRun`): allocated memory (live tensors) and reserved
    memory (the caching allocator's segments) at each mark, MiB above the start; the marks' labels
    on the x axis when there are few of them."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.6))
    xs = range(len(run.labels))
    ax.step(xs, [r / MiB for r in run.reserved], where="post", lw=5, alpha=0.35, color="tab:orange",
            label="reserved: what the allocator holds")
    ax.step(xs, [a / MiB for a in run.allocated], where="post", lw=1.8, color="tab:blue",
            label="allocated: live tensors")
    if len(run.labels) <= max_ticks:
        ax.set_xticks(list(xs), run.labels, rotation=35, ha="right")
    else:
        ax.set_xlabel("mark")
    ax.set_ylabel("MiB above the start")
    ax.set_title(title or run.name)
    ax.legend(loc="upper right", fontsize="small")
    return ax


# -- several runs side by side ------------------------------------------------------------
def plot_held_by_run(runs, ax=None, title="Memory held after each step", xlabel="step",
                     ylabel="MiB held after it", xticks=None, budget=None, styles=None, simulated=None):
    """Memory held (MiB above each meter's baseline) at each recorded point, one line per run.

    `runs` maps a label to a `gclab.memory.Meter`.  A run whose last point is labelled "OOM"
    (it ran out of memory there) ends in an x.  `xticks`: labels of the points (the same for
    every run); `budget`: bytes, drawn as a dashed line ("simulated budget" when `simulated`).
    Returns the axes and each run's line colour (label -> colour).
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.2))
    colours = {}
    for k, (label, meter) in enumerate(runs.items()):
        mib = [(p.allocated - meter.baseline) / MiB for p in meter.timeline]
        style = styles[k % len(styles)] if styles else "-"
        line, = ax.plot(range(len(mib)), mib, style, label=label)
        colours[label] = line.get_color()
        if meter.timeline and meter.timeline[-1].label == "OOM":
            ax.plot(len(mib) - 1, mib[-1], "x", color=line.get_color(), ms=12, mew=3)
    if budget is not None:
        ax.axhline(budget / MiB, color="black", ls="--", lw=1,
                   label="simulated budget" if simulated else "device budget")
    if xticks is not None:
        ax.set_xticks(range(len(xticks)), xticks)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    return ax, colours


def plot_counts(counts, ax=None, title="Count so far", xlabel="step", ylabel="so far"):
    """A running count per run (label -> list of the count after each step), one line per run, in the
    colours `plot_held_by_run` gives the same runs in the same order."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.2))
    for label, values in counts.items():
        ax.plot(range(len(values)), values, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    return ax


# -- the collector's counts, and what collections cost ---------------------------------------
def mark_collections(axes, xs, collections, label_on=None):
    """A vertical line at each x of `xs` for the collection beside it (`gclab.gcwatch.Collection`),
    coloured by generation; each generation is named once in the legend of `label_on` (default:
    the first of `axes`)."""
    axes = list(axes) if isinstance(axes, (list, tuple)) else [axes]
    label_on = axes[0] if label_on is None else label_on
    named = set()
    for x, c in zip(xs, collections):
        gen = min(c.generation, 2)
        for ax in axes:
            ax.axvline(x, color=GENERATION_COLOURS[gen], lw=0.8, alpha=0.8,
                       label=f"gen {gen} collection" if ax is label_on and gen not in named else None)
        named.add(gen)


def plot_collector_counts(counts, when, collections, thresholds, title=None, xlabel="containers created"):
    """`gc.get_count()` read after each new object: generation 0's count above (with the first
    threshold), generations 1 and 2 below (with the second), and a line at each collection.

    `counts`: (generation 0, 1, 2) lists, one value per object; `when`: perf_counter() at each
    reading, which places each collection of `collections` (their .start) among them.
    """
    g0, g1, g2 = counts
    at = np.searchsorted(when, [c.start for c in collections])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 4.8), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    top.plot(g0, color="tab:blue", lw=1, label="generation 0 count")
    top.axhline(thresholds[0], color="black", ls="--", lw=1, label=f"first threshold ({thresholds[0]})")
    bottom.step(range(len(g1)), g1, where="post", color="tab:purple", label="generation 1 count")
    bottom.step(range(len(g2)), g2, where="post", color="tab:brown", label="generation 2 count")
    bottom.axhline(thresholds[1], color="black", ls=":", lw=1, label=f"second threshold ({thresholds[1]})")
    mark_collections((top, bottom), at, collections)
    top.set_ylabel("objects")
    top.set_title(title)
    bottom.set_xlabel(xlabel)
    bottom.set_ylabel("collections")
    top.legend(loc="upper right", fontsize="small")
    bottom.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    return fig


def plot_durations(durations_us, ax=None, title=None, colours=None, log=True):
    """One bar per label (label -> microseconds), each marked with its value; a log scale by default,
    for durations that differ by orders of magnitude."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3))
    values = list(durations_us.values())
    bars = ax.bar(list(durations_us), values, color=colours)
    ax.bar_label(bars, labels=[f"{us:,.0f} µs" if us >= 100 else f"{us:.1f} µs" for us in values])
    if log:
        ax.set_yscale("log")
        ax.set_ylim(top=max(values) * 8)
    ax.set_ylabel("µs" + (" (log scale)" if log else ""))
    ax.set_title(title)
    return ax


# -- comparing several habits or fixes ---------------------------------------------------------
def plot_panels(series, last_label=None, xlabel="step", ylabel=None, title=None, colour="tab:red"):
    """One small panel per name (name -> values), each with its own scale, side by side.  With
    `last_label`, each series' last value is drawn apart, as a dot of that name (for example the
    reading after a final gc.collect())."""
    fig, axes = plt.subplots(1, len(series), figsize=(3 * len(series), 3.2), squeeze=False)
    axes = axes[0]
    for ax, (name, values) in zip(axes, series.items()):
        line = values[:-1] if last_label else values
        ax.plot(range(len(line)), line, color=colour, lw=1.5)
        if last_label:
            ax.plot([len(line)], values[-1:], "o", color="black", label=last_label)
        ax.set_title(name, fontsize="medium")
        ax.set_xlabel(xlabel)
        ax.set_ylim(bottom=0, top=max(max(values), 1e-9) * 1.1)
    axes[0].set_ylabel(ylabel)
    if last_label:
        axes[0].legend(loc="upper left", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_paired_bars(names, first, second, ax=None, ylabel=None, title=None, log=True, annotate_second=None):
    """Two bars per name, side by side: `first` and `second` are (legend label, values in the order of
    `names`, colour).  `annotate_second` (a function of a value) writes each second value under its bar,
    for values too small to see on a log scale."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.6))
    xs = np.arange(len(names))
    for shift, (label, values, colour) in ((-0.2, first), (0.2, second)):
        ax.bar(xs + shift, list(values), width=0.4, color=colour, label=label)
    if annotate_second is not None:
        for x, value in zip(xs, second[1]):
            ax.text(x + 0.2, 1.5, annotate_second(value), ha="center", va="bottom", fontsize="small")
    if log:
        ax.set_yscale("log")
        if annotate_second is not None:
            ax.set_ylim(bottom=1)
    ax.set_xticks(list(xs), [n.replace("(", "(\n", 1) for n in names], fontsize="small")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize="small")
    return ax


def plot_readings(labels, lines, ax=None, ylabel="MiB", title=None, legend="upper right"):
    """Readings taken after each statement, as steps (a reading holds until the next statement
    changes it), labelled by the statement.  `lines` maps a legend label to (bytes at each
    reading, matplotlib keyword arguments for its line, or None)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.6))
    top = 0.0
    for label, (values, style) in lines.items():
        mib = [v / MiB for v in values]
        top = max(top, *mib)
        ax.step(range(len(mib)), mib, where="post", label=label, **({"lw": 1.8} | (style or {})))
    ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right")
    ax.set_ylim(-0.1, top + 0.4)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc=legend, fontsize="small")
    return ax


def plot_time_and_peak(runs, budget=None, time_title="time", peak_title="peak tensor memory"):
    """Two bar charts side by side, one bar per run: milliseconds per step, and peak memory (MiB)
    against the budget, "OOM" written on the runs that ran out of memory.  `runs` maps a label
    to (ms per step, peak bytes, whether it ran out of memory)."""
    fig, (ax_time, ax_peak) = plt.subplots(1, 2, figsize=(10, 3.2))
    labels = list(runs)
    ax_time.bar(labels, [ms for ms, _, _ in runs.values()], color="tab:blue")
    ax_time.set_ylabel("ms per step")
    ax_time.set_title(time_title)
    peaks = [peak / MiB for _, peak, _ in runs.values()]
    ax_peak.bar(labels, peaks, color="tab:orange")
    if budget is not None:
        ax_peak.axhline(budget / MiB, color="black", ls="--", lw=1, label="budget")
        ax_peak.legend(loc="upper right")
    for x, (peak, (_, _, oom)) in enumerate(zip(peaks, runs.values())):
        if oom:
            ax_peak.text(x, peak / 2, "OOM", ha="center", color="white", weight="bold")
    ax_peak.set_ylabel("peak MiB")
    ax_peak.set_title(peak_title)
    fig.tight_layout()
    return fig
