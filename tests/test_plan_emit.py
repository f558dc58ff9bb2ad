"""A planned layout as each framework's launch config (dtlib.plan.emit): every flag and key for
FSDP, interleaved + SP, CP, EP, offload and fp8 layouts; batch sizes that multiply out; one-line
reasons where a framework cannot express a layout; the torchtitan schema catching wrong keys.
Pure: no framework is imported (tests/test_frameworks_emit.py runs the frameworks' own checks)."""
import json
import tomllib

import pytest

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.plan.emit import (FILENAMES, FRAMEWORKS, JAX_ROLES, TORCHTITAN_SCHEMA, check_torchtitan, deepspeed_config, emit,
                             jax_mesh, megatron_flags, torchtitan_document, torchtitan_toml, unsupported)

LLAMA = get_preset("llama3-8b")    # GQA, SwiGLU, RMSNorm, RoPE, untied, no biases
GPT3 = get_preset("gpt3-175b")     # MHA, GELU, LayerNorm, learned positions, tied, biases
MOE = TransformerConfig(name="moe", layers=8, hidden=1024, heads=16, vocab=32000, seq=4096, moe_experts=8,
                        moe_top_k=2, router_bias=True)  # GPT-style: every linear layer biased, the router too
FSDP = Parallelism(dp=64, zero=3, num_microbatches=8)
INTERLEAVED = Parallelism(dp=4, tp=4, pp=4, zero=1, schedule="interleaved", virtual_stages=2, sequence_parallel=True,
                          num_microbatches=8, recompute="selective")
CP = Parallelism(dp=8, tp=2, cp=2, zero=1, micro_batch_size=2, num_microbatches=4, recompute="full",
                 offload="optimizer")
EP = Parallelism(dp=8, ep=4, zero=1, micro_batch_size=2, num_microbatches=2)

# every flag name below was parsed by Megatron-LM core_v0.16.1's own add_megatron_arguments
# (megatron/training/arguments.py, commit 55ac7082) and its validate_args accepted these layouts'
# flags; a flag outside this set is a typo or an unchecked addition
MEGATRON_FLAGS = {
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--num-layers-per-virtual-pipeline-stage", "--expert-model-parallel-size", "--sequence-parallel",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--use-distributed-optimizer",
    "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--ckpt-format", "--optimizer-cpu-offload",
    "--use-precision-aware-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--micro-batch-size",
    "--global-batch-size", "--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size",
    "--seq-length", "--max-position-embeddings", "--vocab-size", "--group-query-attention", "--num-query-groups",
    "--num-experts", "--moe-router-topk", "--swiglu", "--normalization", "--position-embedding-type",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--bf16", "--fp16", "--fp8-format",
    # _add_moe_args of Megatron-LM's arguments.py (default None: the tensor-parallel size)
    "--expert-tensor-parallel-size",
    # the step-time options (TransformerConfig fields made flags by ArgumentGroupFactory, and
    # _add_training_args / _add_distributed_args): parsed and validated by the same parse_args
    "--tp-comm-overlap", "--cp-comm-type", "--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend",
    "--moe-grouped-gemm",
    "--moe-permute-fusion", "--overlap-moe-expert-parallel-comm", "--no-masked-softmax-fusion",
    "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-bias-swiglu-fusion", "--no-bias-gelu-fusion",
    "--attention-backend", "--fp8-recipe",
    # the model fields (TransformerConfig's rope, norm, router, softmax and activation flags)
    "--norm-epsilon", "--make-vocab-size-divisible-by", "--rotary-base", "--rope-type", "--rotary-scaling-factor",
    "--qk-layernorm", "--moe-router-score-function", "--moe-router-enable-expert-bias",
    "--moe-router-topk-scaling-factor", "--softmax-type", "--activation-func-clamp-value", "--hidden-dropout",
    "--attention-dropout",
    # the plan's BF16 gradient reduction: validate_args of Megatron-LM's arguments.py, 'if
    # args.grad_reduce_in_bf16: args.accumulate_allreduce_grads_in_fp32 = False'
    "--grad-reduce-in-bf16"}


def _parse(flags):
    """Megatron flags as {flag: value, switch: True}, failing on a repeated flag."""
    out, i = {}, 0
    while i < len(flags):
        assert flags[i].startswith("--") and flags[i] not in out, flags[i]
        has_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        out[flags[i]] = flags[i + 1] if has_value else True
        i += 2 if has_value else 1
    return out


@pytest.mark.parametrize("model, layout", [(LLAMA, FSDP), (LLAMA, INTERLEAVED), (LLAMA, CP), (MOE, EP),
                                           (GPT3, Parallelism(dp=8, tp=8, pp=8, num_microbatches=16))])
