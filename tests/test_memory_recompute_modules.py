"""Megatron-Core's selective recompute modules (``--recompute-modules``) and the memory of the
Megatron-Bridge 25.11 rows that ran with them (issue 26, item 6: memory that admits what ran).

Each module's bytes are counted by hand from Megatron-Core 0.16's code on a toy layer small enough
to add up on paper: sequence 8, micro-batch 1, hidden 16, 2 heads, BF16 (2 bytes), tp 1."""
import json

import pytest

from dtlib.analytic.activations import RECOMPUTE_MODULES, recompute_module_bytes, stored_layer_bytes
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import GiB, memory_per_gpu
from dtlib.cli import main
from dtlib.plan.published import pending_runs
from dtlib.plan.validation import predict

# the toy layer: MLA (q/kv latents 6/4, nope/rope 3/1, v 2), 4 experts, top-2, expert FFN 8, SwiGLU
TOY = dict(seq=8, micro_batch_size=1, hidden=16, heads=2, kv_heads=2, ffn=32, swiglu=True, dropout=False,
           act_bytes=2, experts=4, top_k=2, moe_ffn=8, q_lora_rank=6, kv_lora_rank=4, qk_nope_head_dim=3,
           qk_rope_head_dim=1, v_head_dim=2)
TOKENS = 8  # s x b
DENSE_GQA = dict(TOY, experts=0, q_lora_rank=0, kv_lora_rank=0)


@pytest.mark.parametrize("module,shape,options,hand", [
    # the pre-MLP TENorm's output of an MoE layer (8 x 16 x 2) + MLA's input TENorm output (same size)
    ("layernorm", TOY, {}, TOKENS * 16 * 2 + TOKENS * 16 * 2),
    # ... the latter is the down-projections' input, cached in FP8 (1 byte) as counted there
    ("layernorm", TOY, {"fp8_inputs": True}, TOKENS * 16 * 2 + TOKENS * 16 * 1),
    # a dense GQA layer fuses both norms into its GEMMs (TELayerNormColumnParallelLinear): nothing
    ("layernorm", DENSE_GQA, {}, 0),
    # decompressed Q and K (2 heads x (3 + 1)) and V (2 heads x 2), 2 bytes
    ("mla_up_proj", TOY, {}, TOKENS * 2 * (4 + 4 + 2) * 2),
    ("mla_up_proj", DENSE_GQA, {}, 0),
    # FC2's input of each of the 2 routed copies (8 wide); fused SwiGLU keeps FC1's output
    ("moe_act", TOY, {"fused_swiglu": True}, 2 * TOKENS * 8 * 2),
    # eager SwiGLU also keeps silu(gate), recomputed too
    ("moe_act", TOY, {"fused_swiglu": False}, 2 * TOKENS * 8 * 2 * 2),
    # FP8: FC2's cached input is 1 byte per element
    ("moe_act", TOY, {"fused_swiglu": True, "fp8_inputs": True}, 2 * TOKENS * 8 * 1),
    # dense MLP: its input (the fused norm's output, 16 wide), FC1's output (2 x 32), FC2's input (32)
    ("mlp", DENSE_GQA, {"fused_swiglu": True}, TOKENS * (16 + 64 + 32) * 2),
    ("mlp", TOY, {"fused_swiglu": True}, 0),  # MoE layers: "moe" is their module
    # whole MoE block: per routed copy its h-wide input, FC1's output (16) and FC2's input (8)
    ("moe", TOY, {"fused_swiglu": True}, 2 * TOKENS * (16 + 16 + 8) * 2),
    # one shared expert (8 wide): FC1's output and FC2's input
    ("shared_experts", dict(TOY, shared_experts=1), {"fused_swiglu": True}, TOKENS * (16 + 8) * 2),
    # FlashAttention-style attention stores no scores: core_attn frees nothing ...
    ("core_attn", DENSE_GQA, {"flash_attention": True}, 0),
    # ... explicit attention's 2 heads x 8 x 8 softmax outputs, 2 bytes (no dropout)
    ("core_attn", DENSE_GQA, {"flash_attention": False}, 2 * 8 * 8 * 2),
])
def test_each_module_drops_what_megatron_core_discards(module, shape, options, hand):
    assert recompute_module_bytes(module, **options, **shape) == hand
    kept = stored_layer_bytes("none", **options, **shape)
    assert kept - stored_layer_bytes("none", recompute_modules=(module,), **options, **shape) == hand


def test_modules_add_up_and_sequence_parallel_shards_them():
    both = stored_layer_bytes("none", recompute_modules=("layernorm", "moe_act"), fused_swiglu=True, **TOY)
    each = sum(recompute_module_bytes(m, fused_swiglu=True, **TOY) for m in ("layernorm", "moe_act"))
    assert stored_layer_bytes("none", fused_swiglu=True, **TOY) - both == each
    # tp 2 with SP: the norm outputs are sequence-sharded, the FFN tensors column-split
    sharded = dict(TOY, tp=2, sequence_parallel=True)
    for module in ("layernorm", "moe_act", "mla_up_proj"):
        assert recompute_module_bytes(module, **sharded) == recompute_module_bytes(module, **TOY) / 2


