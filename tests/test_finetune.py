"""LoRA adapters: dtlib's count against HF PEFT's own, and the errors for bad values."""
import warnings

import pytest

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
    (dict(method="full", rank=4), "lora_rank must be unset without finetune='lora'"),
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
