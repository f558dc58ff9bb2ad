"""Memory for today's training (issue 26, items 5 and 6): FlashAttention-style attention and no
dropout unless asked; ``dtlib memory``, ``dtlib plan`` and ``memory_per_gpu`` give the same bytes
for the same layout; partial, per-op and FP8 storage; Llama 3 405B's published layout fits."""
import json

import pytest

from dtlib.analytic.activations import layer_bytes, op_selective_bytes, stored_layer_bytes
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.hardware import cluster, get_gpu
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import GiB, memory_per_gpu
from dtlib.analytic.presets import get_preset
from dtlib.cli import main
from dtlib.plan.steptime import step_time

LLAMA405 = get_preset("llama3-405b")
# Llama 3 paper, Sec. 3.3 and Table 4: 8,192 H100s, tp 8, cp 1, pp 16, dp 64, 16M tokens per
# batch at 8K (2,048 sequences, 32 per data-parallel rank), no activation checkpointing
LLAMA3_FLAGS = ["--model", "llama3-405b", "--seq", "8192", "--tp", "8", "--pp", "16", "--dp", "64", "--zero", "2",
                "--recompute", "none", "--sequence-parallel", "--virtual-stages", "4", "--micro-batch", "1"]
LLAMA3 = Parallelism(dp=64, tp=8, pp=16, zero=2, sequence_parallel=True, schedule="interleaved",
                     virtual_stages=4, micro_batch_size=1, num_microbatches=32)
# 126 layers in 16 x 4 chunks: Megatron-LM builds it only from a layout string (its even split needs
# 126 divisible by 64); the layers spread 2 per chunk, the last two chunks 1
SPREAD = LLAMA3.with_(pipeline_layout=True)


def _json(capsys, *argv) -> dict:
    assert main(list(argv)) in (0, 1)  # plan exits 1 when nothing fits, and says why
    return json.loads(capsys.readouterr().out)


# (extra flags for both commands, memory-only flags, plan-only flags, memory_per_gpu kwargs, layout)
CASES = {
    "llama3-405b, the issue's layout": (["--pipeline-layout"], ["--schedule", "interleaved", "--microbatches", "32"],
                                        ["--gpus", "8192", "--global-batch", "2048"], {}, SPREAD),
    "llama3-405b, Llama 3's balanced stages": (
        ["--account-for-embedding-and-loss"], ["--schedule", "interleaved", "--microbatches", "32"],
        ["--gpus", "8192", "--global-batch", "2048"], {}, LLAMA3.with_(account_for_embedding_and_loss=True)),
    "llama3-405b, FP8, 2 layers recomputed per chunk": (
        ["--recompute-layers", "2", "--precision", "fp8", "--pipeline-layout"],
        ["--schedule", "interleaved", "--microbatches", "32"],
        ["--gpus", "8192", "--global-batch", "2048"], {"dtype": "fp8"}, SPREAD.with_(recompute_layers=2)),
}


@pytest.mark.parametrize("name", CASES)
def test_memory_plan_and_the_api_agree_byte_for_byte(capsys, name):
    both, memory_only, plan_only, kwargs, layout = CASES[name]
    mem = _json(capsys, "memory", *LLAMA3_FLAGS, *both, *memory_only, "--json")
    plan = _json(capsys, "plan", *LLAMA3_FLAGS, *both, *plan_only, "--headroom", "1", "--json")
    planned = plan["configs"][0]["memory_per_gpu_bytes"] if plan["configs"] else None
    # the megatron stack's bytes: BF16 gradients (Megatron-Core's grad_reduce_in_fp32=False)
    api = memory_per_gpu(LLAMA405, layout, precision="bf16-mixed", seq=8192, **kwargs).total
    if planned is None:  # nothing fits: plan says the smallest memory it found, in GiB to 1 decimal
        assert f"{api / GiB:.1f} GiB" in plan["why"]
    else:
        assert planned == api
    assert mem["per_gpu"]["total"] == api


