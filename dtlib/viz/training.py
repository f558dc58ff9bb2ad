"""Training plots: scaling efficiency, loss curves side by side, learning-rate schedules."""
from __future__ import annotations

from matplotlib.figure import Figure

from dtlib.viz.style import SMALL_FONT, colour


def plot_scaling(throughput: dict[int, float], efficiency: dict[int, float]) -> Figure:
    """Measured samples/s against the ideal line, and efficiency per world size (80% guide line)."""
    ns = sorted(throughput)
    fig = Figure(figsize=(9, 3.4))
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot(ns, [throughput[n] for n in ns], "o-", label="measured")
    ax1.plot(ns, [throughput[1] * n for n in ns], "k--", label="ideal (N x 1 rank)")
    ax1.set(xlabel="ranks N", ylabel="samples / s", title="throughput (weak scaling)", xticks=ns)
    ax1.legend()
    ax2.bar([str(n) for n in ns], [100 * efficiency[n] for n in ns], color=colour(0))
    ax2.axhline(80, color="red", ls=":", label="80%: investigate below")
    ax2.set(xlabel="ranks N", ylabel="efficiency %", title="throughput_N / (N x throughput_1)", ylim=(0, 110))
    ax2.legend()
    fig.tight_layout()
    return fig


def plot_losses(runs: dict[str, list[float]]) -> Figure:
    """Per-step training loss of named runs (e.g. 1 process vs N ranks vs torch DDP)."""
    fig = Figure(figsize=(6, 3.4))
    ax = fig.subplots()
    for i, (name, losses) in enumerate(runs.items()):
        ax.plot(losses, ls=["-", "--", ":", "-."][i % 4], lw=2, label=name)
    ax.set(xlabel="step", ylabel="loss", title="same data, same steps")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_lr_schedules(schedules: dict[str, list[float]], used: dict[str, list[float]] | None = None) -> Figure:
    """Learning rate per step for named schedules (lines), and the rates a real run used (dots)."""
    fig = Figure(figsize=(6, 3.2))
    ax = fig.subplots()
    for name, lrs in schedules.items():
        ax.plot(lrs, lw=2, label=name)
    for name, lrs in (used or {}).items():
        ax.plot(lrs, "o", ms=4, color="black", label=name)
    ax.set(xlabel="step", ylabel="learning rate", title="linear scaling rule with warm-up (Goyal et al. 2017)")
    ax.legend(fontsize=SMALL_FONT)
    fig.tight_layout()
    return fig
