"""The planner's figure: bar segments read back equal each layout's breakdown and memory; no
layout draws the reason instead."""
import pytest

from dtlib.analytic.hardware import cluster
from dtlib.analytic.presets import get_preset
from dtlib.analytic.units import GiB
from dtlib.plan.search import search
from dtlib.plan.steptime import TERMS
from dtlib.viz.plan import layout_label, plot_plan


def test_bars_are_the_breakdown_and_the_memory():
    r = search(get_preset("llama3-8b"), cluster("h100-sxm", 2, 8), 64, top=3)
    fig = plot_plan(r.configs, r.capacity, title="t")
    time_ax, mem_ax = fig.axes
    labels = [t.get_text() for t in time_ax.get_yticklabels()]
    assert labels == [layout_label(c) for c in r.configs][::-1]   # fastest on top
    drawn = [p for p in time_ax.patches]
    used = [t for t in TERMS if any(c["breakdown"][t] for c in r.configs)]
    assert len(drawn) == len(used) * 3
    for j, term in enumerate(used):
        widths = [p.get_width() for p in drawn[3 * j: 3 * j + 3]]
        assert widths == pytest.approx([c["breakdown"][term] for c in r.configs][::-1])
    assert [p.get_width() for p in mem_ax.patches] == pytest.approx(
        [c["memory_per_gpu_bytes"] / GiB for c in r.configs][::-1])
    assert mem_ax.lines[0].get_xdata()[0] == pytest.approx(r.capacity / GiB)


def test_the_error_band_is_drawn_on_each_total():
    """Each layout's error bar spans its band (dtlib.plan.uncertainty); uncovered plans say so instead."""
    r = search(get_preset("llama3-8b"), cluster("h100-sxm", 2, 8), 64, top=3)
    time_ax = plot_plan(r.configs, r.capacity).axes[0]
    bars = [c for c in time_ax.collections if c.get_segments()]
    spans = [(s[0][0], s[1][0]) for c in bars for s in c.get_segments() if s[0][1] == s[1][1]]  # horizontal
    expected = [(c["band"]["step_time_s"]["low"], c["band"]["step_time_s"]["high"]) for c in r.configs][::-1]
    assert len(spans) == 3 and [x for s in spans for x in s] == pytest.approx([x for e in expected for x in e])
    assert all(low <= c["step_time_s"] <= high for c, (low, high) in zip(r.configs[::-1], spans))
    small = search(get_preset("llama3-8b"), cluster("h100-sxm", 8, 8), 8, top=1)  # less work than any run
    time_ax = plot_plan(small.configs, small.capacity).axes[0]
    assert not time_ax.collections and "band: not covered" in time_ax.texts[0].get_text()


def test_nothing_fits_draws_why():
    fig = plot_plan([], 72 * GiB, why="nothing fits: the smallest memory per GPU found is 857.6 GiB")
    assert "857.6 GiB" in fig.axes[0].texts[0].get_text()


def test_a_long_why_is_wrapped_between_words():
    """The widget's 'nothing fits' text was cut every 110 characters, mid-word."""
    why = ("nothing fits: the smallest memory per GPU found is 184.5 GiB (dp=1, tp=8, pp=1, cp=2, zero=3, "
           "micro_batch_size=1, recompute=full) but 0.9 x 80 GiB = 72.0 GiB is available on a h100-sxm; use more GPUs")
    lines = plot_plan([], 72 * GiB, why=why).axes[0].texts[0].get_text().split("\n")
    assert len(lines) > 1 and " ".join(lines) == why
