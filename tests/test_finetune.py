"""LoRA adapters: dtlib's count against HF PEFT's own, and the errors for bad values."""
import warnings

import pytest

from dtlib.analytic.comm import nccl_latency

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.finetune import FineTuning, adapter_params, check_targets

LLAMA = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=100, seq=64, activation="swiglu",
             norm="rmsnorm", position="rope", bias=False)
MLA_MOE = dict(layers=3, hidden=64, heads=4, ffn=96, vocab=100, seq=64, activation="swiglu", norm="rmsnorm",
               position="rope", bias=False, moe_experts=4, moe_top_k=2, moe_ffn=32, moe_shared_experts=1,
               moe_dense_layers=1, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
               v_head_dim=8)


def dtlib_adapters(shape: dict, rank: int, targets: tuple[str, ...]) -> float:
    cfg, ft = TransformerConfig(**shape), FineTuning("lora", rank=rank, targets=targets)
    n = dict(cfg.numbers(), **ft.numbers())
    check_targets(ft, n)
    return adapter_params(n)


def peft_adapters(model, rank: int, targets: tuple[str, ...]) -> int:
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=rank, target_modules=list(targets)))
    return wrapped.get_nb_trainable_parameters()[0]


@pytest.mark.parametrize("rank,targets", [(4, ("q_proj", "v_proj")), (8, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                          (2, ("gate_proj", "up_proj", "down_proj")), (1, ("o_proj", "down_proj"))])
def test_llama_adapters_equal_peft(rank, targets):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    hf = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)
    assert dtlib_adapters(LLAMA, rank, targets) == peft_adapters(transformers.LlamaForCausalLM(hf), rank, targets)


