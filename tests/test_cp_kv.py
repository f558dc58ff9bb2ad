"""Context-parallel K/V traffic from the real K/V widths: GQA's kv_heads x head_dim and MLA's
decompressed per-head K (nope + rope) and V (Megatron-Core ``MLASelfAttention``), the same bytes in
``dtlib comm`` (strategy_volumes) and in ``dtlib plan`` (the step time's cp_comm term)."""
import json

import pytest

from dtlib.analytic.comm import collective_time, cp_kv_width, strategy_volumes
from dtlib.analytic.hardware import cluster
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.cli import main
from dtlib.plan.steptime import StepOptions, step_time


@pytest.mark.parametrize("preset,width", [
    ("llama3-8b", 2 * 8 * 128),                        # 8 KV heads of 128
    ("qwen3-30b-a3b", 2 * 4 * 128),                    # head_dim 128 although hidden/heads = 64
    ("deepseek-v3", 128 * (128 + 64 + 128)),           # every head: K nope + rope, V
])
def test_kv_width_per_token_written_out(preset, width):
    assert cp_kv_width(**get_preset(preset).numbers()) == width


@pytest.mark.parametrize("preset,tp,cp", [("qwen3-30b-a3b", 2, 2), ("deepseek-v3", 1, 4), ("llama3-8b", 4, 2)])
def test_comm_and_plan_pass_the_same_cp_bytes(preset, tp, cp, capsys):
    cfg = get_preset(preset)
    layout = Parallelism(dp=8 // (tp * cp), tp=tp, cp=cp, micro_batch_size=1, num_microbatches=2,
                         sequence_parallel=tp > 1)
    ring = strategy_volumes(cfg, layout)["cp_kv"]
    # b x s tokens x width x 2 bytes / tp
    assert ring["bytes"] == cfg.seq * cp_kv_width(**cfg.numbers()) * 2 / tp
    cl = cluster("h100-sxm", 1, 8)
    timed = step_time(cfg, layout, cl, options=StepOptions(cp_overlap=0.0)).breakdown["cp_comm"]
    assert timed == pytest.approx(ring["calls"] * collective_time("all_gather", ring["bytes"], cp, cl.intra), rel=1e-12)
    # the CLI reports the same volume
    assert main(["comm", "--model", preset, "--tp", str(tp), "--cp", str(cp), "--dp", str(8 // (tp * cp)),
                 "--micro-batch", "1", "--microbatches", "2", "--json"]
                + (["--sequence-parallel"] if tp > 1 else [])) == 0
    assert json.loads(capsys.readouterr().out)["volumes"]["cp_kv"]["bytes"] == ring["bytes"]
