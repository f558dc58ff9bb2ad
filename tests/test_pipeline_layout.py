"""Explicit pipeline layouts (Megatron's --pipeline-model-parallel-layout) and MTP layers, judged by
Megatron-Core's own parser and its own model build."""
import warnings

import pytest

from dtlib.analytic.flops import forward_flops_per_token
from dtlib.analytic.hardware import cluster
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import memory_per_gpu
from dtlib.analytic.pipeline_layout import PipelineLayout
from dtlib.analytic.presets import PRESETS
from dtlib.analytic.stages import pipeline_stages
from dtlib.plan.steptime import step_time

LAYOUTS = ["Et*3|(tt|)*29m|L", "Et*3|(tt|)*29,m|L", "Ett|tt|tt|ttL", "Et|(tt|)*3t*2L", "E|t*4|t*4|L",
           "(Et|)*1(t|)*6tL", "Ettt|ttt|tt|tt|tt|ttt|ttt|tmL"]


def megatron_layout():
    pytest.importorskip("megatron.core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer import pipeline_parallel_layer_layout as module
    return module


@pytest.mark.parametrize("text", LAYOUTS)
def test_parse_equals_megatron_cores(text):
    module = megatron_layout()
    letter = {"embedding": "E", "loss": "L", "decoder": "t", "mtp": "m"}
    theirs = ["".join(letter[t.name] for t in chunk) for chunk in module.PipelineParallelLayerLayout.parse_str_to_list(text)]
    assert list(PipelineLayout(text).chunks) == theirs


@pytest.mark.parametrize("text,pp,layers,mtp", [
    ("Et*3|(tt|)*29m|L", 16, 61, 1), ("Et*3|(tt|)*29m|L", 32, 61, 1), ("Ett|tt|tt|ttL", 2, 8, 0),
    ("Ett|tt|tt|ttL", 4, 8, 0), ("Ettt|ttt|tt|tt|tt|ttt|ttt|tmL", 4, 19, 1), ("Et|(tt|)*3t*2L", 5, 9, 0),
    ("Ett|tt|m|L", 2, 4, 1),  # the MTP layer alone in rank 0's last chunk
])
def test_chunks_of_every_rank_equal_megatron_cores(text, pp, layers, mtp, monkeypatch):
    """Layers per (rank, virtual stage) and their offsets, as Megatron-Core's PipelineParallelLayerLayout
    gives them, against dtlib's stages of the same layout."""
    module = megatron_layout()
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType

    theirs = module.PipelineParallelLayerLayout(text, pp)
    theirs.validate_layer_layout(layers, mtp)
    v = PipelineLayout(text).check(pp, layers, mtp)
    assert v == theirs.virtual_pipeline_model_parallel_size
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: v)
    model = PRESETS["llama3-8b"].with_(layers=layers, mtp_layers=mtp)
    layout = Parallelism(pp=pp, virtual_stages=v, schedule="interleaved" if v > 1 else "1f1b",
                         num_microbatches=2 * pp, pipeline_layout=text)
    for stage in pipeline_stages(model, layout):
        for vp, chunk in enumerate(stage.chunks):
            first = theirs.get_layer_offset(LayerType.decoder, vp_stage=vp, pp_rank=stage.rank)
            count = theirs.get_num_layers_to_build(LayerType.decoder, vp_stage=vp, pp_rank=stage.rank)
            assert chunk == tuple(range(first, first + count))


@pytest.mark.parametrize("text,pp,layers,mtp", [
    ("Et*3|(tt|)*29m|L", 16, 60, 1),   # one layer too many
    ("Et*3|(tt|)*29m|L", 16, 61, 0),   # an MTP layer the model lacks
    ("tE|tt|L", 3, 3, 0),               # the embedding not first
    ("Ett|tmt|L", 3, 4, 1),             # a layer after the MTP layer
    ("Ett|tt|L|L", 2, 4, 0),            # the loss twice
    ("Ett|tm|t|L", 2, 4, 1),            # MTP in a virtual stage before the last
    ("Ett|tt|m|mL", 2, 4, 2),           # MTP layers in two chunks
])
def test_bad_layouts_refused_as_megatron_core_refuses_them(text, pp, layers, mtp):
    module = megatron_layout()
    with pytest.raises(AssertionError):
        module.PipelineParallelLayerLayout(text, pp).validate_layer_layout(layers, mtp)
    with pytest.raises(ValueError, match="pipeline_layout must be a Megatron layout string"):
        PipelineLayout(text).check(pp, layers, mtp)


@pytest.mark.parametrize("text,why", [("Et*3|(tt|*29|L", "brackets"), ("Etx|L", "unknown letter"),
                                      ("E(tt)|L", "followed by \\*N"), ("E*|tL", "not followed by a count")])
def test_malformed_strings_say_why(text, why):
    with pytest.raises(ValueError, match=why):
        PipelineLayout(text).chunks