@pytest.mark.parametrize("targets", [("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
                                     ("kv_b_proj",), ("o_proj",)])
def test_deepseek_adapters_equal_peft(targets):
    """Multi-head latent attention's matrices in dense and MoE layers. (The MLP targets are compared
    on Llama: HF Transformers 5 stores the routed experts as fused 3-D tensors, whose adapters PEFT
    sizes by its own conversion; dtlib counts one adapter per expert matrix, as on per-expert linear
    layers.)"""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    hf = transformers.DeepseekV3Config(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, n_group=1, topk_group=1)
    ours = dtlib_adapters(MLA_MOE, 2, targets)
    assert ours > 0 and ours == peft_adapters(transformers.DeepseekV3ForCausalLM(hf), 2, targets)


def test_active_adapters_count_top_k_experts():
    ft = FineTuning("lora", rank=2, targets=("down_proj",))
    n = dict(TransformerConfig(**MLA_MOE).numbers(), **ft.numbers())
    per_expert = 2 * (32 + 64)
    # all 4 experts held, 2 active per token, in each of the 2 MoE layers
    assert adapter_params(n) - adapter_params(n, active=True) == 2 * (4 - 2) * per_expert


@pytest.mark.parametrize("kwargs,message", [
    (dict(method="lora", rank=0), "lora_rank must be an integer >= 1, got 0"),
    (dict(method="lora", rank=4, targets=("qkv",)), "lora_targets must be one of"),
    (dict(method="full", rank=4), "lora_rank must be unset unless finetune is 'lora'"),
    (dict(method="partial"), "finetune must be one of"),
])
def test_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FineTuning(**kwargs)


def test_targets_the_model_lacks():
    with pytest.raises(ValueError, match="lora_targets must be matrices this model has: .*got 'k_proj'"):
        dtlib_adapters(MLA_MOE, 2, ("k_proj",))
    gelu = dict(LLAMA, activation="gelu", norm="layernorm")
    with pytest.raises(ValueError, match="got 'gate_proj'"):
        dtlib_adapters(gelu, 2, ("gate_proj",))


# ---- memory, FLOPs, step time and the command line ---------------------------------------------
from dtlib.analytic.flops import flops_report, layers_matmul_params  # noqa: E402
from dtlib.analytic.hardware import cluster  # noqa: E402
from dtlib.analytic.layout import Parallelism  # noqa: E402
from dtlib.analytic.memory import memory_per_gpu  # noqa: E402
from dtlib.analytic.presets import get_preset  # noqa: E402
from dtlib.plan.steptime import step_time  # noqa: E402

SMALL = TransformerConfig(**dict(LLAMA, layers=4, hidden=256, heads=8, kv_heads=4, ffn=512, vocab=1000, seq=256))
LORA = FineTuning("lora", rank=8, targets=("q_proj", "v_proj", "down_proj"))


def small_adapters() -> float:
    return adapter_params(dict(SMALL.numbers(), **LORA.numbers()))


def test_lora_memory_freezes_the_base():
    """ZeRO's 2 + 2 + 12 bytes: the base weights 2 bytes each, the adapters all 16."""
    full = memory_per_gpu(SMALL, precision="zero")
    lora = memory_per_gpu(SMALL, precision="zero", finetune=LORA)
    n, a = SMALL.num_parameters(), small_adapters()
    assert full.parameters == 2 * n and full.gradients == 2 * n and full.optimizer == 12 * n
    assert lora.parameters == 2 * (n + a) and lora.gradients == 2 * a and lora.optimizer == 12 * a
    assert lora.activations == full.activations
    # ZeRO-1 over 4 ranks shards the adapters' optimizer states only
    zero1 = memory_per_gpu(SMALL, Parallelism(dp=4, zero=1), precision="zero", finetune=LORA)
    assert zero1.optimizer == 12 * a / 4 and zero1.parameters == lora.parameters
    assert memory_per_gpu(SMALL, precision="zero", finetune=FineTuning("full")).total == full.total


def test_lora_flops_skip_the_frozen_weight_gradients():
    """Per token: the frozen weights (layers and LM head) 2 x 2W instead of 3 x 2W, plus 3 x 2A of
    the adapters; attention unchanged."""
    full = flops_report(SMALL, 2, recompute="none")
    lora = flops_report(SMALL, 2, recompute="none", finetune=LORA)
    weights = layers_matmul_params(**SMALL.numbers()) + SMALL.hidden * SMALL.vocab
    tokens = 2 * SMALL.seq
    assert lora["model_flops_per_step"] == pytest.approx(
        full["model_flops_per_step"] - tokens * 2 * weights + tokens * 6 * small_adapters(), rel=1e-12)
    assert lora["flops_per_token"] * tokens == pytest.approx(lora["model_flops_per_step"], rel=1e-12)
    assert lora["trainable_parameters"] == small_adapters()


def test_lora_step_has_less_compute_and_adapter_traffic_only():
    """Llama-3-8B, rank 16 on q and v: no weight-gradient GEMMs of the base (a third of them) for a
    few thin adapter GEMMs; the optimizer and the DP reduce touch the adapters only."""
    model, layout, cl = get_preset("llama3-8b"), Parallelism(dp=8, zero=1, num_microbatches=2), cluster("h100-sxm", 1, 8)
    ft = FineTuning("lora", rank=16, targets=("q_proj", "v_proj"))
    full, lora = step_time(model, layout, cl), step_time(model, layout, cl, finetune=ft)
    assert step_time(model, layout, cl, finetune=FineTuning("full")).step_time == full.step_time
    assert 0.6 < lora.breakdown["compute"] / full.breakdown["compute"] < 0.85
    share = adapter_params(dict(model.numbers(), **ft.numbers())) / model.num_parameters()
    # the step's two scalar all-reduces (gradient norm, loss) are latency, the same with or without LoRA
    scalar = 2 * min(nccl_latency("all_reduce", algo, 8, 1, cl.intra, cl.inter) for algo in ("ring", "tree"))
    assert lora.breakdown["optimizer"] - scalar == pytest.approx((full.breakdown["optimizer"] - scalar) * share,
                                                                 rel=1e-3)
    assert lora.breakdown["dp_comm"] <= full.breakdown["dp_comm"]


def run(capsys, *argv):
    from dtlib.cli import main
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("flags,message", [
    (("--finetune", "lora", "--lora-rank", "0"), "--lora-rank must be an integer >= 1"),
    (("--lora-rank", "4"), "--lora-rank given without --finetune lora"),
    (("--finetune", "lora"), "--finetune lora needs --lora-rank"),
    (("--finetune", "lora", "--lora-rank", "4", "--lora-targets", "qkv"), "--lora-targets must be names from"),
    (("--finetune", "lora", "--lora-rank", "4", "--lora-targets", "kv_b_proj"),
     "--lora-targets must be matrices this model has"),
])
@pytest.mark.parametrize("command", ["memory", "flops"])
def test_cli_bad_values_one_line(capsys, command, flags, message):
    code, out, err = run(capsys, command, "llama3-8b", *flags)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


def test_cli_plan_memory_flops_accept_lora(capsys):
    lora = ("--finetune", "lora", "--lora-rank", "16", "--lora-targets", "q_proj,v_proj")
    code, out, _ = run(capsys, "memory", "llama3-8b", "--json", *lora)
    # 6,815,744 adapters x 2 bytes (the megatron stack's bf16 gradients, Megatron-Core's DDP default); the base
    # 8,030,261,248 x 2 bytes
    assert code == 0 and '"gradients": 13631488.0' in out and '"parameters": 16074153984.0' in out
    code, out, _ = run(capsys, "flops", "llama3-8b", *lora)
    assert code == 0 and "6,815,744" in out
    code, out, _ = run(capsys, "plan", "llama3-8b", "--gpus", "8", "--global-batch", "16", "--top", "1",
                       "--tp", "1", "--pp", "1", "--micro-batch", "1", "--zero", "1", "--recompute", "none", *lora)
    assert code == 0 and "training: LoRA rank 16 on q_proj, v_proj" in out


def test_a_lora_plan_takes_the_band_of_the_validated_lora_runs_group(capsys):
    """NeMo 24.07's three LoRA runs on H100 are in the validation: a LoRA plan on H100 gets the band of
    the Megatron runs on Hopper, theirs among them, the same as full training of that job."""
    import json

    job = ("plan", "llama3-8b", "--gpus", "8", "--global-batch", "16", "--top", "1", "--json", "--gpu", "h100-sxm")
    code, out, _ = run(capsys, *job, "--finetune", "lora", "--lora-rank", "8")
    band = json.loads(out)["configs"][0]["band"]["step_time_s"]
    assert code == 0 and band["covered"] is True and band["regime"].startswith("megatron, hopper, dense")
    code, out, _ = run(capsys, *job)
    full = json.loads(out)["configs"][0]["band"]["step_time_s"]
    assert (band["count"], band["regime"]) == (full["count"], full["regime"])


def test_lora_needs_a_shape(capsys):
    with pytest.raises(ValueError, match="finetune must be 'full' for a bare parameter count"):
        memory_per_gpu(7e9, finetune=LORA)
    code, _, err = run(capsys, "flops", "--params", "7e9", "--seq", "1024", "--finetune", "lora", "--lora-rank", "2")
    assert code == 2 and "--finetune must be 'full' for a bare parameter count" in err