def test_bad_modules_are_refused_with_the_valid_names(capsys):
    with pytest.raises(ValueError, match="recompute_modules: unknown 'moe_mlp'; valid: core_attn, moe_act"):
        Parallelism(recompute_modules=("moe_mlp",))
    with pytest.raises(ValueError, match="needs recompute 'none' or 'selective', got 'full'"):
        Parallelism(recompute="full", recompute_modules=("moe_act",))
    assert Parallelism(recompute_modules=["moe_act", "moe_act"]).recompute_modules == ("moe_act",)
    for argv, message in [
        (["memory", "--model", "llama3-8b", "--recompute-modules", "moe_act,attn"],
         "--recompute-modules: unknown 'attn'; valid: " + ", ".join(RECOMPUTE_MODULES)),
        (["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--recompute", "op",
          "--recompute-modules", "layernorm"], "needs recompute 'none' or 'selective', got 'op'"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_memory_and_plan_agree_with_modules(capsys):
    """The same MoE layout, recomputing moe_act and layernorm, in both commands and the API."""
    flags = ["--model", "qwen3-30b-a3b", "--seq", "4096", "--tp", "1", "--pp", "1", "--cp", "1", "--ep", "8",
             "--etp", "1", "--zero", "1", "--micro-batch", "1", "--recompute", "none",
             "--recompute-modules", "moe_act,layernorm"]
    assert main(["memory", *flags, "--dp", "8", "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["per_gpu"]["total"]
    assert main(["plan", *flags, "--gpus", "8", "--global-batch", "8", "--virtual-stages", "1", "--gpu", "b200",
                 "--no-sequence-parallel", "--headroom", "1", "--json"]) == 0
    (config,) = json.loads(capsys.readouterr().out)["configs"]
    layout = Parallelism(dp=8, ep=8, zero=1, recompute_modules=("moe_act", "layernorm"))
    assert config["memory_per_gpu_bytes"] == mem == memory_per_gpu("qwen3-30b-a3b", layout, seq=4096,
                                                                   precision="bf16-mixed").total
    assert mem < memory_per_gpu("qwen3-30b-a3b", layout.with_(recompute_modules=()), seq=4096,
                                precision="bf16-mixed").total


def _published_memory(run, **changes) -> float:
    """Bytes per GPU of the row's published layout, as the planner counts them (memory_per_gpu)."""
    lay = dict(run.layout, **changes)
    vp = lay["virtual_stages"]
    layout = Parallelism(
        dp=lay["dp"], tp=lay["tp"], pp=lay["pp"], cp=lay["cp"], ep=lay["ep"], etp=lay["etp"], zero=lay["zero"],
        sequence_parallel=bool(lay["sequence_parallel"]), schedule="interleaved" if vp > 1 else "1f1b",
        virtual_stages=vp, micro_batch_size=lay["micro_batch_size"],
        num_microbatches=run.global_batch // (lay["dp"] * lay["micro_batch_size"]),
        recompute_layers=lay.get("recompute_layers"), activation_offload_layers=lay.get("activation_offload_layers"),
        account_for_embedding_and_loss=lay.get("account_for_embedding_and_loss", False),
        recompute_modules=lay.get("recompute_modules", ()), pipeline_layout=lay.get("pipeline_layout", False),
        first_stage_layers=lay.get("first_stage_layers"), last_stage_layers=lay.get("last_stage_layers"))
    return memory_per_gpu(run.model, layout, precision=run.precision, stack=run.stack, dtype=run.dtype).total


PENDING = {run.name: run for run in pending_runs()}
# the row whose table contradicts itself (docs/validation.md, "Memory of the Megatron-Bridge 25.11
# rows"): MBS 4 at PP 4 (DP 16) on 80 GiB H100s means GA 512 / (4 x 16) = 8, but its GA column says 2.
# It is timed at the recipe file's MBS 1 (GPT_OSS_120B_H100_BF16_BASE_CONFIG).
SHORT = "GPT OSS 120B BF16, 64 x H100 (Megatron-Bridge 25.11)"


@pytest.mark.parametrize("name", PENDING)
def test_every_pending_row_fits_its_gpu(name):
    run = PENDING[name]
    assert _published_memory(run) <= run.cluster.gpu.memory_bytes
    if name == SHORT:
        assert run.layout["micro_batch_size"] == 1 and "contradicts its own GA column" in run.note
        assert _published_memory(run) / GiB == pytest.approx(51.4, abs=0.05)
        assert _published_memory(run, micro_batch_size=4) / GiB == pytest.approx(94.6, abs=0.05)  # the table's


def test_the_planner_counts_the_same_bytes_for_a_recipe_row():
    """Llama 3 70B on GB200: Megatron FSDP with 40 of 80 layers' activations offloaded to CPU."""
    run = PENDING["LLAMA3_70B FP8-CS, 64 x GB200 (Megatron-Bridge 25.11)"]
    row = predict(run, rank=False)
    assert row["fits"] and row["memory_gib"] * GiB == _published_memory(run)
    assert _published_memory(run, activation_offload_layers=None) > run.cluster.gpu.memory_bytes


def test_megatron_flags_carry_the_modules_and_other_frameworks_refuse_them():
    from dtlib.analytic.presets import get_preset
    from dtlib.plan.emit import megatron_flags, unsupported

    qwen = get_preset("qwen3-30b-a3b")
    layout = Parallelism(dp=8, ep=8, recompute_modules=("moe_act", "layernorm"))
    flags = " ".join(megatron_flags(layout, qwen, 8))
    assert "--recompute-granularity selective --recompute-modules moe_act layernorm" in flags
    selective = " ".join(megatron_flags(layout.with_(recompute="selective"), qwen, 8))
    assert "--recompute-modules core_attn moe_act layernorm" in selective
    assert unsupported("megatron", layout, qwen, 8) == []
    assert "recompute_modules is not emitted for deepspeed" in unsupported("deepspeed", layout, qwen, 8)