def test_megatron_flags_are_known_and_the_batch_multiplies_out(model, layout):
    f = _parse(megatron_flags(layout, model, layout.global_batch))
    assert set(f) <= MEGATRON_FLAGS, set(f) - MEGATRON_FLAGS
    tp, pp, cp = (int(f[k]) for k in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                       "--context-parallel-size"))
    data_parallel = layout.gpus // (tp * pp * cp)  # what Megatron-LM derives from the world size
    assert data_parallel == layout.dp
    assert int(f["--global-batch-size"]) == int(f["--micro-batch-size"]) * layout.num_microbatches * data_parallel
    assert [f[k] for k in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size",
                           "--seq-length", "--vocab-size")] == [str(v) for v in (
        model.layers, model.hidden, model.heads, model.ffn, model.seq, model.vocab)]


def test_megatron_fsdp_layout_and_the_llama_shape():
    f = _parse(megatron_flags(FSDP, LLAMA, 512))
    assert f["--use-megatron-fsdp"] and f["--data-parallel-sharding-strategy"] == "optim_grads_params"
    assert f["--ckpt-format"] == "fsdp_dtensor" and "--use-distributed-optimizer" not in f
    assert f["--overlap-grad-reduce"] and f["--overlap-param-gather"]
    assert (f["--micro-batch-size"], f["--global-batch-size"]) == ("1", "512")
    assert f["--group-query-attention"] and f["--num-query-groups"] == "8"
    assert f["--swiglu"] and f["--normalization"] == "RMSNorm" and f["--position-embedding-type"] == "rope"
    assert f["--untie-embeddings-and-output-weights"] and f["--disable-bias-linear"] and f["--bf16"]
    assert _parse(megatron_flags(FSDP.with_(zero=2), LLAMA, 512))["--data-parallel-sharding-strategy"] == "optim_grads"


def test_megatron_interleaved_sequence_parallel_selective_and_zero1():
    f = _parse(megatron_flags(INTERLEAVED, LLAMA, 32))
    assert f["--num-layers-per-virtual-pipeline-stage"] == "4"  # 32 layers / (pp 4 x 2 chunks)
    assert f["--sequence-parallel"] and f["--recompute-granularity"] == "selective"
    assert "--recompute-method" not in f and f["--use-distributed-optimizer"]
    assert "--use-megatron-fsdp" not in f


def test_megatron_context_parallel_full_recompute_offload_and_fp8():
    f = _parse(megatron_flags(CP, LLAMA, 64, "fp8"))
    assert f["--context-parallel-size"] == "2" and "--sequence-parallel" not in f
    assert (f["--recompute-granularity"], f["--recompute-method"], f["--recompute-num-layers"]) == ("full", "uniform", "1")
    assert f["--optimizer-cpu-offload"] and f["--use-precision-aware-optimizer"]
    assert f["--bf16"] and f["--fp8-format"] == "hybrid"


def test_megatron_experts_gpt3_shape_and_no_data_parallel_overlap():
    f = _parse(megatron_flags(EP, MOE, EP.global_batch))
    assert (f["--expert-model-parallel-size"], f["--num-experts"], f["--moe-router-topk"]) == ("4", "8", "2")
    assert f["--expert-tensor-parallel-size"] == "1"  # dtlib's etp, not Megatron-LM's default (tp)
    g = _parse(megatron_flags(Parallelism(tp=8, pp=8, num_microbatches=16), GPT3, 16, "fp16"))
    for absent in ("--untie-embeddings-and-output-weights", "--disable-bias-linear", "--group-query-attention",
                   "--swiglu", "--normalization", "--position-embedding-type", "--overlap-grad-reduce", "--bf16"):
        assert absent not in g, absent
    assert g["--fp16"]


@pytest.mark.parametrize("layout, model, reason", [
    (Parallelism(pp=4, num_microbatches=8, schedule="gpipe"), LLAMA, "schedule gpipe"),
    (Parallelism(dp=4, zero=3, offload="params"), LLAMA, "offload params"),
    (Parallelism(cp=4), LLAMA.with_(seq=4100), "2 x context-parallel-size = 8"),
    (Parallelism(dp=4, zero=3, offload="optimizer"), LLAMA, "offload optimizer with ZeRO-3"),
    (Parallelism(dp=4, tp=2, ep=2), MOE, "MoE with biases at tp=2"),
])
def test_megatron_cannot_express(layout, model, reason):
    (line,) = unsupported("megatron", layout, model, layout.global_batch)
    assert reason in line
    e = emit("megatron", layout, model, layout.global_batch)
    assert (e.text, e.data, e.unsupported) == ("", None, [line])
    with pytest.raises(ValueError, match="megatron cannot express"):
        megatron_flags(layout, model, layout.global_batch)


@pytest.mark.parametrize("layout, model, reason", [
    (Parallelism(pp=4, num_microbatches=8), LLAMA.with_(layers=30),
     "30 layers over pp=4 x virtual_stages=1 is not a split Megatron-LM accepts"),
    (Parallelism(pp=2, virtual_stages=3, schedule="interleaved", num_microbatches=4), LLAMA,
     "32 layers over pp=2 x virtual_stages=3 is not a split Megatron-LM accepts"),
])
def test_splits_megatron_refuses_are_refused_before_anything_is_emitted(layout, model, reason):
    """dtlib.analytic.layout's split rule (Megatron-LM's) refuses the layout for every framework."""
    with pytest.raises(ValueError, match=reason):
        unsupported("megatron", layout, model, layout.global_batch)