def test_more_layouts_agree(capsys):
    """A custom Llama-shaped model (the issue's example of 2022 defaults), the paper's convention
    on a GPT shape, and torchtitan's per-op checkpointing on its stack."""
    custom = ["--layers", "16", "--hidden", "2048", "--heads", "16", "--kv-heads", "8", "--activation", "swiglu",
              "--seq", "4096"]
    cases = [
        (custom + ["--tp", "2", "--zero", "1", "--recompute", "none"], ["--dp", "4"], [], {}),
        (["--layers", "8", "--hidden", "1024", "--heads", "16", "--seq", "1024", "--tp", "2", "--zero", "0",
          "--recompute", "selective", "--convention", "korthikanti-2022"], ["--dp", "4"], [],
         {"convention": "korthikanti-2022"}),
        (custom + ["--stack", "torchtitan", "--recompute", "op", "--zero", "3", "--tp", "1"], ["--dp", "8"], [],
         {"stack": "torchtitan"}),
    ]
    for flags, memory_only, plan_only, kwargs in cases:
        mem = _json(capsys, "memory", *flags, *memory_only, "--json")
        plan = _json(capsys, "plan", *flags, "--gpus", "8", "--global-batch", "8", "--micro-batch", "1",
                     "--pp", "1", "--cp", "1", "--ep", "1", "--virtual-stages", "1", "--no-sequence-parallel",
                     "--headroom", "1", "--json")
        (config,) = plan["configs"]
        layout = Parallelism(dp=config["dp"], tp=config["tp"], zero=config["zero"], recompute=config["recompute"],
                             num_microbatches=config["microbatches"])
        model = TransformerConfig(layers=int(flags[1]), hidden=int(flags[3]), heads=int(flags[5]),
                                  kv_heads=8 if "--kv-heads" in flags else None,
                                  activation="swiglu" if "swiglu" in flags else "gelu", vocab=50257,
                                  seq=int(flags[flags.index("--seq") + 1]))
        precision = "fsdp-mixed" if kwargs.get("stack") == "torchtitan" else "bf16-mixed"
        api = memory_per_gpu(model, layout, precision=precision, **kwargs).total
        assert config["memory_per_gpu_bytes"] == api == mem["per_gpu"]["total"], flags


def test_both_commands_say_what_they_assumed(capsys):
    mem = _json(capsys, "memory", "--model", "llama3-8b", "--json")
    notes = " ".join(mem["notes"])
    assert "convention 'today': FlashAttention-style attention" in notes and "no dropout" in notes
    assert "stack: megatron (fused SwiGLU keeps its input only)" in notes and "16 bytes/param" in notes
    plan = _json(capsys, "plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--top", "1",
                 "--convention", "korthikanti-2022", "--json")
    a = plan["assumed"]
    assert a["stack"] == "megatron" and a["flash_attention"] is False and a["dropout"] is True
    assert "'korthikanti-2022': explicit attention" in a["activations"]


