"""Figures (matplotlib, imported lazily, Agg backend): line panels, grouped bars,
grouped-bar panels, one color per series label across a run; saved as
bench/results/<name>.png.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.report import RESULTS_DIR, shown


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_path(name: str) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR / f"{name}.png"


_COLORS: dict[str, Any] = {}


def color_for(label: str) -> Any:
    """The same color for the same series label in every panel and figure of a run."""
    if label not in _COLORS:
        palette = [f"C{i}" for i in range(10)] + ["black", "olive", "teal", "navy", "maroon"]
        _COLORS[label] = palette[len(_COLORS) % len(palette)]
    return _COLORS[label]


def plot_lines(
    name: str,
    panels: Sequence[dict[str, Any]],
    *,
    suptitle: str | None = None,
    note: str | None = None,
) -> Path:
    """One PNG with one subplot per panel.

    panel = {"title", "xlabel", "ylabel", "series": {label: (xs, ys, yerr_lo?, yerr_hi?)},
             "logx": bool, "logy": bool, "hline": float | None}
    yerr_lo/hi are absolute lower/upper values (e.g. min/max across reps)."""
    plt = _plt()
    n = len(panels)
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        for label, s in panel["series"].items():
            xs, ys = list(s[0]), list(s[1])
            if len(s) >= 4 and s[2] is not None:
                lo = [max(0.0, y - lv) for y, lv in zip(ys, s[2], strict=True)]
                hi = [max(0.0, h - y) for y, h in zip(ys, s[3], strict=True)]
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=label, color=color_for(label))
            else:
                ax.plot(xs, ys, marker="o", label=label, color=color_for(label))
        if panel.get("hline") is not None:
            ax.axhline(panel["hline"], color="gray", lw=0.8, ls="--")
        if panel.get("logx"):
            ax.set_xscale("log", base=2)
            xt = sorted({x for s in panel["series"].values() for x in s[0]})
            ax.set_xticks(xt)
            ax.set_xticklabels([str(x) for x in xt])
        if panel.get("logy"):
            ax.set_yscale("log")
        ax.set_title(panel.get("title", ""), fontsize=10)
        ax.set_xlabel(panel.get("xlabel", ""))
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _finish_figure(plt, fig, list(axes.flat)[n:], name, suptitle, note, top=0.96)


def _finish_figure(
    plt: Any, fig: Any, unused_axes: list[Any], name: str, suptitle: str | None, note: str | None, *, top: float
) -> Path:
    """Hide unused panels, title, footnote, save as bench/results/<name>.png."""
    for ax in unused_axes:
        ax.axis("off")
    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    if note:
        fig.text(0.01, 0.005, note, fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.03 if note else 0, 1, top if suptitle else 1))
    path = png_path(name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {shown(path)}", flush=True)
    return path


def plot_bars(
    name: str,
    groups: Sequence[str],
    series: dict[str, Sequence[float]],
    *,
    ylabel: str,
    title: str | None = None,
    errs: dict[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    logy: bool = False,
    note: str | None = None,
) -> Path:
    """Grouped bars: one group per x label, one bar per series."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(series)) * 0.6), 4.2))
    k = max(1, len(series))
    width = 0.8 / k
    for i, (label, ys) in enumerate(series.items()):
        xs = [g + (i - (k - 1) / 2) * width for g in range(len(groups))]
        yerr = None
        if errs and label in errs:
            lo, hi = errs[label]
            yerr = [
                [max(0.0, y - lv) for y, lv in zip(ys, lo, strict=True)],
                [max(0.0, h - y) for y, h in zip(ys, hi, strict=True)],
            ]
        ax.bar(xs, ys, width=width, label=label, yerr=yerr, capsize=3 if yerr else 0, color=color_for(label))
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _finish_figure(plt, fig, [], name, None, note, top=1.0)


def plot_bar_panels(
    name: str, panels: Sequence[dict[str, Any]], *, suptitle: str | None = None, note: str | None = None
) -> Path:
    """Several grouped-bar panels in one PNG.

    panel = {"title", "ylabel", "groups": [x labels], "series": {label: [y per group]},
             "errs": {label: (lo list, hi list)} (optional), "logy": bool}"""
    plt = _plt()
    n = len(panels)
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.8 * cols, 4.4 * rows), squeeze=False)
    for ax, p in zip(axes.flat, panels, strict=False):
        groups, series = p["groups"], p["series"]
        k = max(1, len(series))
        width = 0.8 / k
        for i, (label, ys) in enumerate(series.items()):
            xs = [g + (i - (k - 1) / 2) * width for g in range(len(groups))]
            ys = [0.0 if (y is None or (isinstance(y, float) and math.isnan(y))) else y for y in ys]
            yerr = None
            if p.get("errs") and label in p["errs"]:
                lo, hi = p["errs"][label]
                yerr = [
                    [max(0.0, y - (lv or 0)) for y, lv in zip(ys, lo, strict=True)],
                    [max(0.0, (h or 0) - y) for y, h in zip(ys, hi, strict=True)],
                ]
            ax.bar(xs, ys, width=width, label=label, yerr=yerr, capsize=2 if yerr else 0, color=color_for(label))
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, fontsize=8)
        ax.set_ylabel(p.get("ylabel", ""))
        if p.get("logy"):
            ax.set_yscale("log")
        ax.set_title(p.get("title", ""), fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    return _finish_figure(plt, fig, list(axes.flat)[n:], name, suptitle, note, top=0.95)
