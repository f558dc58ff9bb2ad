"""The rank grid: Megatron-LM's rank order, checked against the groups printed in
megatron/core/parallel_state.py's docstring, the expert view, and real process groups."""
import pytest
import torch
import torch.distributed as dist

from dtlib.launcher import launch
from dtlib.parallel.mesh import ParallelLayout, build_groups
from dtlib.viz.mesh import group_links, plot_rank_grid

TIMEOUT = 40


def test_megatron_docstring_example():
    # initialize_model_parallel's docstring: 16 GPUs, tp=2, pp=4, dp=2 ->
    # "8 tensor model-parallel groups: [g0, g1], [g2, g3], ...",
    # "4 pipeline model-parallel groups: [g0, g4, g8, g12], [g1, g5, g9, g13], ...",
    # "8 data-parallel groups: [g0, g2], [g1, g3], [g4, g6], [g5, g7], ..."
    groups = ParallelLayout(dp=2, tp=2, pp=4).groups
    assert groups["tp"] == [[2 * i, 2 * i + 1] for i in range(8)]
    assert groups["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert groups["dp"] == sorted([[4 * s + t, 4 * s + t + 2] for s in range(4) for t in range(2)])
    assert groups["cp"] == [[r] for r in range(16)]


def test_order_tp_cp_dp_pp():
    layout = ParallelLayout(dp=2, tp=2, pp=2, cp=2)
    # rank = tp + 2 * (cp + 2 * (dp + 2 * pp)) written out for three ranks
    assert layout.coordinates(1) == {"tp": 1, "cp": 0, "dp": 0, "pp": 0, "ep": 0, "edp": 0}
    assert layout.coordinates(2) == {"tp": 0, "cp": 1, "dp": 0, "pp": 0, "ep": 0, "edp": 1}
    assert layout.coordinates(13)["pp"] == 1 and layout.coordinates(13)["dp"] == 1
    for r in range(layout.world_size):
        c = layout.coordinates(r)
        assert layout.rank(tp=c["tp"], cp=c["cp"], dp=c["dp"], pp=c["pp"]) == r
    g = layout.groups
    assert g["cp"][0] == [0, 2] and g["dp"][0] == [0, 4] and g["pp"][0] == [0, 8]
    assert g["dp_cp"][0] == [0, 2, 4, 6]


def test_groups_partition_the_world():
    layout = ParallelLayout(dp=4, tp=2, pp=2, cp=1, ep=2)
    for kind, groups in layout.groups.items():
        flat = sorted(r for grp in groups for r in grp)
        assert flat == list(range(16)), kind
    sizes = {k: len(v[0]) for k, v in layout.groups.items()}
    assert sizes == {"tp": 2, "cp": 1, "dp": 4, "pp": 2, "dp_cp": 4, "ep": 2, "edp": 2}


def test_expert_groups_as_megatron_core():
    # Megatron-core's expert RankGenerator(tp=1, ep=2, dp=world/(tp*ep*pp)=2, pp=2, cp=1) with
    # order tp-cp-ep-dp-pp on 8 ranks: ep groups [0,1],[2,3],[4,5],[6,7]; edp [0,2],[1,3],...
    g = ParallelLayout(dp=4, pp=2, ep=2).groups
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["edp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # carved out of dp x cp: with cp=2, dp=2 the expert ranks of a stage fold over both axes
    g = ParallelLayout(dp=2, cp=2, ep=4).groups
    assert g["ep"] == [[0, 1, 2, 3]] and g["edp"] == [[0], [1], [2], [3]]


@pytest.mark.parametrize("kwargs, world, message", [
    (dict(dp=2, tp=2), 8, "dp x tp x pp x cp = 2x2x1x1 = 4 but the world size is 8; use dp = 4"),
    (dict(dp=2, tp=3), 8, "multiple of tp x pp x cp = 3"),
])
def test_validate(kwargs, world, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelLayout(**kwargs).validate(world)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp=0), "dp must be an integer >= 1, got 0"),
    (dict(dp=2, tp=1.5), "tp must be an integer >= 1"),
    (dict(dp=3, ep=2), "ep=2 must divide dp x cp = 3"),
])
def test_bad_layouts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout(**kwargs)
    with pytest.raises(ValueError, match="rank must be in 0..3"):
        ParallelLayout(dp=2, tp=2).coordinates(4)


def test_group_links_and_drawing():
    layout = ParallelLayout(dp=2, tp=4, pp=2)
    links = group_links(layout, gpus_per_node=8)
    assert links["tp"] == "intra-node" and links["pp"] == "inter-node" and links["cp"] == "none"
    assert links["dp"] == "intra-node"  # dp pairs (0,4) sit on node 0 with 8 GPUs per node
    assert group_links(layout, gpus_per_node=4)["dp"] == "inter-node"
    fig = plot_rank_grid(layout, gpus_per_node=8, color_by="tp")
    ax = fig.axes[0]
    cells = {p.get_label(): p.get_facecolor() for p in ax.patches}
    assert len(cells) == 16
    assert cells["rank 0"] == cells["rank 3"] != cells["rank 4"]  # one colour per TP group
    texts = [t.get_text() for t in ax.texts]
    assert "node 1" in texts and "d1 t3\np1 c0" in texts  # rank 15's coordinates
    assert "intra-node" in ax.get_title()
    with pytest.raises(ValueError, match="color_by"):
        plot_rank_grid(layout, color_by="xx")


def _groups_sum(rank, world_size):
    layout = ParallelLayout(dp=2, tp=2)
    pg = build_groups(layout)
    out = {}
    for kind in ("tp", "dp", "dp_cp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=pg[kind])
        out[kind] = t.item()
    return out, pg.coords, pg.handles["cp"]


def test_build_groups_on_real_ranks():
    results = launch(_groups_sum, 4, timeout=TIMEOUT)
    layout = ParallelLayout(dp=2, tp=2)
    for rank, (sums, coords, cp_handle) in enumerate(results):
        mine = layout.groups_of(rank)
        for kind, value in sums.items():
            assert value == sum(mine[kind]), (rank, kind)
        assert coords == layout.coordinates(rank)
        assert cp_handle is None  # a group of one rank is not created