def test_the_papers_convention_restores_34_plus_5as_over_h_per_layer():
    """Korthikanti et al. 2022, Sec. 4.1: a GPT layer keeps s b h (34 + 5 a s / h) bytes; one layer
    more adds exactly that (one GPU, no recompute). Today's default keeps no scores and no masks."""
    s, b, h, a = 1024, 2, 1024, 16
    gpt = TransformerConfig(layers=2, hidden=h, heads=a, vocab=50257, seq=s)
    layout = Parallelism(micro_batch_size=b)
    paper, today = ({n: memory_per_gpu(gpt.with_(layers=n), layout, **kw).activation_detail["layers"]
                     for n in (2, 3)} for kw in ({"convention": "korthikanti-2022"}, {}))
    assert paper[3] - paper[2] == s * b * h * (34 + 5 * a * s / h)
    # FlashAttention and no dropout: the 5as/h scores and the two 1-byte residual dropout masks go
    assert today[3] - today[2] == layer_bytes(s, b, h, a, a, 4 * h, recompute="selective", dropout=False)
    assert today[3] - today[2] == s * b * h * (34 - 2)


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_partial_recompute_interpolates_exactly(recompute):
    """Megatron's block method: N = 0 is ``recompute``, N = the chunk's layers is full recompute,
    and each layer in between moves the memory by the same amount."""
    model = get_preset("llama3-8b")
    layout = Parallelism(tp=2, dp=4, sequence_parallel=True, recompute=recompute)
    per_chunk = 32

    def act(n):
        return memory_per_gpu(model, layout.with_(recompute_layers=n)).activations

    assert act(0) == memory_per_gpu(model, layout).activations
    assert act(per_chunk) == act(per_chunk + 5) == memory_per_gpu(model, layout.with_(recompute="full")).activations
    step = act(2) - act(1)  # from N = 1 on, the rebuilt layer's transient buffer is there too
    assert step < 0 and all(act(n) == act(1) + (n - 1) * step for n in range(2, per_chunk + 1))
    # with pipelining, per model chunk: 8 layers per stage, the first N of them recomputed
    piped = Parallelism(tp=2, pp=4, num_microbatches=8, sequence_parallel=True, recompute=recompute)
    layers = [memory_per_gpu(model, piped.with_(recompute_layers=n)).activation_detail["layers"] for n in range(8)]
    assert all(layers[n] - layers[n + 1] == layers[0] - layers[1] for n in range(7))
    c = cluster("h100-sxm", 1, 8)
    full = step_time(model, layout.with_(recompute="full"), c).step_time
    none = step_time(model, layout, c).step_time
    assert step_time(model, layout.with_(recompute_layers=per_chunk), c).step_time == pytest.approx(full, rel=1e-12)
    assert step_time(model, layout.with_(recompute_layers=0), c).step_time == none
    assert none < step_time(model, layout.with_(recompute_layers=3), c).step_time < full


