"""Injected-bottleneck explorer: a fault and its strength -> a profiled run, its breakdown and findings."""
import ipywidgets as W

from dtlib.experiments.profiling import FAULTS, LEVELS, run_injected, strength_of
from dtlib.viz.profile import plot_breakdown
from dtlib.widgets.base import Explorer, register


def _run(fault: str, level: str) -> dict:
    return run_injected(fault, strength_of(fault, level), steps=3)


@register("profile_faults")
def profile_faults_explorer() -> Explorer:
    return Explorer(
        {"fault": W.Dropdown(options=list(FAULTS), value="straggler", description="fault"),
         "level": W.Dropdown(options=list(LEVELS), value="default", description="strength")},
        compute=_run, plot=lambda p: plot_breakdown(p, p["findings"]),
        title="Inject a bottleneck, profile 2 ranks (4 for bubble), read the diagnosis")
