"""Benchmark harness: one import (`from bench import harness as H`) for what
every benchmark shares. The pieces live in small modules:

- ``bench.stats``: percentiles, latency summaries, median and spread across
  repetitions, (paired) ratios, number formatting;
- ``bench.measure``: one load run (``run_load`` → ``RunResult``), repetitions
  interleaved side by side, CPU use of processes during a run;
- ``bench.report``: text tables, machine info, JSON in bench/results/;
- ``bench.plots``: PNG figures in bench/results/;
- ``bench.procs``: child processes (every tree ended on exit through
  ``bus.proctree``), loopback ports, deadlines, the entry point ``run_main``.

Honesty rules these help to keep:
- warm up before measuring (``interleaved(..., warmup=...)``);
- repeat (``reps``) and report the median and spread across repetitions;
- compare two setups by *paired* ratios: interleave them inside each
  repetition (``interleaved``) and take the median of the per-repetition
  ratios, so slow drift of a noisy machine hits both sides alike;
- bound everything: ``Deadline`` for phases, ``Procs`` kills every process
  tree it started (also on error / Ctrl-C), addresses are loopback only.
"""

from __future__ import annotations

from bench.measure import CpuMeter, RunResult, interleaved, interleaved_within, run_load, summarize_reps, with_cpu
from bench.plots import color_for, plot_bar_panels, plot_bars, plot_lines, png_path
from bench.procs import (
    LOOPBACK,
    Deadline,
    DeadlineExceeded,
    Procs,
    free_port,
    free_ports,
    run_main,
    setup_logging,
    wait_port,
)
from bench.report import REPO_ROOT, RESULTS_DIR, criterion, jsonable, machine_info, print_table, verdict, write_json
from bench.stats import fmt, fmt_spread, latency_summary, median, paired_ratios, percentile, ratio, spread

__all__ = [
    "interleaved_within",
    "LOOPBACK",
    "REPO_ROOT",
    "RESULTS_DIR",
    "CpuMeter",
    "Deadline",
    "DeadlineExceeded",
    "Procs",
    "RunResult",
    "color_for",
    "criterion",
    "fmt",
    "fmt_spread",
    "free_port",
    "free_ports",
    "interleaved",
    "jsonable",
    "latency_summary",
    "machine_info",
    "median",
    "paired_ratios",
    "percentile",
    "plot_bar_panels",
    "plot_bars",
    "plot_lines",
    "png_path",
    "print_table",
    "ratio",
    "run_load",
    "run_main",
    "setup_logging",
    "spread",
    "summarize_reps",
    "verdict",
    "wait_port",
    "with_cpu",
    "write_json",
]
