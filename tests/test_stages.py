"""Pipelines as they run: dtlib's layer placement against Megatron-Core's own functions, the split
rule against Megatron-Core's own checks, every stage's memory (the heaviest decides) and the
slowest stage's time."""
import warnings

import numpy as np
import pytest

from dtlib.analytic.hardware import cluster
from dtlib.analytic.layout import Parallelism, megatron_split, pipeline_split, split_problem
from dtlib.analytic.memory import memory_per_gpu, per_gpu_bytes, rank_parameters
from dtlib.analytic.precision import get_precision
from dtlib.analytic.presets import get_preset
from dtlib.analytic.stages import megatron_layout_string, pipeline_stages, stored_on_rank
from dtlib.plan.steptime import step_time

torch = pytest.importorskip("torch")
mcore = pytest.importorskip("megatron.core.transformer.transformer_config")


def _megatron(layers, pp, v=1, first=None, last=None, balanced=False):
    """Megatron-Core 0.16.1's own config (its __post_init__ checks the split) and, per rank, the
    layer indices get_transformer_layer_offset / get_num_layers_to_build give each chunk."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = mcore.TransformerConfig(
            num_layers=layers, hidden_size=64, num_attention_heads=4, pipeline_dtype=torch.bfloat16,
            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=v if v > 1 else None,
            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
            account_for_embedding_in_pipeline_split=balanced, account_for_loss_in_pipeline_split=balanced)
        vp = [j if v > 1 else None for j in range(v)]
        return [tuple(tuple(range(get_transformer_layer_offset(cfg, j, r),
                                  get_transformer_layer_offset(cfg, j, r) + get_num_layers_to_build(cfg, j, r)))
                      for j in vp) for r in range(pp)]


SPLITS = [(32, 4, 1, None, None, False), (32, 4, 2, None, None, False), (61, 16, 1, 3, 2, False),
          (94, 8, 2, None, 10, False), (126, 16, 8, None, None, True), (30, 4, 1, None, None, True),
          (62, 4, 2, 14, 16, False), (61, 2, 1, 31, 30, False)]


@pytest.mark.parametrize("layers,pp,v,first,last,balanced", SPLITS)
def test_every_rank_holds_the_layers_megatron_core_builds_there(layers, pp, v, first, last, balanced):
    model = get_preset("deepseek-v3").with_(layers=layers)
    layout = Parallelism(pp=pp, virtual_stages=v, schedule="interleaved" if v > 1 else "1f1b", num_microbatches=pp,
                         first_stage_layers=first, last_stage_layers=last, account_for_embedding_and_loss=balanced)
    ours = [s.chunks for s in pipeline_stages(model, layout)]
    assert ours == _megatron(layers, pp, v, first, last, balanced)
    assert split_problem(layers, pp, v, first or 0, last or 0, 0, balanced) is None


@pytest.mark.parametrize("layers,pp,v,first,last,balanced", [
    (61, 16, 1, None, None, False), (61, 16, 1, 4, 2, False), (62, 4, 2, 15, 15, False), (61, 2, 1, 30, 30, False),
    (126, 16, 4, None, None, False), (61, 16, 1, 3, 2, True)])
def test_splits_megatron_refuses_are_refused_with_the_valid_values(layers, pp, v, first, last, balanced):
    problem = split_problem(layers, pp, v, first or 0, last or 0, 0, balanced)
    assert problem is not None and "\n" not in problem
    with pytest.raises((ValueError, AssertionError)):  # Megatron-Core refuses the same split
        _megatron(layers, pp, v, first, last, balanced)
        if not (first or last or balanced):  # the even split is asserted where layers are built
            raise ValueError
    suggestion = megatron_split(layers, pp, v, balanced)
    if suggestion not in (None, (0, 0)):
        assert f"first_stage_layers={suggestion[0] or None}, last_stage_layers={suggestion[1] or None}" in problem
        _megatron(layers, pp, v, suggestion[0] or None, suggestion[1] or None)  # and it accepts the suggestion


def test_the_planner_split_of_deepseek_v3():
    assert megatron_split(61, 16) == (3, 2)  # 3 + 14 x 4 + 2: the busiest rank holds ceil(61/16) = 4
    assert megatron_split(61, 32) == (16, 15)  # first/last flags only: 1 per middle rank
    assert pipeline_split(61, 32) == dict(first_stage_layers=0, last_stage_layers=0, pipeline_layout=1)
    assert pipeline_split(64, 8, 2) == dict(first_stage_layers=0, last_stage_layers=0, pipeline_layout=0)
    assert megatron_split(61, 4, 4) is None and pipeline_split(200, 64, 4) is None


def _heaviest(model, layout, ranks=None):
    """per_gpu_bytes on the candidate ranks (``ranks`` None) or on the given ones."""
    out = per_gpu_bytes(layout.numbers(**model.numbers()), get_precision("zero"), schedule=layout.schedule,
                        recompute=layout.recompute, account_for_embedding_and_loss=layout.account_for_embedding_and_loss,
                        ranks=ranks)
    return float(out["total"]), int(out["stage"])


@pytest.mark.parametrize("preset,layout", [
    ("deepseek-v3", Parallelism(dp=8, tp=2, pp=16, ep=8, sequence_parallel=True, num_microbatches=32,
                                first_stage_layers=3, last_stage_layers=2)),
    ("deepseek-v3", Parallelism(dp=8, tp=2, pp=8, ep=8, sequence_parallel=True, num_microbatches=16,
                                schedule="interleaved", virtual_stages=2, pipeline_layout=True)),
    ("llama3-405b", Parallelism(dp=8, tp=8, pp=16, schedule="interleaved", virtual_stages=4, num_microbatches=32,
                                sequence_parallel=True, account_for_embedding_and_loss=True)),
    ("gpt-oss-120b", Parallelism(dp=8, pp=4, ep=8, num_microbatches=8)),
])
def test_the_heaviest_of_every_rank_is_reported(preset, layout):
    model = get_preset(preset)
    totals = [_heaviest(model, layout, [r])[0] for r in range(layout.pp)]  # every rank, one by one
    assert _heaviest(model, layout) == (max(totals), int(np.argmax(totals)))


def test_deepseek_v3_a_middle_stage_of_moe_layers_is_the_heaviest():
    """The issue's plan: first and last ranks were 57.3 GiB while the second, all MoE layers with 31
    micro-batches in flight, needs about 63.1 GiB."""
    layout = Parallelism(dp=32, tp=2, pp=32, ep=8, sequence_parallel=True, num_microbatches=480, zero=2,
                         pipeline_layout=True)
    model = get_preset("deepseek-v3")
    m = memory_per_gpu(model, layout)
    assert m.stage not in (0, 31)
    n = layout.numbers(**model.numbers())
    first = rank_parameters(n, 0)["dense"]
    assert rank_parameters(n, m.stage)["expert"] > rank_parameters(n, 0)["expert"] and first > 0
    stored = stored_on_rank("1f1b", n, m.stage)
    assert stored["moe_share"] == 1 and stored["rest"] == 2 * (32 - m.stage)  # 2 layers x min(m, pp - r)


def test_uneven_splits_are_timed_by_their_slowest_stage():
    """Llama 3 8B's 32 layers over pp 3 (Megatron's 11 + 11 + 10, --decoder-last-pipeline-num-layers
    10): the step runs at the pace of the slowest rank, not of 32/3 layers and a third of the LM
    head. One layer's and the head's time come from whole-model runs of 11 and 22 layers on one GPU (c = layers x layer + head)."""
    model = get_preset("llama3-8b")

    def compute(m, pp, **split):
        layout = Parallelism(pp=pp, num_microbatches=8, **split)
        return step_time(m, layout, cluster("h100-sxm", pp, 1)).breakdown["compute"]
    c11, c22 = compute(model.with_(layers=11), 1), compute(model.with_(layers=22), 1)
    layer, head = (c22 - c11) / 11, 2 * c11 - c22
    assert megatron_split(32, 3) == (0, 10)  # the first rank is then a middle one: 11
    split = compute(model, 3, last_stage_layers=10)
    # the last rank, 10 layers and Llama 3's 128K-vocabulary LM head (about 1.9 layers' GEMMs)
    assert head > layer and split == pytest.approx(max(11 * layer, 10 * layer + head), rel=1e-9)
    assert split > 1.02 * (32 / 3 * layer + head / 3)  # the balanced share it replaces


@pytest.mark.parametrize("layers,pp,v,balanced", [(61, 32, 1, False), (61, 4, 4, False), (126, 16, 4, True),
                                                  (27, 4, 1, False)])
def test_the_layout_string_builds_in_megatron_core_what_dtlib_counts(layers, pp, v, balanced):
    """A pipeline_layout split written as --pipeline-model-parallel-layout: Megatron-Core's own
    parser builds every rank's chunks with the layers dtlib places there."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    model = get_preset("deepseek-v3").with_(layers=layers)
    layout = Parallelism(pp=pp, virtual_stages=v, schedule="interleaved" if v > 1 else "1f1b", num_microbatches=pp,
                         pipeline_layout=True, account_for_embedding_and_loss=balanced)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parsed = PipelineParallelLayerLayout.from_str(megatron_layout_string(model, layout), pp)
        parsed.validate_layer_layout(num_layers=layers, mtp_num_layers=None)
        built = [[chunk.count(LayerType.decoder) for chunk in rank] for rank in parsed.layout]  # [pp rank][chunk]
    assert built == [[len(c) for c in s.chunks] for s in pipeline_stages(model, layout)]