def test_pp_must_divide_the_chunks():
    with pytest.raises(ValueError, match="pp must be a divisor of the layout's 4 chunks \\(1, 2, 4\\)"):
        PipelineLayout("Ett|tt|tt|ttL").virtual_stages(3)
    with pytest.raises(ValueError, match="virtual_stages must be 2"):
        Parallelism(pp=2, pipeline_layout="Ett|tt|tt|ttL")


def test_a_layout_of_the_even_split_costs_what_the_even_split_costs():
    """Llama-3-8B over pp 4 as a string and as Megatron's even split: the same memory on the same
    rank and the same step time."""
    model, cl = PRESETS["llama3-8b"], cluster("h100-sxm", 1, 8)
    even = Parallelism(dp=2, pp=4, num_microbatches=8)
    written = even.with_(pipeline_layout="Et*8|t*8|t*8|t*8L")
    a, b = memory_per_gpu(model, even), memory_per_gpu(model, written)
    assert (a.total, a.stage) == (b.total, b.stage)
    assert step_time(model, even, cl).step_time == step_time(model, written, cl).step_time


def test_an_uneven_layout_moves_the_heaviest_and_slowest_rank():
    """Four layers on rank 0 of Llama-3-8B over pp 2 instead of 16: more memory on rank 1 and a
    step paced by its 28 layers."""
    model, cl = PRESETS["llama3-8b"], cluster("h100-sxm", 1, 8)
    even = Parallelism(dp=4, pp=2, num_microbatches=8)
    skewed = even.with_(pipeline_layout="Et*4|t*28L")
    assert memory_per_gpu(model, skewed).stage == 1
    assert memory_per_gpu(model, skewed).total > memory_per_gpu(model, even).total
    assert step_time(model, skewed, cl).step_time > step_time(model, even, cl).step_time


# ---- MTP layers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,layout", [
    ("llama3-8b", Parallelism(dp=8)),
    ("deepseek-v2-lite", Parallelism(dp=8, ep=8, zero=1)),            # an MoE MTP block
    ("llama3-8b", Parallelism(dp=2, pp=2, num_microbatches=4)),       # on the last stage, an embedding copy
    ("deepseek-v2-lite", Parallelism(dp=2, pp=2, ep=2, num_microbatches=4, pipeline_layout="Et*13|t*14mL")),
])
def test_megatron_core_builds_dtlibs_count_with_mtp(name, layout):
    """Megatron-Core's GPTModel of the emitted flags (--mtp-num-layers 1), built on the meta device,
    holds dtlib's count on the first and the last rank."""
    pytest.importorskip("megatron.core")
    from dtlib.frameworks.megatron_meta import dtlib_params_per_stage, params_per_rank
    from dtlib.plan.emit import emit

    model = PRESETS[name].with_(mtp_layers=1)
    flags = emit("megatron", layout, model, layout.global_batch).data
    assert "--mtp-num-layers" in flags
    ours = dtlib_params_per_stage(model, layout)
    assert params_per_rank(flags, layout.gpus, 0) == ours["first"]
    assert params_per_rank(flags, layout.gpus, layout.gpus - 1) == ours["last"]


def test_mtp_parameters_and_flops():
    """DeepSeek-V3's MTP module: an MoE block, the h x 2h projection and three norms (11.6B); per
    token it adds one MoE layer's forward, 2 x 2h^2 and the 2hV logits of the shared head."""
    base = PRESETS["deepseek-v3"]
    mtp = base.with_(mtp_layers=1)
    h = base.hidden
    assert mtp.num_parameters() - base.num_parameters() == base.layer_parameters(moe=True) + 2 * h * h + 3 * h
    assert round(mtp.mtp_parameters() / 1e9, 2) == 11.61
    n0, n1 = base.numbers(), mtp.numbers()
    one_layer = forward_flops_per_token(**dict(n0, layers=1, moe_layers=1, dense_layers=0), count_logits=False)
    assert forward_flops_per_token(**n1) - forward_flops_per_token(**n0) == pytest.approx(
        one_layer + 4 * h * h + 2 * h * base.vocab, rel=1e-12)


def test_cli_layout_and_mtp(capsys):
    from dtlib.cli import main

    args = ["memory", "deepseek-v3", "--gpus", "1024", "--pp", "16", "--ep", "64", "--zero", "1",
            "--microbatches", "32", "--recompute", "full", "--pipeline-layout", "Et*3|(tt|)*29m|L"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "0 MTP layers m (the model's mtp_layers, --mtp-layers), not 1" in err and len(err.strip().splitlines()) == 1
    assert main(args + ["--mtp-layers", "1"]) == 0
    assert "every stage evaluated; layers placed by a layout string" in capsys.readouterr().out
    assert main(["plan", "deepseek-v3", "--gpus", "1024", "--global-batch", "4096",
                 "--pipeline-layout", "Et*3|(tt|)*29|L"]) == 2
    assert "--pp must be given with a pipeline layout string" in capsys.readouterr().err
