"""Mixture-of-experts, multi-head latent attention, head_dim and sliding-window models: their
parameter counts against published totals, which layers are MoE, the checks on bad fields, and
the command-line flags that describe them (docs/models.md)."""
import json

import pytest

from dtlib.analytic import validate
from dtlib.analytic.config import TransformerConfig, attention_params
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import PRESETS, get_preset
from dtlib.cli import build_parser, main
from dtlib.cli.args import model_from_args
from dtlib.plan.emit import megatron_flags, unsupported

# Published total and active parameters, in billions, as each source writes them, and whether
# the source's active count includes the input embedding table (docs/models.md, "Active").
# A published figure is rounded or truncated to its last digit, so dtlib's count must lie within
# one unit of that digit (``unit``); the residuals below that are left out of dtlib's description
# are all far smaller than that unit.
PUBLISHED = {
    # Mistral AI: 7,241,732,096 exactly (HF safetensors total): nothing is left out.
    "mistral-7b": (7.241732096, 7.241732096, True, 1e-9),
    # Mixtral release: 46.7B / 12.9B (the paper rounds to 47B / 13B).
    "mixtral-8x7b": (46.7, 12.9, True, 0.1),
    # Mixtral 8x22B release post: 141B total, 39B active (whole billions).
    "mixtral-8x22b": (141.0, 39.0, True, 1.0),
    # DeepSeek-V2 App. B: 15.7B / 2.4B; active without the input embedding (as DeepSeek counts).
    "deepseek-v2-lite": (15.7, 2.4, False, 0.1),
    # DeepSeek-V3 README_WEIGHTS: main model 671B, 36.6B active incl. the 0.9B output head (the
    # 11.5B MTP module is not part of the model here). Left out: the router's 256-entry
    # e_score_correction_bias per MoE layer (58 x 256 = 14,848).
    "deepseek-v3": (671.0, 36.6, False, 0.1),
    # Qwen3 model cards: 30.5B / 3.3B and 235B / 22B. Left out: the q/k RMSNorms, 2 x head_dim
    # per layer (48 x 256 = 12,288 and 94 x 256 = 24,064).
    "qwen3-30b-a3b": (30.5, 3.3, True, 0.1),
    "qwen3-235b-a22b": (235.0, 22.0, True, 1.0),
    # gpt-oss model card Table 1: 116.83B total, 5.13B active (no input embedding). Left out: the
    # attention sinks (64 per layer) and the router bias (128 per layer): 36 x 192 = 6,912.
    "gpt-oss-120b": (116.83, 5.13, False, 0.01),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_preset_counts_match_published_totals_and_actives(name):
    total, active, input_embedding, unit = PUBLISHED[name]
    cfg = get_preset(name)
    assert cfg.source
    assert abs(cfg.num_parameters() / 1e9 - total) < unit
    assert abs(cfg.active_parameters(input_embedding=input_embedding) / 1e9 - active) < unit


def test_exact_published_totals():
    # Mixtral's HF checkpoint holds 46,702,792,704 parameters: every tensor is in the description
    assert get_preset("mixtral-8x7b").num_parameters() == 46_702_792_704
    # gpt-oss-120b's card gives 116.83B: every tensor, the 36 x 64 sinks and 36 x 128 router biases
    # included (torchtitan 0.2.2's gpt_oss 120b builds the same count: tests/test_frameworks_configs_matrix.py)
    assert get_preset("gpt-oss-120b").num_parameters() == 116_829_156_672
    # Qwen3's q/k RMSNorms of head_dim 128: 48 x 256 of the 30,532,122,624 torchtitan's qwen3 builds
    qwen = get_preset("qwen3-30b-a3b")
    assert qwen.num_parameters() - qwen.with_(qk_norm=False).num_parameters() == 48 * 256


def test_mla_attention_is_the_sum_of_deepseek_v3_weight_shapes():
    """One DeepSeek-V3 attention block from its checkpoint's tensor shapes (HF
    model.layers.0.self_attn.*): q_a_proj 1536x7168, q_a_layernorm 1536, q_b_proj 24576x1536,
    kv_a_proj_with_mqa 576x7168, kv_a_layernorm 512, kv_b_proj 32768x512, o_proj 7168x16384."""
    shapes = [(1536, 7168), (1536, 1), (24576, 1536), (576, 7168), (512, 1), (32768, 512), (7168, 16384)]
    cfg = get_preset("deepseek-v3")
    by_shape = sum(rows * cols for rows, cols in shapes)
    assert attention_params(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.bias, cfg.head_dim, cfg.q_lora_rank,
                            cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim) == by_shape
    # DeepSeek-V2-Lite has no query compression: q_proj 3072x2048 replaces q_a/q_a_layernorm/q_b
    lite = get_preset("deepseek-v2-lite")
    lite_shapes = [(3072, 2048), (576, 2048), (512, 1), (16 * 256, 512), (2048, 16 * 128)]
    assert lite.layer_parameters() - lite.layer_parameters(moe=False) == (
        (64 + 2) * 3 * 2048 * 1408 + 2048 * 64 - 3 * 2048 * 10944)
    assert attention_params(2048, 16, 16, False, 192, 0, 512, 128, 64, 128) == sum(r * c for r, c in lite_shapes)


def test_head_dim_widens_q_and_o():
    """Qwen3-30B-A3B: q_proj 4096x2048, k_proj and v_proj 512x2048, o_proj 2048x4096 (32 heads x
    128 = 4096 != hidden 2048)."""
    cfg = get_preset("qwen3-30b-a3b")
    assert cfg.head_dim == 128 and cfg.hidden // cfg.heads == 64
    assert attention_params(cfg.hidden, cfg.heads, cfg.kv_heads, False, cfg.head_dim) == \
        4096 * 2048 + 2 * 512 * 2048 + 2048 * 4096


@pytest.mark.parametrize("layers, dense, freq, expected", [
    (61, 3, 1, 58),   # DeepSeek-V3: first_k_dense_replace 3
    (8, 0, 2, 4),     # Megatron --moe-layer-freq 2: layers 0, 2, 4, 6
    (10, 3, 2, 4),    # after 3 dense layers every 2nd: 3, 5, 7, 9
    (9, 0, 4, 3),     # 0, 4, 8
])
def test_moe_layers(layers, dense, freq, expected):
    cfg = TransformerConfig(layers=layers, hidden=64, heads=4, vocab=100, seq=16, moe_experts=4,
                            moe_top_k=2, moe_dense_layers=dense, moe_layer_freq=freq)
    assert cfg.moe_layers == expected
    dense_block, moe_block = cfg.layer_parameters(moe=False), cfg.layer_parameters(moe=True)
    assert cfg.num_parameters() == (cfg.embedding_parameters() + cfg.head_parameters()
                                    + (layers - expected) * dense_block + expected * moe_block)


def test_shared_experts_count_as_active_and_total():
    base = dict(layers=2, hidden=64, heads=4, vocab=100, seq=16, ffn=256, moe_experts=8, moe_top_k=2,
                moe_ffn=32, activation="swiglu", bias=False)
    plain, shared = TransformerConfig(**base), TransformerConfig(**base, moe_shared_experts=2)
    expert = 3 * 64 * 32
    assert shared.num_parameters() - plain.num_parameters() == 2 * 2 * expert
    assert shared.active_parameters() - plain.active_parameters() == 2 * 2 * expert
    assert plain.num_parameters() - plain.active_parameters() == 2 * 6 * expert


def test_sliding_layers():
    assert get_preset("gpt-oss-120b").sliding_layers == 18       # alternating
    assert get_preset("mistral-7b").sliding_layers == 32         # every layer
    gemma_like = get_preset("llama3-8b").with_(sliding_window=1024, global_attention_every=6)
    assert gemma_like.sliding_layers == 32 - 5                   # layers 5, 11, ..., 29 global
    assert gemma_like.num_parameters() == get_preset("llama3-8b").num_parameters()


def test_with_rederives_defaults():
    llama = get_preset("llama3-8b")
    assert llama.with_(hidden=8192, heads=64).head_dim == 128
    assert llama.with_(heads=64).head_dim == 64
    qwen = get_preset("qwen3-30b-a3b")
    assert qwen.with_(hidden=4096).head_dim == 128                # given, so kept
    dense = get_preset("mixtral-8x7b").with_(moe_experts=0, moe_top_k=0)
    assert dense.moe_layers == 0 and dense.moe_ffn is None
    assert get_preset("mixtral-8x7b").with_(ffn=1024).moe_ffn == 1024
    deepseek = get_preset("deepseek-v3")
    assert deepseek.with_(qk_rope_head_dim=32).head_dim == 160
    assert deepseek.with_(kv_lora_rank=0, q_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0,
                          v_head_dim=0).head_dim == 7168 // 128


BASE = dict(layers=4, hidden=64, heads=4, vocab=100, seq=16)
MOE = dict(BASE, moe_experts=4, moe_top_k=2)
MLA = dict(BASE, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
BAD = [
    (dict(BASE, moe_ffn=32), "moe_ffn must be unset \\(None\\) for a dense model"),
    (dict(BASE, moe_shared_experts=1), "moe_shared_experts must be 0 for a dense model"),
    (dict(BASE, moe_capacity_factor=1.0), "moe_capacity_factor must be unset \\(None\\) for a dense model"),
    (dict(MOE, moe_dense_layers=4), "moe_dense_layers must be an integer from 0 to 3, got 4"),
    (dict(MOE, moe_layer_freq=0), "moe_layer_freq must be an integer from 1 to 4, got 0"),
    (dict(MOE, moe_capacity_factor=0.0), "moe_capacity_factor must be a finite number > 0, got 0.0"),
    (dict(MOE, moe_capacity_factor=float("nan")), "moe_capacity_factor must be a finite number > 0"),
    (dict(MOE, moe_shared_experts=-1), "moe_shared_experts must be an integer >= 0, got -1"),
    (dict(MOE, moe_ffn=0), "moe_ffn must be an integer >= 1, got 0"),
    (dict(BASE, head_dim=0), "head_dim must be an integer >= 1, got 0"),
    (dict(BASE, position="rope", head_dim=15), "rope needs an even head dimension, got head_dim = 15"),
    (dict(BASE, q_lora_rank=8), "q_lora_rank must be 0 without multi-head latent attention"),
    (dict(BASE, v_head_dim=8), "v_head_dim must be 0 without multi-head latent attention"),
    (dict(MLA, v_head_dim=0), "v_head_dim must be an integer >= 1, got 0"),
    (dict(MLA, kv_heads=2), "kv_heads must be equal to heads \\(4\\) with multi-head latent attention"),
    (dict(MLA, head_dim=16), "head_dim must be qk_nope_head_dim \\+ qk_rope_head_dim = 24"),
    (dict(MLA, kv_lora_rank=-1), "kv_lora_rank must be an integer >= 0, got -1"),
    (dict(MLA, position="rope", qk_rope_head_dim=7), "rope needs an even head dimension, got qk_rope_head_dim = 7"),
    (dict(BASE, sliding_window=-1), "sliding_window must be an integer >= 0, got -1"),
    (dict(BASE, global_attention_every=2), "global_attention_every must be 0 without a sliding window"),
    (dict(BASE, sliding_window=8, global_attention_every=5),
     "global_attention_every must be an integer from 0 to 4, got 5"),
]


@pytest.mark.parametrize("fields, message", BAD)
def test_bad_fields_name_the_field_and_the_valid_range(fields, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**fields)


def test_active_parameters_checks_its_flag():
    with pytest.raises(validate.InvalidArgument, match="input_embedding must be True or False"):
        get_preset("deepseek-v3").active_parameters(input_embedding="no")


def test_emitted_megatron_flags_describe_the_model():
    """Megatron-LM's own names for each field (arguments.py): DeepSeek-V3 as its Megatron recipes
    write it, GPT-OSS's window and global layers, Qwen3's head size; frameworks whose emitted
    model has no such fields refuse instead of emitting another model."""
    def flags(name, **layout):
        f = megatron_flags(Parallelism(dp=8, **layout), get_preset(name), 8)
        return " ".join(f)
    deepseek = flags("deepseek-v3", ep=8)
    for expected in ("--num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048",
                     "--moe-shared-expert-intermediate-size 2048", "--moe-layer-freq ([0]*3+[1]*58)",
                     "--multi-latent-attention --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 "
                     "--v-head-dim 128 --q-lora-rank 1536", "--expert-model-parallel-size 8"):
        assert expected in deepseek
    # GPT-OSS's YaRN is refused by name (Megatron-LM's --rope-type yarn is MLA's); its window is written
    assert "rope_scaling yarn without MLA" in unsupported("megatron", Parallelism(dp=8), get_preset("gpt-oss-120b"), 8)[0]
    no_yarn = get_preset("gpt-oss-120b").with_(rope_scaling="none", rope_scaling_factor=1.0)
    assert "--window-size 128,0 --window-attn-skip-freq 2" in " ".join(megatron_flags(Parallelism(dp=8), no_yarn, 8))
    assert "--kv-channels 128" in flags("qwen3-30b-a3b")
    every_other = get_preset("mixtral-8x7b").with_(layers=4, moe_layer_freq=2, moe_capacity_factor=1.25)
    f = " ".join(megatron_flags(Parallelism(dp=8), every_other, 8))
    assert "--moe-layer-freq [1,0,1,0]" in f and "--moe-expert-capacity-factor 1.25" in f
    # torchtitan builds Qwen3-30B-A3B as its own qwen3 flavor; another shape of it is refused by field
    assert "head_dim" in unsupported("torchtitan", Parallelism(dp=8), get_preset("qwen3-30b-a3b").with_(name="q"), 8)[0]
    assert "sliding_window" in unsupported("jax", Parallelism(dp=8), get_preset("mistral-7b"), 8)[-1]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_flops_prints_total_and_active_parameters(capsys):
    code, out, _ = run(capsys, "flops", "--model", "deepseek-v3")
    assert code == 0
    assert "parameters (total)             671,026,404,352" in out
    assert "parameters (active per token)  37,552,282,624" in out
    code, out, _ = run(capsys, "flops", "--model", "deepseek-v3", "--json")
    assert json.loads(out)["active_parameters"] == get_preset("deepseek-v3").active_parameters()


def test_custom_moe_mla_sliding_model_from_flags(capsys):
    flags = ["--layers", "4", "--hidden", "256", "--heads", "4", "--experts", "8", "--top-k", "2",
             "--expert-ffn", "128", "--shared-experts", "1", "--dense-layers", "1", "--capacity-factor", "1.25",
             "--kv-lora-rank", "64", "--q-lora-rank", "32", "--qk-nope-head-dim", "32",
             "--qk-rope-head-dim", "16", "--v-head-dim", "32", "--sliding-window", "128",
             "--global-attention-every", "2"]
    expected = TransformerConfig(layers=4, hidden=256, heads=4, vocab=50257, seq=2048, moe_experts=8,
                                 moe_top_k=2, moe_ffn=128, moe_shared_experts=1, moe_dense_layers=1,
                                 moe_capacity_factor=1.25, kv_lora_rank=64, q_lora_rank=32,
                                 qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                                 sliding_window=128, global_attention_every=2)
    code, out, _ = run(capsys, "flops", *flags, "--json")
    assert code == 0 and json.loads(out)["parameters"] == expected.num_parameters()
    code, out, _ = run(capsys, "memory", *flags, "--dp", "4", "--ep", "2", "--etp", "2", "--json")
    assert code == 0 and json.loads(out)["per_gpu"]["total"] > 0


def test_flags_on_a_preset_replace_its_values(capsys):
    code, out, _ = run(capsys, "flops", "--model", "llama3-8b", "--experts", "8", "--top-k", "2", "--json")
    assert json.loads(out)["parameters"] == get_preset("llama3-8b").with_(moe_experts=8, moe_top_k=2).num_parameters()
    args = build_parser().parse_args(["memory", "--model", "mixtral-8x7b", "--capacity-factor", "1.25"])
    assert model_from_args(args).moe_capacity_factor == 1.25
    args = build_parser().parse_args(["memory", "--model", "mixtral-8x7b", "--dropless"])
    assert model_from_args(args) == get_preset("mixtral-8x7b")


@pytest.mark.parametrize("argv, message", [
    (("flops", "--layers", "2", "--hidden", "64", "--heads", "4", "--experts", "1"),
     "--experts must be 0 \\(dense\\) or an integer >= 2, got '1'"),
    (("flops", "--layers", "2", "--hidden", "64", "--heads", "4", "--experts", "8", "--top-k", "9"),
     "--top-k must be an integer from 1 to 8 \\(the --experts\\), got 9"),
    (("memory", "--model", "mixtral-8x7b", "--top-k", "9"), "--top-k must be an integer from 1 to 8, got 9"),
    (("memory", "--layers", "2", "--hidden", "64", "--heads", "4", "--experts", "8"), "--experts 8 needs --top-k"),
    (("plan", "--model", "llama3-8b", "--top-k", "2", "--gpus", "8", "--global-batch", "8"),
     "--top-k must be 0 for a dense model \\(set --experts >= 2 for MoE\\), got 2"),
    (("memory", "--model", "deepseek-v3", "--dense-layers", "61"), "--dense-layers must be an integer from 0 to 60, got 61"),
    (("memory", "--model", "deepseek-v3", "--capacity-factor", "0"), "--capacity-factor must be a finite number > 0, got '0'"),
    (("memory", "--model", "deepseek-v3", "--capacity-factor", "1", "--dropless"), "not allowed with argument"),
    (("memory", "--params", "7B", "--experts", "8", "--top-k", "2"), "a bare parameter count \\(--params\\) has none"),
    (("memory", "--layers", "2", "--hidden", "64", "--heads", "4", "--q-lora-rank", "8"),
     "--q-lora-rank must be 0 without multi-head latent attention \\(set --kv-lora-rank > 0"),
    (("memory", "--layers", "2", "--hidden", "64", "--heads", "4", "--sliding-window", "-3"),
     "--sliding-window must be an integer >= 0"),
    (("memory", "--model", "mixtral-8x7b", "--dp", "24", "--ep", "8", "--etp", "3"),
     "expert tensor parallel size etp=3 must divide moe_ffn=14336"),
    (("memory", "--model", "mixtral-8x7b", "--dp", "8", "--ep", "8", "--etp", "2"),
     "ep x etp = 8x2 must divide the 8 GPUs of a pipeline stage"),
])
def test_bad_model_flags_fail_before_anything_runs(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert __import__("re").search(message, err), err


def test_presets_listed_in_help(capsys, monkeypatch):
    # argparse wraps help at the terminal width (COLUMNS) and may break a name at its hyphen
    monkeypatch.setenv("COLUMNS", "400")
    code, out, _ = run(capsys, "flops", "--help")
    assert code == 0
    for name in PUBLISHED:
        assert name in out
    assert "--expert-ffn" in out and "--kv-lora-rank" in out and "--sliding-window" in out