def test_per_op_checkpointing_keeps_what_torchtitans_policy_saves():
    """torchtitan's op-level SAC saves wq, wv, w1 and w2 outputs (every second mm recomputed), the
    SDPA output and its fp32 log-sum-exp, and the layer input (one GPU, Llama 3 8B shape)."""
    s, b, h, a, kv, f = 8192, 1, 4096, 32, 8, 14336
    kept = op_selective_bytes(s, b, h, a, kv, f, swiglu=True)
    by_hand = 2 * s * b * (h + h + h * kv // a + h + f + h) + 4 * b * s * a
    assert kept == by_hand
    shape = dict(seq=s, micro_batch_size=b, hidden=h, heads=a, kv_heads=kv, ffn=f, swiglu=True, dropout=False)
    assert layer_bytes(recompute="full", **shape) < kept < stored_layer_bytes("selective", **shape)
    # with TP and SP: column-parallel outputs / t, w2's row-parallel output whole, + 2 reduce-scatters
    t = 8
    tp = op_selective_bytes(s, b, h, a, kv, f, tp=t, sequence_parallel=True, swiglu=True)
    assert tp == 2 * s * b * (h / t + (h + h * kv // a + h + f) / t + h + 2 * h / t) + 4 * b * s * a / t


def test_fp8_keeps_one_byte_copies_of_the_gemm_inputs_on_transformer_engine_only():
    s, b, h, a, kv, f, t = 4096, 1, 8192, 64, 8, 28672, 8
    shape = dict(seq=s, micro_batch_size=b, hidden=h, heads=a, kv_heads=kv, ffn=f, tp=t, sequence_parallel=True,
                 swiglu=True, dropout=False)
    bf16 = stored_layer_bytes("selective", fused_swiglu=True, **shape)
    fp8 = stored_layer_bytes("selective", fused_swiglu=True, fp8_inputs=True, **shape)
    # QKV and FC1 inputs (norm outputs, s b h / t with SP), projection input (s b h / t), FC2 input (s b f / t)
    assert bf16 - fp8 == s * b * (3 * h + f) / t
    # the fused SwiGLU keeps 3 FFN-wide tensors instead of eager PyTorch's 4
    assert stored_layer_bytes("selective", **shape) - bf16 == 2 * s * b * f / t
    model = get_preset("llama3-70b")
    layout = Parallelism(tp=8, pp=4, num_microbatches=8, sequence_parallel=True)
    te, titan = (memory_per_gpu(model, layout, dtype="fp8", stack=st).activations for st in ("megatron", "torchtitan"))
    assert te < memory_per_gpu(model, layout, stack="megatron").activations and titan == \
        memory_per_gpu(model, layout, stack="torchtitan").activations


def test_llama3_405b_fits_as_published_and_what_made_it_not():
    """Llama 3 paper, Sec. 3.3: 405B at 8K, tp 8 / pp 16 / dp 64, no activation checkpointing, on
    80 GB H100s. It fits once the memory model counts Megatron's fused SwiGLU and Llama 3's
    pipeline balancing with one-layer chunks (126 layers + the embedding and the loss in 16 x 8
    chunks, Sec. 3.3.2). Every rank counts: with 2-layer chunks (v = 4) balancing empties a layer
    of rank 0's first chunk, but rank 1 keeps its 8 layers and holds 77 chunk-forwards at its peak
    (29 of its first chunk), 154 layer x micro-batch pairs against rank 0's 158 unbalanced, and does
    not fit; docs/stacks.md goes through every term."""
    h100 = get_gpu("h100-sxm")
    balanced = memory_per_gpu(LLAMA405, LLAMA3.with_(virtual_stages=8, account_for_embedding_and_loss=True),
                              precision="megatron-bf16", gpu=h100)
    assert balanced.fits and balanced.stage == 1
    even = memory_per_gpu(LLAMA405, SPREAD, precision="megatron-bf16", gpu=h100)
    eager = memory_per_gpu(LLAMA405, SPREAD, precision="megatron-bf16", gpu=h100, stack="torchtitan")
    # eager SwiGLU: one more FFN-wide tensor (s b f / t, 2 bytes) per layer x micro-batch held (158)
    assert not even.fits and even.stage == 0 and eager.total - even.total == 158 * 2 * 8192 * 53248 / 8
    two_layer_chunks = memory_per_gpu(LLAMA405, LLAMA3.with_(account_for_embedding_and_loss=True),
                                      precision="megatron-bf16", gpu=h100)
    assert two_layer_chunks.stage == 1 and not two_layer_chunks.fits
    assert two_layer_chunks.activations == pytest.approx(154 / 158 * even.activations, rel=1e-12)
    paper = memory_per_gpu(LLAMA405, SPREAD, precision="megatron-bf16", convention="korthikanti-2022")
    assert paper.total > 5 * even.total  # the 2022 default: scores and masks stored


def test_one_layer_per_chunk_is_valid_only_with_the_balanced_split(capsys):
    """Llama 3, Sec. 3.3.2: "the first model chunk on the first stage has only the embedding": 126
    layers + the embedding and the loss in 16 x 8 one-layer chunks. Megatron-LM accepts it with
    --account-for-embedding/loss-in-pipeline-split; without them 128 chunks exceed 126 layers."""
    from dtlib.analytic.layout import stage_layers

    v8 = LLAMA3.with_(virtual_stages=8)
    with pytest.raises(ValueError, match=r"pipeline stages pp=16 x virtual stages 8 exceed the 126 layers"):
        memory_per_gpu(LLAMA405, v8)
    with pytest.raises(ValueError, match=r"pp=16 x virtual_stages=8 = 128 chunks exceed the 126 layers; valid: "
                                         r"pp x virtual_stages <= 126"):
        memory_per_gpu(LLAMA405, v8.with_(pipeline_layout=True))
    balanced = memory_per_gpu(LLAMA405, v8.with_(account_for_embedding_and_loss=True), precision="megatron-bf16",
                              gpu=get_gpu("h100-sxm"))
    assert balanced.fits
    assert stage_layers(126, 16, 8, True) == (7, 7)  # 8 chunks of one layer, one of them empty
    with pytest.raises(ValueError, match="pp=16 x virtual stages 16 exceed the 126 layers \\+ the embedding and the loss"):
        memory_per_gpu(LLAMA405, LLAMA3.with_(virtual_stages=16, account_for_embedding_and_loss=True))
    flags = [f for f in LLAMA3_FLAGS if f != "4"]
    flags[flags.index("--virtual-stages") + 1:flags.index("--virtual-stages") + 1] = ["8"]
    assert main(["memory", *flags, "--schedule", "interleaved", "--microbatches", "32"]) == 2
    assert "pipeline stages pp=16 x virtual stages 8 exceed the 126 layers" in capsys.readouterr().err
    assert main(["memory", *flags, "--schedule", "interleaved", "--microbatches", "32",
                 "--account-for-embedding-and-loss"]) == 0


@pytest.mark.parametrize("argv,message", [
    (["memory", "--model", "llama3-8b", "--recompute-layers", "-1"], "--recompute-layers must be an integer >= 0"),
    (["memory", "--model", "llama3-8b", "--recompute", "full", "--recompute-layers", "2"],
     "recompute_layers=2 recomputes part of the layers, but recompute='full'"),
    (["memory", "--model", "llama3-8b", "--convention", "today", "--convention", "korthikanti-2022"],
     "--convention given two activation conventions"),
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--recompute", "full",
      "--recompute-layers", "1"], "recompute_layers=1 recomputes part of the layers"),
])
def test_bad_input_names_the_flag(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    with pytest.raises(ValueError, match="recompute_layers must be an integer >= 0"):
        Parallelism(recompute_layers=-1)


def test_activation_offload_moves_the_kept_layers_to_cpu():
    """Megatron-Core --cpu-offloading-num-layers / DeepSpeed cpu_checkpointing: N layers of each
    chunk keep their activations in CPU memory; one layer's are back on the GPU for its backward."""
    model = get_preset("llama3-8b")
    layout = Parallelism(tp=2, dp=4, sequence_parallel=True, recompute="full")
    kept = memory_per_gpu(model, layout)
    half = memory_per_gpu(model, layout.with_(activation_offload_layers=16))
    every = memory_per_gpu(model, layout.with_(activation_offload_layers=32))
    one_layer = kept.activation_detail["layers"] / 32
    assert half.activation_detail["layers"] == kept.activation_detail["layers"] / 2 == half.cpu - kept.cpu
    assert every.activation_detail["layers"] == 0 and every.cpu - kept.cpu == kept.activation_detail["layers"]
    assert every.activation_detail["offload_buffer"] == one_layer
    assert every.activations == kept.activations - kept.activation_detail["layers"] + one_layer


def test_the_new_layout_options_are_emitted_for_megatron_or_refused():
    from dtlib.plan.emit import megatron_flags, unsupported

    layout = LLAMA3.with_(zero=1, account_for_embedding_and_loss=True, recompute_layers=2)
    flags = " ".join(megatron_flags(layout, LLAMA405, 2048))
    assert "--num-layers-per-virtual-pipeline-stage 2" in flags  # (126 + 2) / (16 x 4)
    assert "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split" in flags
    assert "--recompute-granularity full --recompute-method block --recompute-num-layers 2" in flags
    assert "recompute_layers=2 with recompute='selective' is not emitted for megatron" in \
        unsupported("megatron", layout.with_(recompute="selective"), LLAMA405, 2048)[0]
    refused = " ".join(unsupported("torchtitan", layout.with_(activation_offload_layers=1), LLAMA405, 2048))
    assert "recompute_layers=2 with recompute='none' is not emitted for torchtitan" in refused
    assert "activation_offload_layers is not emitted for torchtitan" in refused


def test_per_op_checkpointing_step_time_recomputes_gemms_not_attention():
    model, c = get_preset("llama3-8b"), cluster("h100-sxm", 1, 8)
    layout = Parallelism(dp=8, zero=3)
    none, op, full = (step_time(model, layout.with_(recompute=r), c) for r in ("none", "op", "full"))
    assert none.step_time < op.step_time < full.step_time
    assert none.hardware_flops < op.hardware_flops < full.hardware_flops