def test_deepspeed_config_batch_zero_offload_precision_and_clipping():
    c = deepspeed_config(FSDP, LLAMA, 512)
    assert c["train_batch_size"] == c["train_micro_batch_size_per_gpu"] * c["gradient_accumulation_steps"] * 64 == 512
    assert c["zero_optimization"] == {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}
    assert c["bf16"] == {"enabled": True} and "fp16" not in c
    assert c["gradient_clipping"] == 1.0  # written out, not DeepSpeed's silent default
    assert c["optimizer"]["type"] == "AdamW"
    offload = deepspeed_config(Parallelism(dp=8, zero=3, offload="params", micro_batch_size=2, num_microbatches=4),
                               LLAMA, 64, "fp16")
    z = offload["zero_optimization"]
    assert z["offload_optimizer"]["device"] == z["offload_param"]["device"] == "cpu"
    assert offload["fp16"] == {"enabled": True} and offload["gradient_accumulation_steps"] == 4
    only_optimizer = deepspeed_config(Parallelism(dp=8, zero=1, offload="optimizer"), LLAMA, 8)["zero_optimization"]
    assert "offload_optimizer" in only_optimizer and "offload_param" not in only_optimizer
    assert deepspeed_config(FSDP, LLAMA, 512, gradient_clipping=0.0)["gradient_clipping"] == 0.0
    assert deepspeed_config(Parallelism(dp=2), LLAMA, 2)["zero_optimization"] == {"stage": 0}


def test_deepspeed_with_tensor_parallelism_is_megatron_deepspeeds_json():
    layout = Parallelism(dp=4, tp=2, pp=2, zero=1, num_microbatches=4)
    e = emit("deepspeed", layout, LLAMA, 16)
    assert e.data["train_batch_size"] == 16 == e.data["train_micro_batch_size_per_gpu"] * 4 * layout.dp
    assert any("Megatron-DeepSpeed" in n for n in e.notes)
    assert json.loads(e.text) == e.data


@pytest.mark.parametrize("layout, precision, reason", [
    (INTERLEAVED, "bf16", "schedule interleaved"),
    (Parallelism(dp=2, pp=2, zero=2, num_microbatches=2), "bf16", "ZeRO-2 with pp=2"),
    (Parallelism(dp=2, cp=2), "bf16", "cp=2"),
    (FSDP, "fp8", "precision fp8"),
])
def test_deepspeed_cannot_express(layout, precision, reason):
    reasons = unsupported("deepspeed", layout, LLAMA, layout.global_batch, precision)
    assert len(reasons) == 1 and reason in reasons[0]


def _toml(layout, model=LLAMA, precision="bf16"):
    return tomllib.loads(torchtitan_toml(layout, model, layout.global_batch, precision))


def test_torchtitan_fsdp_and_gradient_accumulation():
    doc = _toml(FSDP)
    assert doc == torchtitan_document(FSDP, LLAMA, 512)  # the TOML writer round-trips
    par, training = doc["parallelism"], doc["training"]
    assert (par["data_parallel_shard_degree"], par["data_parallel_replicate_degree"]) == (64, 1)
    assert (par["tensor_parallel_degree"], par["pipeline_parallel_degree"], par["context_parallel_degree"]) == (1, 1, 1)
    # no pipeline: local batch is one micro-batch, torchtitan accumulates global / (local x dp) = 8 of them
    assert training["global_batch_size"] // (training["local_batch_size"] * 64) == FSDP.num_microbatches
    assert training["seq_len"] == 8192 and doc["model"]["flavor"] == "8B"
    assert doc["activation_checkpoint"] == {"mode": "none"}


