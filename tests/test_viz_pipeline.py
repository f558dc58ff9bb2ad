"""Pipeline plots show what they are given: one bar per action at its time, the held counts, the
the activation bars."""
import pytest

from dtlib.parallel import schedule, simulate
from dtlib.viz.pipeline import (KIND_COLORS, plot_gantt, plot_in_flight, plot_measured_vs_ideal,
                                plot_schedule_memory)
from dtlib.widgets.pipeline import explorer_compute


def _bars(ax):
    return [p for p in ax.patches if p.get_width() > 0]


def test_gantt_has_one_bar_per_action_where_the_timeline_puts_it():
    t = simulate(schedule("zb-h1", 3, 4), 1.0, 1.0, 0.5)
    ax = plot_gantt(t).axes[0]
    bars = _bars(ax)
    assert len(bars) == sum(len(ops) for ops in t.events)
    expected = sorted((round(e.start, 6), round(e.end - e.start, 6), 2 - e.rank) for ops in t.events for e in ops)
    drawn = sorted((round(b.get_x(), 6), round(b.get_width(), 6), round(b.get_y() + b.get_height() / 2))
                   for b in bars)
    assert drawn == expected
    colors = {b.get_facecolor()[:3] for b in bars}
    assert len(colors) == 3  # F, B and W
    assert "bubble 0.30" in ax.get_title()  # (p-1)(tF + tB - tW) / (m (tF + tB + tW)) = 3/10


def test_measured_vs_ideal_draws_both_in_ms():
    t = simulate(schedule("gpipe", 2, 2), 0.01, 0.02)
    fig = plot_measured_vs_ideal(t, simulate(schedule("gpipe", 2, 2), 0.01, 0.01))
    top, bottom = fig.axes[:2]
    assert max(b.get_x() + b.get_width() for b in _bars(top)) == pytest.approx(90)  # 3 x 30 ms
    assert max(b.get_x() + b.get_width() for b in _bars(bottom)) == pytest.approx(60)
    assert "measured" in top.get_title() and "simulated" in bottom.get_title()
    assert top.get_xlim() == bottom.get_xlim() == pytest.approx((0, 90))  # the longer one is whole


def test_in_flight_plot_peaks_at_the_schedule_peak():
    timelines = {n: simulate(schedule(n, 4, 8)) for n in ("gpipe", "1f1b")}
    ax = plot_in_flight(timelines).axes[0]
    peaks = [max(line.get_ydata()) for line in ax.get_lines()]
    assert peaks == [8, 4]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["gpipe (peak 8)", "1f1b (peak 4)"]


def test_schedule_memory_bars_are_the_activation_bytes():
    r = explorer_compute("1f1b", 4, 8, 2, 2.0, 0.5)
    assert r["v"] == 1 and r["timeline"].peak_in_flight == [4, 3, 2, 1]
    # activations fall linearly with the micro-batches held: rank r holds (p-r)/p of rank 0's
    assert r["activation_gib"] == pytest.approx([r["activation_gib"][0] * k / 4 for k in (4, 3, 2, 1)])
    fig = plot_schedule_memory(r["timeline"], r["activation_gib"])
    bars = sorted(_bars(fig.axes[1]), key=lambda b: -b.get_y())
    assert [b.get_width() for b in bars] == pytest.approx(r["activation_gib"])
    assert set(KIND_COLORS) >= {"F", "B"}
