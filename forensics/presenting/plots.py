"""The report's figures: one function per figure, data in, matplotlib `Figure` out.

Figures are built with the object-oriented API (`Figure(...)`, never pyplot), so importing or
using this module changes no global state: the caller's matplotlib backend and pyplot's list of
open figures are left alone, and a figure is freed when it is no longer referenced. Nothing here
reads a trace or decides anything; `report` gathers the frames and the marks.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib
import numpy as np
import polars as pl
from matplotlib.axes import Axes
from matplotlib.colorbar import Colorbar
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.patches import Rectangle

MAX_LABEL = 26  # characters of a component name on an axis before it is shortened
MAX_ROWS_LABELLED = 60  # more component rows than this and labels would overlap at 8 pt
STEP_COLUMNS = 2000  # a line over steps is cut to at most twice this many points (`_envelope`)
# A component x step map draws at most this many step columns (bins of steps): fewer than its axes
# have pixels across at the report's size and dpi (~900-1,000), so the image is never shrunk and
# no column dropped (a shrunk image drops whole columns, and a one-step episode with them; each
# column takes a pixel or more).
MAP_COLUMNS = 800
Z_CAP = 12.0  # |z| colour scale saturates here; beyond it every cell looks equally alarming
Z_LEVELS = (0.0, 3.0, 4.0, 6.0, 8.0, Z_CAP, 2 * Z_CAP)  # heatmap colour bins of |z|; the last is ">= Z_CAP"
# The heatmap's colours, one per level of Z_LEVELS. Under 3, ordinary noise, both are the same
# pale colour, so departures stand out. A cell in an alarm's episode is warm, up to near black; a
# departure no alarm counted is blue, and never as dark: the eye goes to what the rules counted.
ALARM_COLOURS = ("#fbfbf4", "#fee391", "#fe9929", "#d95f0e", "#993404", "#3d1502")
SET_ASIDE_COLOURS = ("#fbfbf4", "#dbe9f6", "#bad6eb", "#89bedc", "#539ecd", "#2b7bba")
DPI = 110  # the report's figures are rendered at this many pixels per inch (`png_bytes`)

# One colour per mark kind, used on every figure so the legend reads the same everywhere.
MARK_STYLE: dict[str, tuple[str, str]] = {
    "injected": ("#7f7f7f", ":"),
    "onset": ("#ff7f0e", "--"),
    "first alarm": ("#ff9896", "-"),
    "alarm": ("#d62728", "-"),
    "loss-spike rule": ("#9467bd", "-."),
    "grad-norm rule": ("#8c564b", "-."),
    "static rules": ("#e377c2", "-."),
    "rollback (ours)": ("#2ca02c", "-"),
    "rollback (loss-only)": ("#bcbd22", "-"),
    "rollback (ours and loss-only)": ("#2ca02c", "-"),
}
SAME_ROLLBACK = "rollback (ours and loss-only)"  # both rollbacks resume from the same checkpoint


@dataclass(frozen=True)
class Mark:
    """A vertical line at a step, drawn on the step-axis figures."""

    label: str  # a key of MARK_STYLE
    step: int


def short_name(name: str, width: int = MAX_LABEL) -> str:
    """A component name that fits an axis: keep the tail, which is the most specific part."""
    if name == "":
        return "(root)"
    return name if len(name) <= width else "…" + name[-(width - 1):]


def row_labels(order: Sequence[str], kinds: dict[str, str] | None = None) -> list[str]:
    """Axis labels for components: the shortened name and, if known, the module class."""
    kinds = kinds or {}
    return [f"{short_name(c)}  {kinds[c]}" if kinds.get(c) else short_name(c) for c in order]


def _set_rows(ax: Axes, order: Sequence[str], kinds: dict[str, str] | None) -> None:
    """Label the component rows; past MAX_ROWS_LABELLED, label every k-th so names stay legible."""
    every = max(1, -(-len(order) // MAX_ROWS_LABELLED))  # ceil
    rows = range(0, len(order), every)
    labels = row_labels(order, kinds)
    ax.set_yticks(list(rows), [labels[i] for i in rows], fontsize=8)
    ax.set_ylabel("component (forward order)" + (f", 1 in {every} labelled" if every > 1 else ""))


def _draw_marks(ax: Axes, marks: Sequence[Mark]) -> None:
    for m in marks:
        colour, style = MARK_STYLE.get(m.label, ("black", "-"))
        ax.axvline(m.step, color=colour, linestyle=style, linewidth=1.4, label=f"{m.label} @ {m.step}")


def heatmap(scores: pl.DataFrame, order: Sequence[str], marks: Sequence[Mark] = (),
            kinds: dict[str, str] | None = None,
            title: str = "Component health: worst |robust z| of any metric against the component's own baseline",
            colour_label: str = "worst |robust z| over the metrics", step_width: int = 1,
            episodes: pl.DataFrame | None = None) -> Figure:
    """Component × step image of `scores` (columns component, step, score), rows in `order`.

    `episodes` (columns observed_on, onset_step, last_step: the alarms): a cell inside one of its
    component's episodes is drawn in the alarm colours, every other cell in the set-aside ones (a
    departure no alarm counted: a rule needs more than |z|, or no rule reads the metric), each
    with its colour bar. None: every cell is set aside.
    `step_width` > 1: each `step` is the first of a bin of that many steps (one image column).
    Where the axes have fewer pixels across than there are columns (at `DPI`, once laid out: long
    component labels narrow them), a column is the worst of as many neighbouring ones as it
    takes (`_pooled`): an image shrunk to fit drops whole columns, and a one-bin departure
    with them. Where none is pooled the figure comes laid out for `DPI`, its layout engine set
    aside: a caller that adds to it lays it out again (`fig.set_layout_engine("constrained")`).
    """
    first = int(scores["step"].min())
    steps = np.arange(first, int(scores["step"].max()) + step_width, step_width)
    index = {c: i for i, c in enumerate(order)}
    grid = np.full((len(order), len(steps)), np.nan)
    rows = scores.filter(pl.col("component").is_in(list(order)))
    r = rows["component"].replace_strict(index, return_dtype=pl.Int64).to_numpy()
    s = (rows["step"].to_numpy() - first) // step_width
    grid[r, s] = np.clip(np.abs(rows["score"].fill_null(np.nan).to_numpy()), 0, Z_CAP + 1)
    alarmed = _in_episodes(episodes, index, first, len(steps), step_width)
    height = min(14.0, 2.2 + 0.28 * len(order))
    fig = Figure(figsize=(11, height), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    extent = (steps[0] - 0.5, steps[-1] + step_width - 0.5, len(order) - 0.5, -0.5)
    # the set-aside cells beneath (their "bad" colour, grey, is also the warm-up's), the alarmed
    # ones over them (transparent where none)
    layers = [(np.where(alarmed, np.nan, grid), SET_ASIDE_COLOURS, "#dddddd"),
              (np.where(alarmed, grid, np.nan), ALARM_COLOURS, (0, 0, 0, 0))]
    images = [ax.imshow(g, aspect="auto", interpolation="nearest", extent=extent,
                        cmap=ListedColormap(colours).with_extremes(bad=bad), norm=BoundaryNorm(Z_LEVELS, len(colours)))
              for g, colours, bad in layers]
    _set_rows(ax, order, kinds)
    ax.set_xlabel("optimizer step")
    ax.set_title(title)
    _draw_marks(ax, marks)
    if marks:
        ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    binned = "" if step_width == 1 else f"\n(bins of {step_width} steps, each against its first step's baseline)"
    _z_bar(fig, ax, images[0], "no alarm: departures\nthe rules set aside")
    alarm = _z_bar(fig, ax, images[1], f"in an alarm's episode:\n{colour_label}{binned}")  # the later, the nearer
    if len(steps) > 1:
        fig.get_layout_engine().execute(fig)  # where the axes fall, to count their pixels
        columns = int(ax.get_window_extent().width)
        k = _pooled(grid, columns)[1]
        if k == 1:  # laid out at `DPI` as it is drawn: `png_bytes` need not lay it out again
            fig.set_layout_engine(None)
            return fig
        for im, (g, _, _) in zip(images, layers, strict=True):
            pooled = _pooled(g, columns)[0]
            im.set_data(pooled)
            im.set_extent((steps[0] - 0.5, steps[0] + pooled.shape[1] * k * step_width - 0.5, len(order) - 0.5, -0.5))
        ax.set_xlim(steps[0] - 0.5, steps[-1] + step_width - 0.5)
        label = (f"{colour_label}\n(a column: the worst of {k} steps)" if step_width == 1 else
                 f"{colour_label}\n(a column: the worst of {k} bins of {step_width} steps, each against its "
                 "first step's baseline)")
        alarm.set_label(f"in an alarm's episode:\n{label}", fontsize=9)  # laid out again when drawn
    return fig


def _z_bar(fig: Figure, ax: Axes, im: AxesImage, label: str) -> Colorbar:
    """A colour bar of the |z| levels, each labelled at its middle with its range ("≥ Z_CAP" the last)."""
    middles = [(a + b) / 2 for a, b in zip(Z_LEVELS, Z_LEVELS[1:], strict=False)]
    bar = fig.colorbar(im, ax=ax, shrink=0.9, pad=0.01, ticks=middles)
    bar.ax.set_yticklabels([f"< {Z_LEVELS[1]:g}"] + [f"{a:g}–{b:g}" for a, b in zip(Z_LEVELS[1:-2], Z_LEVELS[2:-1],
                                                                                    strict=True)]
                           + [f"≥ {Z_CAP:g}"])
    bar.ax.tick_params(length=0)
    bar.set_label(label, fontsize=9)
    return bar


def _in_episodes(episodes: pl.DataFrame | None, index: dict[str, int], first: int, columns: int,
                 step_width: int) -> np.ndarray:
    """Rows × columns: whether a cell (a bin of `step_width` steps from `first`) holds a step of
    one of its component's episodes (onset to last alarming step)."""
    inside = np.zeros((len(index), columns), dtype=np.bool_)
    if episodes is None:
        return inside
    for name, onset, last in episodes.select("observed_on", "onset_step", "last_step").iter_rows():
        if name in index and onset is not None:
            a = max(0, (int(onset) - first) // step_width)
            b = min(columns - 1, (int(last if last is not None else onset) - first) // step_width)
            inside[index[name], a:b + 1] = True
    return inside


def _pooled(grid: np.ndarray, columns: int) -> tuple[np.ndarray, int]:
    """(`grid` with each k neighbouring columns made one, the largest of them (NaN: none has a
    value), k): the least k that leaves at most `columns`; k = 1, `grid` itself, if it has no more."""
    k = -(-grid.shape[1] // max(columns, 1))
    if k <= 1:
        return grid, 1
    padded = np.concatenate([grid, np.full((grid.shape[0], (-grid.shape[1]) % k), np.nan)], axis=1)
    return np.fmax.reduce(padded.reshape(grid.shape[0], -1, k), axis=2), k


def baseline_band(frame: pl.DataFrame, component: str, metric: str,
                  marks: Sequence[Mark] = ()) -> Figure:
    """One component's metric over steps with its trailing baseline (median, lower..upper band);
    where the frame's `held` is true, the band held as it stood at an onset, hatched."""
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    ax = fig.subplots()
    step = frame["step"].to_numpy()
    held = frame["held"].to_numpy() if "held" in frame.columns else np.zeros(len(frame), dtype=np.bool_)
    parts = [(~held, {"alpha": 0.18, "label": "baseline band (trailing)" if held.any() else "baseline band"})]
    if held.any():
        span = f"{step[held].min()}–{step[held].max()}"
        parts.append((held, {"alpha": 0.12, "hatch": "///", "edgecolor": "#1f77b4", "linewidth": 0,
                             "label": f"baseline band as at the onset, held over steps {span}"}))
    for where, style in parts:
        lower, upper = (_envelope(step, np.where(where, frame[c].to_numpy(), np.nan)) for c in ("lower", "upper"))
        ax.fill_between(lower[0], lower[1], upper[1], color="#1f77b4", step="mid", **style)
    ax.plot(*_envelope(step, frame["median"].to_numpy()), color="#1f77b4", linewidth=1, label="baseline median")
    ax.plot(*_envelope(step, frame["value"].to_numpy()), color="black", linewidth=0.9, label=metric)
    _mark_nonfinite(ax, step, frame["value"])
    _draw_marks(ax, marks)
    _maybe_log(ax, frame["value"])
    _fit_to_values(ax, frame["value"])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(metric)
    ax.set_title(f"Root component {short_name(component, 60)}: {metric} against its own baseline")
    ax.legend(loc="best", fontsize=8, framealpha=0.9)
    return fig


def _envelope(x: np.ndarray, y: np.ndarray, points: int = 2 * STEP_COLUMNS) -> tuple[np.ndarray, np.ndarray]:
    """A long line cut to at most `points`: in each run of consecutive points, its lowest and
    highest, in step order (a spike stays as tall as it is; a run with no number is a gap).
    A figure about 1,000 pixels across shows no more points than that: drawing every point of a
    long run costs time and shows nothing more."""
    n = len(y)
    per = -(-n // (points // 2))
    if per <= 1:
        return x, y
    pad = (-n) % per
    ys = np.concatenate([np.asarray(y, dtype=np.float64), np.full(pad, np.nan)]).reshape(-1, per)
    xs = np.concatenate([np.asarray(x, dtype=np.float64), np.full(pad, np.nan)]).reshape(-1, per)
    some = ~np.isnan(ys).all(axis=1)
    filled = np.where(some[:, None], ys, 0.0)
    low = np.nanargmin(filled, axis=1)
    high = np.nanargmax(filled, axis=1)
    first, second = np.minimum(low, high), np.maximum(low, high)
    rows = np.arange(len(ys))
    out_x = np.stack([xs[rows, first], xs[rows, second]], axis=1).ravel()
    out_y = np.stack([ys[rows, first], ys[rows, second]], axis=1).ravel()
    out_y[np.repeat(~some, 2)] = np.nan
    return out_x, out_y


def _maybe_log(ax: Axes, values: pl.Series) -> None:
    """Log scale when the values are positive and span more than two decades."""
    v = values.drop_nulls().drop_nans().to_numpy()
    v = v[np.isfinite(v)]
    if len(v) and v.min() > 0 and v.max() / v.min() > 100:
        ax.set_yscale("log")


def _mark_nonfinite(ax: Axes, step: np.ndarray, values: pl.Series) -> None:
    """A rug along the top of the axes where the value is NaN or Inf (a line plot just stops there)."""
    v = values.cast(pl.Float64).to_numpy()  # nulls (not recorded) become NaN too; keep only real ones
    bad = ~np.isfinite(v) & ~values.is_null().to_numpy()
    if bad.any():
        ax.plot(step[bad], np.full(bad.sum(), 0.97), "|", color="#d62728", markersize=9,
                transform=ax.get_xaxis_transform(), label=f"NaN/Inf ({bad.sum()} steps)")


def _fit_to_values(ax: Axes, values: pl.Series) -> None:
    """Keep the y range on the metric itself: a band that balloons after a fault must not flatten it."""
    v = values.cast(pl.Float64).drop_nulls().drop_nans().to_numpy()
    v = v[np.isfinite(v)]
    if not len(v) or v.min() == v.max():
        return
    lo, hi = v.min(), v.max()
    if ax.get_yscale() == "log":
        ax.set_ylim(lo / 1.5, hi * 1.5)
    else:
        pad = 0.08 * (hi - lo)
        ax.set_ylim(lo - pad, hi + pad)


def loss_and_grad(steps: pl.DataFrame, marks: Sequence[Mark] = (), never: Sequence[str] = (), *,
                  ranks: int = 1) -> Figure:
    """Loss and total gradient norm over steps (one row a step: over `ranks` ranks, their mean),
    with the light's and the comparators' marks.

    `never` names detectors that did not fire at all; the legend says so instead of hiding them.
    """
    fig = Figure(figsize=(11, 6), layout="constrained")
    ax_loss, ax_grad = fig.subplots(2, 1, sharex=True)
    step = steps["step"].to_numpy()
    over = f"\n(mean of {ranks} ranks)" if ranks > 1 else ""
    for ax, col, label in ((ax_loss, "loss", f"loss{over}"), (ax_grad, "grad_norm_total_l2", f"total grad norm (L2){over}")):
        if col in steps.columns and steps[col].null_count() < len(steps):
            ax.plot(*_envelope(step, steps[col].cast(pl.Float64).to_numpy()), color="black", linewidth=0.8)
            _mark_nonfinite(ax, step, steps[col])
            _maybe_log(ax, steps[col].cast(pl.Float64))
        else:
            ax.text(0.5, 0.5, f"no {col} recorded", transform=ax.transAxes, ha="center")
        ax.set_ylabel(label)
        _draw_marks(ax, marks)
    ax_loss.set_title("What a loss/grad-norm dashboard shows, and when each detector fired")
    ax_grad.set_xlabel("optimizer step")
    for label in never:
        colour, style = MARK_STYLE.get(label, ("black", "-"))
        ax_loss.plot([], [], color=colour, linestyle=style, alpha=0.4, label=f"{label}: never fired")
    if marks or never:
        ax_loss.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return fig


def condition_map(alarms: pl.DataFrame, order: Sequence[str], last_step: int,
                  marks: Sequence[Mark] = (), kinds: dict[str, str] | None = None) -> Figure:
    """Component × step map coloured by the alarmed condition, from each alarm's onset to its last step.

    `alarms`: rows with observed_on, condition, onset_step and (optionally) last_step. A
    component of `order` gets a row per condition alarmed on it (one empty row if none), so no
    episode is drawn over another's. A run of more than `MAP_COLUMNS` steps is drawn in bins of
    steps (a cell shows an episode that covers any of its steps): one column per step would make
    the image as wide as the run, in memory and in drawing time.
    """
    conditions = sorted(set(alarms["condition"].to_list())) if len(alarms) else []
    on = set(alarms.select("observed_on", "condition").iter_rows()) if len(alarms) else set()
    rows = [(c, k) for c in order for k in [k for k in conditions if (c, k) in on] or [None]]
    index = {row: i for i, row in enumerate(rows)}
    width = -(-last_step // MAP_COLUMNS) if last_step > MAP_COLUMNS else 1  # steps per column
    grid = np.full((len(rows), -(-last_step // width)), np.nan)
    for row in alarms.iter_rows(named=True):
        if (row["observed_on"], row["condition"]) in index and row["onset_step"] is not None:
            end = row.get("last_step") or last_step  # the episode's last alarming step, if known
            first_col, last_col = (int(row["onset_step"]) - 1) // width, (int(end) - 1) // width
            grid[index[row["observed_on"], row["condition"]], first_col:last_col + 1] = conditions.index(row["condition"])
    height = min(14.0, 1.6 + 0.3 * len(rows))  # as tall as its rows, and its legend's line below them
    fig = Figure(figsize=(11, height), layout="constrained")
    ax = fig.subplots()
    palette = ListedColormap(matplotlib.colormaps["tab10"].colors[: max(1, len(conditions))]).with_extremes(bad="#f4f4f4")
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=palette, vmin=-0.5,
              vmax=max(1, len(conditions)) - 0.5, extent=(0.5, grid.shape[1] * width + 0.5, len(rows) - 0.5, -0.5))
    _set_rows(ax, [c for c, _ in rows], kinds)
    if len(rows) < 4:  # the axis label would be taller than the rows; their names say it
        ax.set_ylabel("")
    ax.set_xlabel("optimizer step")
    ax.set_title("Alarmed components by condition (onset to last alarming step"
                 + (f"; a column is {width} steps)" if width > 1 else ")"))
    handles = [Rectangle((0, 0), 1, 1, color=palette(i)) for i in range(len(conditions))]
    _draw_marks(ax, marks)
    lines, labels = ax.get_legend_handles_labels()
    # below the axes, in one line: over the rows it would hide episodes, beside them narrow the
    # axes to fewer pixels than columns (the image shrunk to fit drops columns)
    fig.legend(handles + lines, conditions + labels, loc="outside lower center", ncols=len(handles + lines),
               fontsize=8, frameon=False)
    return fig


def rank_panel(frame: pl.DataFrame, marks: Sequence[Mark] = ()) -> Figure:
    """Rank × step: how far each rank's local gradients stray from the ranks' median (red: above,
    blue: below), and where its weights left the majority (black ticks)."""
    ranks = sorted(set(frame["rank"].to_list()))
    steps = sorted(set(frame["step"].to_list()))
    col = {s: i for i, s in enumerate(steps)}
    grid = np.full((len(ranks), len(steps)), np.nan)
    for r, s, dev, _ in frame.iter_rows():
        grid[ranks.index(r), col[s]] = np.nan if dev is None else dev
    fig = Figure(figsize=(11, 1.7 + 0.45 * len(ranks)), layout="constrained")
    ax = fig.subplots()
    width = steps[1] - steps[0] if len(steps) > 1 else 1
    extent = (steps[0] - 0.5, steps[-1] + width - 0.5, len(ranks) - 0.5, -0.5)
    top = max(1.0, float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0)
    im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="RdBu_r", vmin=-top, vmax=top,
                   extent=extent)
    off = frame.filter(pl.col("diverged"))
    if len(off):
        ax.scatter(off["step"].to_numpy() + (width - 1) / 2, [ranks.index(r) for r in off["rank"]],
                   marker="|", s=80, color="black", label="weights differ from the majority")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlabel("optimizer step")
    ax.set_title("Ranks: log local gradient norm − the ranks' median (the largest over components)")
    fig.colorbar(im, ax=ax, pad=0.01, label="log units")
    _draw_marks(ax, marks)
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # below the axes, in one line: over them it hid the first steps of rank 0
        fig.legend(handles, labels, loc="outside lower center", ncols=len(handles), fontsize=8, frameon=False)
    return fig


def png_bytes(fig: Figure, dpi: int = DPI) -> bytes:
    """The figure as PNG bytes (rendered by Agg through the figure's own canvas, whatever the backend).

    Laid out once, at `dpi`, then drawn with its layout engine set aside: `savefig` would draw it
    twice, once without rendering to lay it out (the same pixels, a dry draw the less)."""
    engine, own_dpi = fig.get_layout_engine(), fig.dpi
    buf = io.BytesIO()
    if engine is not None:
        fig.set_dpi(dpi)
        engine.execute(fig)
        fig.set_layout_engine(None)
    try:
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        if engine is not None:
            fig.set_layout_engine(engine)
        fig.set_dpi(own_dpi)
    return buf.getvalue()


def data_uri(png: bytes) -> str:
    """A PNG as an `<img src=...>` value, so the HTML carries its images inside it."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
