"""Lesson 13's pictures draw what they are given: bar heights, labels, the emitted text and the
lines a framework cannot express."""
import pytest
from matplotlib.patches import Rectangle

from dtlib.analytic.units import MiB
from dtlib.viz import frameworks as viz


def _heights(ax) -> list[float]:
    return [p.get_height() for p in ax.patches if isinstance(p, Rectangle) and p.get_width() < 1]


def _texts(fig) -> str:
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts)


def test_losses_and_differences():
    fig = viz.plot_framework_losses({"DeepSpeed ZeRO-2": [4.2, 4.0], "JAX fsdp": [4.1, 3.9]},
                                    {"DeepSpeed ZeRO-2": [4.2, 4.0], "JAX fsdp": [4.1, 3.9]},
                                    {"DeepSpeed ZeRO-2": {"loss": 1e-7, "parameters": 0.0},
                                     "JAX fsdp": {"loss": 2e-7, "parameters": 3e-8}})
    left, right = fig.axes
    labels = [t.get_text() for t in left.get_legend().get_texts()]
    assert labels == ["DeepSpeed ZeRO-2: one process", "DeepSpeed ZeRO-2", "JAX fsdp: one process", "JAX fsdp"]
    # loss bars then parameter bars; an exact 0 sits at the log axis' floor and is labelled "0"
    assert _heights(right) == pytest.approx([1e-7, 2e-7, 1e-12, 3e-8])
    assert [t.get_text() for t in right.texts] == ["1e-07", "2e-07", "0", "3e-08"]
    assert [t.get_text() for t in right.get_xticklabels()] == ["DeepSpeed\nZeRO-2", "JAX\nfsdp"]


def test_collectives_bars_are_the_counts():
    fig = viz.plot_framework_collectives({"DeepSpeed": {"all_reduce": 9, "all_gather": 3}, "dtlib": {"reduce_scatter": 6}},
                                         ylabel="calls in 3 steps")
    (ax,) = fig.axes
    # groups all_gather, all_reduce, reduce_scatter; DeepSpeed's bars first, then dtlib's
    assert _heights(ax) == [3, 9, 0, 0, 0, 6]
    assert ax.get_ylabel() == "calls in 3 steps"


def test_silent_defaults_default_next_to_fixed():
    fig = viz.plot_silent_defaults({"clipping": {"default": 1e-3, "fixed": 4e-9}, "p2p": {"default": 8e9, "fixed": 0.0}})
    (ax,) = fig.axes
    assert _heights(ax) == pytest.approx([1e-3, 8e9, 4e-9, 1e-12])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["default", "fixed"]


def test_emitted_shows_each_config_and_what_cannot_be_expressed():
    fig = viz.plot_emitted({"parameters": 2 * MiB, "gradients": 1 * MiB, "optimizer": 4 * MiB},
                           {"DeepSpeed": "train_batch_size: 8", "JAX": ""},
                           {"DeepSpeed": [], "JAX": ["pp=2: not a PartitionSpec"]})
    bars = fig.axes[0]
    assert _heights(bars) == pytest.approx([2, 1, 4])  # MiB, stacked
    assert [t.get_text() for t in bars.get_xticklabels()] == ["7 MiB"]
    shown = _texts(fig)
    assert "train_batch_size: 8" in shown and "cannot express: pp=2: not a\n  PartitionSpec" in shown  # wrapped
    assert [ax.get_title() for ax in fig.axes[1:]] == ["DeepSpeed", "JAX"]


def test_memory_stacks_each_rank_under_its_prediction():
    fig = viz.plot_framework_memory({"DeepSpeed ZeRO-2": [{"parameters": 4 * MiB, "gradients": 2 * MiB}] * 2},
                                    {"DeepSpeed ZeRO-2": {"parameters": 4 * MiB, "gradients": 2 * MiB}})
    (ax,) = fig.axes
    assert _heights(ax)[:3] == pytest.approx([4, 2, 0])  # rank 0: parameters, gradients, optimizer (MiB)
    assert ax.get_xticklabels()[0].get_text() == "DeepSpeed\nZeRO-2\n(ranks 0-1)"


@pytest.mark.parametrize("plot, empty", [(viz.plot_framework_collectives, {}), (viz.plot_silent_defaults, {})])
def test_nothing_to_draw_is_an_error(plot, empty):
    with pytest.raises(ValueError, match="nothing to plot"):
        plot(empty)


def test_emitted_says_how_many_lines_are_cut_and_shows_the_caveats():
    text = "\n".join(f"--flag-{i} {i}" for i in range(30))
    fig = viz.plot_emitted({"parameters": MiB}, {"Megatron-LM flags": text}, {},
                           notes={"Megatron-LM flags": ["re-timed: tp_overlap 0"]}, max_lines=22)
    shown = _texts(fig)
    assert "--flag-20 20" in shown and "--flag-21 21" not in shown  # 21 lines, then the count
    assert "... 9 more lines not shown" in shown
    assert "re-timed: tp_overlap 0" in shown
    full = viz.plot_emitted({"parameters": MiB}, {"Megatron-LM flags": text}, {}, max_lines=30)
    assert "--flag-29 29" in _texts(full) and "more lines" not in _texts(full)


def test_fullsize_terms_groups_tracker_and_dtlib_per_term_and_total():
    from dtlib.analytic.units import GiB

    fig = viz.plot_fullsize_terms({"parameters": {"tracker": 3 * GiB, "dtlib": 3 * GiB},
                                   "temporary": {"tracker": 9 * GiB, "dtlib": 4 * GiB}})
    (ax,) = fig.axes
    assert _heights(ax) == pytest.approx([3, 9, 12, 3, 4, 7])  # tracker bars, then dtlib bars, in GiB
    assert [t.get_text() for t in ax.get_xticklabels()] == ["parameters", "temporary", "total"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["tracker", "dtlib"]
    with pytest.raises(ValueError, match="nothing to plot"):
        viz.plot_fullsize_terms({})