def test_torchtitan_pipeline_interleaved_zero2_hsdp_fp8_and_offload():
    layout = Parallelism(dp=4, tp=2, pp=4, zero=2, schedule="interleaved", virtual_stages=2, num_microbatches=8,
                         micro_batch_size=2, sequence_parallel=True, recompute="op")
    doc = _toml(layout, precision="fp8")
    par, training = doc["parallelism"], doc["training"]
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B" and par["pipeline_parallel_layers_per_stage"] == 4
    # torchtitan's split (pipeline_parallel.py): ceil((layers + first_less + last_less) / per_stage)
    # stages; its default 1 + 1 would make 9 stages of 4 for 32 layers, not pp x v = 8
    assert (par["pipeline_parallel_first_stage_less_layers"], par["pipeline_parallel_last_stage_less_layers"]) == (0, 0)
    balanced = _toml(Parallelism(dp=4, pp=2, zero=3, num_microbatches=4, account_for_embedding_and_loss=True))
    assert (balanced["parallelism"]["pipeline_parallel_first_stage_less_layers"],
            balanced["parallelism"]["pipeline_parallel_layers_per_stage"]) == (1, 17)  # (32 + 2) / 2
    assert par["fsdp_reshard_after_forward"] == "never"  # ZeRO-2: PyTorch's SHARD_GRAD_OP
    # pipeline micro-batches: local batch = micro x m, no accumulation
    assert training["local_batch_size"] == par["pipeline_parallel_microbatch_size"] * 8
    assert training["local_batch_size"] * par["data_parallel_shard_degree"] == training["global_batch_size"] == 64
    assert doc["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    # the name float8.py registers (register_model_converter(..., "quantize.linear.float8")), v0.2.2
    assert doc["model"]["converters"] == ["quantize.linear.float8"]
    assert doc["quantize"]["linear"]["float8"] == {"recipe_name": "tensorwise", "filter_fqns": ["output"]}
    hsdp = _toml(Parallelism(dp=16, zero=3, shard_size=8, offload="params"))
    assert (hsdp["parallelism"]["data_parallel_replicate_degree"], hsdp["parallelism"]["data_parallel_shard_degree"]) == (2, 8)
    assert hsdp["training"]["enable_cpu_offload"] is True
    tp_only = _toml(Parallelism(tp=8))  # no data parallelism: neither DDP nor FSDP
    assert (tp_only["parallelism"]["data_parallel_replicate_degree"], tp_only["parallelism"]["tensor_parallel_degree"]) == (1, 8)
    ddp = _toml(Parallelism(dp=8))
    assert (ddp["parallelism"]["data_parallel_replicate_degree"], ddp["parallelism"]["data_parallel_shard_degree"]) == (8, 1)
    assert emit("torchtitan", Parallelism(dp=2, tp=2, zero=3), LLAMA, 2).notes[-1].startswith(
        "torchtitan's tensor parallelism always shards")


@pytest.mark.parametrize("layout, precision, reason", [
    (Parallelism(dp=8, zero=1), "bf16", "ZeRO-1"),
    (Parallelism(dp=4, tp=2), "bf16", "DDP has not supported"),
    (Parallelism(cp=2), "bf16", "ZeRO-0 with cp=2"),
    (Parallelism(dp=4, zero=1, offload="optimizer"), "bf16", "ZeRO-1"),
    (Parallelism(dp=4, zero=3, offload="optimizer"), "bf16", "offload optimizer"),
    (FSDP, "fp16", "precision fp16"),
    (Parallelism(dp=4, zero=3, recompute="selective"), "bf16", "none recomputes attention alone"),
])
def test_torchtitan_cannot_express(layout, precision, reason):
    assert reason in unsupported("torchtitan", layout, LLAMA, layout.global_batch, precision)[0]


@pytest.mark.parametrize("section, key, value, message", [
    ("parallelism", "tensor_parallel_size", 2, "tensor_parallel_size is not a torchtitan key"),
    ("parallelism", "tensor_parallel_degree", "2", "must be int"),
    ("parallelism", "tensor_parallel_degree", True, "must be int"),
    ("parallelism", "pipeline_parallel_schedule", "interleaved", "must be one of"),
    ("activation_checkpoint", "mode", "op", "must be one of"),
    ("training", "max_norm", "1", "must be float"),
    ("model", "converters", "float8", "must be list[str]"),
    ("parallel", "tensor_parallel_degree", 2, "[parallel] is not a torchtitan section"),
])
def test_the_torchtitan_schema_catches_a_wrong_key_or_type(section, key, value, message):
    doc = torchtitan_document(FSDP, LLAMA, 512)
    doc.setdefault(section, {})[key] = value
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_torchtitan(doc)


def test_the_torchtitan_schema_covers_every_emitted_key():
    layouts = [FSDP, INTERLEAVED.with_(zero=2, recompute="op"), Parallelism(dp=16, zero=3, shard_size=8, offload="params"),
               Parallelism(dp=8, ep=4, zero=3, num_microbatches=2)]
    for layout in layouts:
        model = get_preset("qwen3-30b-a3b") if layout.ep > 1 else LLAMA
        check_torchtitan(tomllib.loads(torchtitan_toml(layout, model, layout.global_batch, "fp8")))
    assert set(TORCHTITAN_SCHEMA["parallelism"]) >= {"data_parallel_shard_degree", "data_parallel_replicate_degree",
                                                     "tensor_parallel_degree", "pipeline_parallel_degree",
                                                     "context_parallel_degree", "pipeline_parallel_schedule"}


def test_jax_mesh_axes_and_specs():
    m = jax_mesh(Parallelism(dp=4, tp=2), LLAMA, 4)
    assert m["mesh"] == {"data": 4, "fsdp": 1, "model": 2} and m["batch"] == ["data", None]
    assert list(m["specs"]) == list(m["shapes"]) == list(JAX_ROLES)
    assert m["specs"] == {"embed": ["model", None], "attn.qkv": [None, "model"], "attn.out": ["model", None],
                          "mlp.up": [None, "model"], "mlp.down": ["model", None], "norm": [None],
                          "head": [None, "model"]}
    assert m["shapes"]["attn.qkv"] == [4096, 4096 + 2 * 8 * 128]  # GQA: q + k + v of 8 KV heads
    f = jax_mesh(Parallelism(dp=4, tp=2, zero=3), LLAMA, 4)
    assert f["mesh"] == {"data": 1, "fsdp": 4, "model": 2} and f["batch"] == ["fsdp", None]
    assert f["specs"]["mlp.up"] == ["fsdp", "model"] and f["specs"]["mlp.down"] == ["model", "fsdp"]
    assert f["specs"]["norm"] == ["fsdp"]
    hybrid = jax_mesh(Parallelism(dp=8, zero=3, shard_size=4), LLAMA, 8)
    assert hybrid["mesh"] == {"data": 2, "fsdp": 4, "model": 1} and hybrid["batch"] == [["data", "fsdp"], None]
    notes = emit("jax", Parallelism(dp=4, zero=1), LLAMA, 4).notes
    assert any("ZeRO-1 has no exact GSPMD equivalent" in n for n in notes)
    # each sharded dimension divides by its axes' sizes
    for role, spec in f["specs"].items():
        for dim, axis in zip(f["shapes"][role], spec):
            assert dim % (f["mesh"][axis] if axis else 1) == 0, role


def test_jax_cannot_express_pipelines_context_experts_or_an_indivisible_vocabulary():
    assert "pp=2" in unsupported("jax", Parallelism(pp=2, num_microbatches=2), LLAMA, 2)[0]
    assert "cp=2" in unsupported("jax", Parallelism(cp=2), LLAMA, 1)[0]
    assert "ep=4" in unsupported("jax", EP, MOE, EP.global_batch)[0]
    reasons = unsupported("jax", Parallelism(tp=2), GPT3, 1)  # vocabulary 50257 over model=2
    assert reasons and all("50257" in r for r in reasons)


def test_emit_results_and_bad_input():
    for framework in FRAMEWORKS:
        e = emit(framework, Parallelism(dp=8, zero=3), LLAMA, 8)
        assert e.unsupported == [] and e.text and e.filename == FILENAMES[framework]
        assert e.to_dict()["file"] == FILENAMES[framework]
    with pytest.raises(ValueError, match="global_batch=16 but the layout's .* = 8"):
        emit("megatron", Parallelism(dp=8), LLAMA, 16)
    with pytest.raises(ValueError, match="framework must be one of"):
        emit("mxnet", Parallelism(dp=8), LLAMA, 8)
    with pytest.raises(ValueError, match="precision must be one of"):
        emit("jax", Parallelism(dp=8), LLAMA, 8, "int4")
    with pytest.raises(ValueError, match="tensor parallel size tp=3"):
        emit("jax", Parallelism(tp=3), LLAMA, 1)
    with pytest.raises(ValueError, match="model must be"):
        emit("jax", Parallelism(dp=8), "llama3-8b", 8)


# ---- the timed plan: every step-time option is written or re-timed ------------------------------------
from dataclasses import fields, replace  # noqa: E402

from dtlib.analytic.hardware import cluster  # noqa: E402
from dtlib.plan.emit import TimedPlan  # noqa: E402
from dtlib.plan.emit.timed import retime  # noqa: E402
from dtlib.plan.steptime import StepOptions  # noqa: E402

# the StepOptions fields that describe the hardware or the model of the step, not a framework's
# setting: no config can carry them (the test below checks that the rest is each a config knob)
NOT_CONFIG = {"efficiency", "gemm_efficiency", "attention_efficiency", "power_limit_w", "oversubscription",
              "moe_imbalance", "convention", "attention",
              # what model FLOPs count of packed attention (a counting convention, like attention: no time)
              "packed_flops",
              # the kernels the model launches per layer (counted by dtlib calibrate), and how eager PyTorch /
              # dtlib train handle gradients: the emitted configs keep each framework's own behaviour
              "forward_kernels", "grad_accumulation_fusion", "grad_bucket_copy", "zero3_reduce_per_microbatch",
              "zero3_unit_copies", "zero3_kernels",
              # the vocabulary-parallel loss's all-reduces (3: Megatron-Core's unfused loss, which the emitted
              # Megatron flags keep; 2: dtlib train's): latency of small messages, not emitted
              "cross_entropy_all_reduces"}
# each config knob: two values whose step times differ on the layouts below (dtype; fp8_recipe and
# bf16_layers with fp8 matmuls)
KNOB_VALUES = {"stack": ("megatron", "deepspeed"), "dtype": ("bf16", "fp8"), "precision": ("megatron-bf16", "zero"),
               "dp_overlap": (0.0, 1.0), "tp_overlap": (0.0, 1.0), "cp_overlap": (0.0, 1.0), "ep_overlap": (0.0, 1.0),
               "fused_elementwise": (False, True), "flash_attention": (True, False), "fp8_recipe": ("delayed", "mxfp8"),
               "bf16_layers": (0, 4), "grad_reduce_dtype": ("fp32", "bf16"), "moe_dispatcher": ("alltoall", "flex")}
KNOB_MOE = TransformerConfig(name="moe", layers=8, hidden=4096, heads=32, vocab=32000, seq=4096, moe_experts=16,
                             moe_top_k=2, bias=False)
KNOB_LAYOUTS = {  # each framework's layout with every dimension its config expresses > 1
    "megatron": Parallelism(dp=2, tp=2, pp=2, cp=2, ep=2, zero=1, sequence_parallel=True, schedule="interleaved",
                            virtual_stages=2, num_microbatches=4),
    "deepspeed": Parallelism(dp=8, tp=2, ep=2, zero=1, sequence_parallel=True, num_microbatches=4),
    "torchtitan": Parallelism(dp=4, tp=2, cp=2, ep=8, zero=2, sequence_parallel=True, num_microbatches=8),
}
# a knob that changes neither step time nor memory on a framework's layout, and why
KNOB_IDLE = {("deepspeed", "cp_overlap"): "DeepSpeed refuses cp > 1 (no ring attention)",
             ("deepspeed", "fp8_recipe"): "DeepSpeed refuses fp8 matmuls, so the recipe never applies",
             ("deepspeed", "bf16_layers"): "DeepSpeed refuses fp8 matmuls: no layer to keep in BF16",
             ("torchtitan", "fp8_recipe"): "torchtitan's grouped experts are one kernel whatever the recipe "
                                           "(stack expert_loop False): the recipe's launches never count"}


def test_every_step_option_is_a_config_knob_or_named_as_none():
    assert {f.name for f in fields(StepOptions)} == NOT_CONFIG | set(KNOB_VALUES)


@pytest.mark.parametrize("framework", list(KNOB_LAYOUTS))
@pytest.mark.parametrize("knob", list(KNOB_VALUES))
def test_a_timed_option_is_emitted_or_retimed(framework, knob):
    """Two plans that differ in one option and time differently (step or memory): either their
    configs differ, or the config of one of them runs it otherwise and says so (``retimed``) with
    the step it makes."""
    if (framework, knob) in KNOB_IDLE:
        pytest.skip(KNOB_IDLE[framework, knob])
    layout = KNOB_LAYOUTS[framework]
    cl = cluster("h100-sxm", layout.gpus // 8, 8)
    base = StepOptions(stack={"megatron": "megatron"}.get(framework, framework),
                       dtype="fp8" if knob in ("fp8_recipe", "bf16_layers") and framework != "deepspeed" else "bf16")
    a, b = (replace(base, **{knob: v}) for v in KNOB_VALUES[knob])
    precision = lambda o: o.dtype  # noqa: E731  (fp8 matmuls: the precision flag too)
    model = get_preset("qwen3-30b-a3b") if framework == "torchtitan" else KNOB_MOE  # a torchtitan MoE flavor
    plans = [TimedPlan(layout, model, layout.global_batch, o, precision(o), cl) for o in (a, b)]
    if any(unsupported(framework, p) for p in plans):  # e.g. DeepSpeed has no fp8: refused by name
        assert framework == "deepspeed" and knob in ("dtype", "fp8_recipe")
        return
    ta, tb = (retime(p, p.resolved) for p in plans)
    assert (ta["step_time_s"], ta["memory_per_gpu_bytes"]) != (tb["step_time_s"], tb["memory_per_gpu_bytes"])
    ea, eb = (emit(framework, p) for p in plans)
    # grad_reduce_dtype sets the precision's gradient bytes: a config that keeps its own is re-timed as "precision"
    aliases = {"grad_reduce_dtype": "precision"}
    named = [r for e in (ea, eb) for r in e.retimed
             if r.startswith((f"{knob}:", f"{aliases.get(knob, knob)}:")) or knob == "dtype"]
    assert ea.text != eb.text or named, (knob, ea.retimed, eb.retimed)
    for e, p in zip((ea, eb), plans):  # a config that runs otherwise carries the step it makes
        assert (e.timing is not None) == bool(e.retimed)


# ---- one description of the model: every field reaches every framework's config, or is refused by name ----
DENSE = get_preset("llama3-8b").with_(name="custom")  # a shape no framework ships: nothing comes from a flavor
MOE8 = TransformerConfig(layers=8, hidden=1024, heads=16, vocab=32000, seq=4096, moe_experts=8, moe_top_k=2,
                         activation="swiglu", norm="rmsnorm", position="rope", bias=False)
MLA = get_preset("deepseek-v2-lite").with_(name="custom")
WINDOWED = get_preset("mistral-7b").with_(name="custom")
# each field of TransformerConfig (but its label and source): a base model and another valid value
FIELD_CHANGES = {
    "layers": (DENSE, dict(layers=16)), "hidden": (DENSE, dict(hidden=2048)), "heads": (DENSE, dict(heads=16)),
    "vocab": (DENSE, dict(vocab=32000)), "seq": (DENSE, dict(seq=4096)), "kv_heads": (DENSE, dict(kv_heads=4)),
    "ffn": (DENSE, dict(ffn=11008)), "head_dim": (DENSE, dict(head_dim=256)),
    "activation": (DENSE, dict(activation="gelu")), "tied_embeddings": (DENSE, dict(tied_embeddings=True)),
    "bias": (DENSE, dict(bias=True)), "norm": (DENSE, dict(norm="layernorm")),
    "position": (DENSE, dict(position="learned", rope_theta=10000.0)),
    "moe_experts": (MOE8, dict(moe_experts=16)), "moe_top_k": (MOE8, dict(moe_top_k=1)),
    "moe_ffn": (MOE8, dict(moe_ffn=1024)), "moe_shared_experts": (MOE8, dict(moe_shared_experts=1)),
    "moe_dense_layers": (MOE8, dict(moe_dense_layers=1)), "moe_layer_freq": (MOE8, dict(moe_layer_freq=2)),
    "moe_capacity_factor": (MOE8, dict(moe_capacity_factor=1.25)), "q_lora_rank": (MLA, dict(q_lora_rank=512)),
    "kv_lora_rank": (MLA, dict(kv_lora_rank=256)), "qk_nope_head_dim": (MLA, dict(qk_nope_head_dim=64)),
    "qk_rope_head_dim": (MLA, dict(qk_rope_head_dim=32)), "v_head_dim": (MLA, dict(v_head_dim=64)),
    "sliding_window": (DENSE, dict(sliding_window=4096)), "global_attention_every": (WINDOWED, dict(global_attention_every=2)),
    "embedding_norm": (DENSE, dict(embedding_norm=True)), "rope_theta": (DENSE, dict(rope_theta=1e6)),
    "rope_scaling": (MLA, dict(rope_scaling="none", rope_scaling_factor=1.0)),
    "rope_scaling_factor": (MLA, dict(rope_scaling_factor=20.0)), "norm_eps": (DENSE, dict(norm_eps=1e-6)),
    "qk_norm": (DENSE, dict(qk_norm=True)), "router_score": (MOE8, dict(router_score="sigmoid")),
    "router_expert_bias": (MOE8, dict(router_expert_bias=True)), "routed_scaling": (MOE8, dict(routed_scaling=2.5)),
    "attention_sinks": (DENSE, dict(attention_sinks=True)), "router_bias": (MOE8, dict(router_bias=True)), "activation_clamp": (DENSE, dict(activation_clamp=7.0)),
    "mtp_layers": (DENSE, dict(mtp_layers=1)),
}
FIELD_LAYOUTS = {"megatron": Parallelism(dp=8, zero=1), "deepspeed": Parallelism(dp=8, zero=1),
                 "torchtitan": Parallelism(dp=8, zero=3), "jax": Parallelism(dp=8, zero=3)}


def test_every_model_field_has_a_change_to_emit():
    assert set(FIELD_CHANGES) == {f.name for f in fields(TransformerConfig)} - {"name", "source"}


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("field_name", list(FIELD_CHANGES))
def test_a_model_field_is_emitted_or_refused_by_name(framework, field_name):
    """A model that differs in one field: its config (file or notes) differs, or it is refused with
    a line naming the field; never the same config for another model."""
    base, change = FIELD_CHANGES[field_name]
    if framework == "torchtitan" and base in (DENSE, MOE8, MLA):  # it builds registered flavors only
        base = get_preset({id(DENSE): "llama3-8b", id(MOE8): "qwen3-30b-a3b", id(MLA): "deepseek-v2-lite"}[id(base)])
    layout = FIELD_LAYOUTS[framework]
    a, b = (emit(framework, layout, m, layout.global_batch) for m in (base, base.with_(**change)))
    if a.unsupported:  # only JAX and torchtitan refuse a base: every MoE, MLA or windowed model / an unregistered one
        assert framework in ("jax", "torchtitan") and base in (MOE8, MLA, WINDOWED), a.unsupported
        pytest.skip(f"{framework} refuses the base model itself: {a.unsupported[0]}")
    if b.unsupported and not a.unsupported:
        assert any(field_name.split("_")[0] in r or field_name in r for r in b.unsupported), b.unsupported
    else:
        assert (a.text, a.notes, a.unsupported) != (b.text, b.notes, b.unsupported)


@pytest.mark.parametrize("name, family, flavor", [("llama3-70b", "llama3", "70B"), ("deepseek-v3", "deepseek_v3", "671B"),
                                                  ("qwen3-30b-a3b", "qwen3", "30B-A3B"), ("gpt-oss-120b", "gpt_oss", "120b")])
def test_torchtitan_emits_its_own_model_family_never_a_dense_stand_in(name, family, flavor):
    model = get_preset(name)
    layout = Parallelism(dp=8, zero=3, ep=8 if model.moe_experts else 1)
    assert _toml(layout, model)["model"] == {"name": family, "flavor": flavor}
    changed = emit("torchtitan", layout, model.with_(norm_eps=1e-3), layout.global_batch)  # no flavor is that
    assert "norm_eps=0.001" in changed.unsupported[0] and not changed.text
    for dense_stand_in in ("mixtral-8x7b", "gpt3-175b"):
        assert unsupported("torchtitan", Parallelism(dp=8, zero=3), get_preset(dense_stand_in), 8)
    assert unsupported("jax", Parallelism(dp=8, zero=3), get_preset("mixtral-8x7b"), 8)[0].startswith("moe_experts")


def test_megatron_writes_the_model_not_its_defaults():
    """Rope base, epsilon, router, QK/latent norms and dropout 0 (Megatron-LM defaults: 10000, 1e-5,
    softmax, none, 0.1); GPT-OSS's YaRN without MLA is refused by name."""
    f = _parse(megatron_flags(Parallelism(dp=8, ep=8, zero=1), get_preset("deepseek-v3"), 8))
    assert (f["--rotary-base"], f["--rope-type"], f["--rotary-scaling-factor"], f["--norm-epsilon"]) == ("10000", "yarn", "40", "1e-06")
    assert f["--moe-router-score-function"] == "sigmoid" and f["--moe-router-enable-expert-bias"] is True
    assert f["--moe-router-topk-scaling-factor"] == "2.5" and f["--qk-layernorm"] is True
    assert (f["--hidden-dropout"], f["--attention-dropout"]) == ("0", "0")
    assert _parse(megatron_flags(FSDP, LLAMA, 512))["--rotary-base"] == "500000"
    assert "rope_scaling yarn without MLA" in unsupported("megatron", Parallelism(dp=8, ep=8, zero=1),
                                                          get_preset("gpt-oss-120b"), 8)[0]


def test_megatron_dropout_follows_the_plans_masks():
    """0 unless the plan counts dropout masks (--dropout), then Megatron's 0.1: the memory that was planned."""
    for dropout, p in ((False, "0"), (True, "0.1")):
        f = _parse(megatron_flags(TimedPlan(FSDP, LLAMA, 512, StepOptions(), dropout=dropout)))
        assert (f["--hidden-dropout"], f["--attention-dropout"]) == (p, p)


def test_torchtitan_expert_tensor_parallelism_as_planned():
    qwen = get_preset("qwen3-30b-a3b")
    layout = Parallelism(dp=4, tp=2, ep=4, etp=2, zero=3, sequence_parallel=True)
    assert _toml(layout, qwen)["parallelism"]["expert_tensor_parallel_degree"] == 2
    assert "ETP=TP or ETP=1" in unsupported("torchtitan", layout.with_(dp=8, tp=4, etp=2, ep=8), qwen, 8)[0]


@pytest.mark.parametrize("kept, start, end, retimed", [(3, 0, 3, None), (6, 2, 4, None), (10, 4, 4, 8)])
def test_bf16_layers_become_megatrons_first_last_layers_flags(kept, start, end, retimed):
    """``bf16_layers`` (fp8) is Megatron's --first-last-layers-bf16: the end first, at most layers / pp
    at each end (Megatron-Core's TransformerConfig checks; more is re-timed at the most it takes), and
    none with delayed scaling, which Megatron-Core refuses with it."""
    from dtlib.frameworks.megatron_args import parse_args, validate
    layout = Parallelism(dp=2, pp=2, num_microbatches=4)
    plan = TimedPlan(layout, KNOB_MOE, layout.global_batch, StepOptions(dtype="fp8", fp8_recipe="current",
                                                                           bf16_layers=kept), "fp8",
                     cluster("h100-sxm", 1, 4))
    e, flags = emit("megatron", plan), megatron_flags(plan)
    args = parse_args(flags)  # Megatron-LM's own flag table
    validate(args, layout.gpus)
    assert (args["first_last_layers_bf16"], args["num_layers_at_start_in_bf16"],
            args["num_layers_at_end_in_bf16"]) == (True, start, end)
    named = [r for r in e.retimed if r.startswith("bf16_layers:")]
    assert bool(named) == (retimed is not None) and (retimed is None or f"re-timed with {retimed}" in named[0])
    delayed = emit("megatron", replace(plan, options=replace(plan.options, fp8_recipe="delayed")))
    assert "--first-last-layers-bf16" not in megatron_flags(replace(plan, options=replace(plan.options,
                                                                                         fp8_recipe="delayed")))
    assert any(r.startswith("bf16_layers: Megatron-Core refuses") for r in delayed.retimed)


def test_the_flex_dispatcher_is_written_and_accepted_by_megatrons_own_checks():
    """moe_dispatcher flex (HybridEP, as Megatron-Bridge 25.11's rack recipes ran it) is written as
    Megatron-LM's flags and passes its parse_args and Megatron-Core's TransformerConfig checks."""
    from dtlib.frameworks.configs import check_emitted

    layout = Parallelism(dp=8, ep=8, num_microbatches=2)
    flags = {}
    for dispatcher in ("alltoall", "flex"):
        plan = TimedPlan(layout, KNOB_MOE, layout.global_batch, StepOptions(moe_dispatcher=dispatcher))
        e = emit("megatron", plan)
        flags[dispatcher] = e.data
        assert "Megatron-Core's configs" in check_emitted(e, layout)
    assert flags["flex"][flags["flex"].index("--moe-token-dispatcher-type") + 1] == "flex"
    assert flags["flex"][flags["flex"].index("--moe-flex-dispatcher-backend") + 1] == "hybridep"
    assert flags["alltoall"][flags["alltoall"].index("--moe-token-dispatcher-type") + 1] == "alltoall"
    assert "--moe-flex-dispatcher-backend" not in flags["alltoall"]
