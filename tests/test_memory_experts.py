"""Expert parameters' ZeRO / distributed-optimizer state is sharded over Megatron-Core's
expert-data-parallel group, ``edp = tp x cp x dp / (etp x ep)`` (MoE parallel folding,
``parallel_state.initialize_model_parallel``), not over ``dp x cp / ep``; ``dtlib memory``,
``dtlib plan`` and ``memory_per_gpu`` count it alike."""
import json

import pytest

from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import memory_per_gpu, model_state_bytes, stage_parameters
from dtlib.analytic.precision import get_precision
from dtlib.analytic.presets import get_preset
from dtlib.cli import main

DSV3 = get_preset("deepseek-v3")
# one routed expert of DeepSeek-V3: SwiGLU's gate, up and down projections, h = 7168, expert FFN
# 2048, no biases (HF config: hidden_size, moe_intermediate_size)
EXPERT = 3 * 7168 * 2048
MOE_LAYERS = 58          # 61 layers, the first 3 dense (first_k_dense_replace = 3)
ROUTED = 256             # n_routed_experts


@pytest.mark.parametrize("etp, edp", [(1, 4), (2, 2)])
def test_deepseek_v3_expert_state_by_hand(etp, edp):
    """tp 2, dp 16, one stage (32 GPUs), ep 8, ZeRO-3 ("zero" precision: 2 + 2 + 12 bytes):
    each GPU holds 256 / 8 = 32 experts of 58 MoE layers, each split etp ways, and the same shard
    sits on edp = 2 x 16 / (etp x 8) ranks (4 with etp 1, 2 with etp 2), which share its states.
    The old count divided by dp / ep = 2 ranks: twice the optimizer bytes with etp 1."""
    layout = Parallelism(dp=16, tp=2, ep=8, etp=etp, zero=3, sequence_parallel=True)
    held = MOE_LAYERS * (ROUTED // 8) * EXPERT // etp        # expert parameters on one GPU
    assert held == {1: 81_738_596_352, 2: 40_869_298_176}[etp]
    dense = stage_parameters(**(DSV3.numbers() | layout.numbers()))["first"]["dense"]
    m = memory_per_gpu(DSV3, layout)
    assert m.optimizer == pytest.approx(12 * (dense / 16 + held / edp), rel=1e-12)
    assert m.gradients == pytest.approx(2 * (dense / 16 + held / edp), rel=1e-12)
    assert m.parameters == pytest.approx(2 * (dense / 16 + held / edp), rel=1e-12)
    # the stage's 32 GPUs hold every routed expert's optimizer state exactly once, whatever etp
    expert_optimizer = m.optimizer - 12 * dense / 16
    assert 32 * expert_optimizer == pytest.approx(12 * MOE_LAYERS * ROUTED * EXPERT, rel=1e-12)


def test_expert_shard_group_is_edp_and_a_partial_optimizer_shrinks_it():
    """model_state_bytes alone: dp x cp = 16 replicas, tp 2, ep 8. Full sharding: edp = 4 (etp 1),
    2 (etp 2), 1 (etp 4 = no sharding left). Two distributed-optimizer instances (shard_size 8,
    Megatron-Core ``num_distributed_optimizer_instances``) shard experts over edp / 2 ranks."""
    prec = get_precision("zero")
    for shard_size, etp, ranks in ((16, 1, 4), (16, 2, 2), (16, 4, 1), (8, 1, 2), (8, 2, 1)):
        st = model_state_bytes(0, 1200.0, 0, prec, zero=1, shard_size=shard_size, ep=8, tp=2, etp=etp)
        assert st["optimizer"] == 12 * 1200.0 / ranks, (shard_size, etp)
        assert st["parameters"] == 2 * 1200.0 and st["gradients"] == 2 * 1200.0  # ZeRO-1: only the optimizer


def test_memory_plan_and_the_api_agree_on_an_moe_layout(capsys):
    """DeepSeek-V3 at tp 2, ep 8, etp 1, pp 8 on 256 GPUs (61 layers: Megatron's uneven 7 + 6 x 8 + 6):
    the three give the same bytes."""
    layout_flags = ["--model", "deepseek-v3", "--tp", "2", "--pp", "8", "--dp", "16", "--ep", "8", "--etp", "1",
                    "--zero", "1", "--recompute", "full", "--sequence-parallel", "--micro-batch", "1",
                    "--virtual-stages", "1", "--first-stage-layers", "7", "--last-stage-layers", "6"]
    assert main(["memory", *layout_flags, "--microbatches", "4", "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)
    assert main(["plan", *layout_flags, "--cp", "1", "--gpus", "256", "--global-batch", "64", "--gpu", "h200",
                 "--headroom", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    layout = Parallelism(dp=16, tp=2, pp=8, ep=8, zero=1, recompute="full", sequence_parallel=True,
                         num_microbatches=4, first_stage_layers=7, last_stage_layers=6)
    api = memory_per_gpu(DSV3, layout, precision="bf16-mixed").total
    assert plan["configs"][0]["memory_per_gpu_bytes"] == api == mem["per_gpu"]["total"]
