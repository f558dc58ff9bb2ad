"""Memory per GPU: published checks (ZeRO paper, DeepSpeed estimator, Korthikanti et al. 2022),
the paper's closed forms, parallel division rules, and a real AdamW step of TinyGPT on CPU."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dtlib.analytic.activations import layer_bytes
from dtlib.measure import model_state_bytes_held, saved_activation_bytes
from dtlib.analytic.memory import GB, GiB, memory_per_gpu, stage_parameters, model_numbers
from dtlib.models import TinyGPT, get_preset, tiny_gpt_config
from dtlib.analytic.layout import Parallelism, fsdp, in_flight
from dtlib.analytic.precision import CONVENTIONS, precision


# ---- published checks ------------------------------------------------------------------------
@pytest.mark.parametrize("stage,published_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_7_5b_on_64_gpus(stage, published_gb):
    """Rajbhandari et al. 2020, Fig. 1 / Table 1: Psi = 7.5B, N_d = 64, K = 12. The paper rounds to
    0.1 GB, so the tolerance is 0.05 GB."""
    m = memory_per_gpu(7.5e9, Parallelism(dp=64, zero=stage), precision="zero")
    assert m.model_states / GB == pytest.approx(published_gb, abs=0.05)
    assert m.activations is None


def test_zero_shards_over_the_data_parallel_group_not_all_gpus():
    m = memory_per_gpu(7.5e9, Parallelism(dp=64, tp=2, zero=1), precision="zero", gpus=128)
    assert m.optimizer == pytest.approx(12 * 7.5e9 / 2 / 64)
    # the group follows dp when a layout is changed; FSDP hybrid sharding uses a smaller group
    assert memory_per_gpu(7.5e9, Parallelism(dp=8, zero=1).with_(dp=16)).optimizer == 12 * 7.5e9 / 16
    hybrid = memory_per_gpu(7.5e9, fsdp("HYBRID_SHARD", dp=16, shard_size=8))
    assert hybrid.parameters == 2 * 7.5e9 / 8
    assert memory_per_gpu(7.5e9, fsdp("full_shard", dp=16)).parameters == 2 * 7.5e9 / 16
    assert memory_per_gpu(7.5e9, fsdp("SHARD_GRAD_OP", dp=16)).parameters == 2 * 7.5e9
    with pytest.raises(ValueError, match="valid: FULL_SHARD, SHARD_GRAD_OP"):
        fsdp("HALF_SHARD", dp=4)


def test_deepspeed_zero3_estimator_2851m_on_8_gpus():
    """DeepSpeed ``estimate_zero3_model_states_mem_needs`` (deepspeed/runtime/zero/stage3.py):
    18 bytes/param / total GPUs + 4 x largest layer; DeepSpeed's docs print 6.09 GB (GiB) per GPU
    for 2851M parameters, 32M largest layer, 1 node x 8 GPUs, no offload. Printed to 0.01, so the
    tolerance is 0.005 GiB."""
    layout = Parallelism(dp=8, zero=3)
    m = memory_per_gpu(2851e6, layout, precision="megatron-bf16", largest_layer_params=32e6, gpus=8)
    assert m.total / GiB == pytest.approx(6.09, abs=0.005)
    # and the offload branches of the same estimator, exactly
    opt = memory_per_gpu(2851e6, layout.with_(offload="optimizer"), precision="megatron-bf16",
                         largest_layer_params=32e6)
    assert opt.total == pytest.approx(4 * 32e6 + int(2 * 2851e6 / 8))
    par = memory_per_gpu(2851e6, layout.with_(offload="params"), precision="megatron-bf16",
                         largest_layer_params=32e6)
    assert par.total == pytest.approx(4 * 32e6)
    assert par.cpu == pytest.approx(18 * 2851e6 / 8)


def test_zero3_largest_layer_override_is_split_by_tensor_parallelism():
    """The override is a whole layer; with tp = 4 each rank gathers its quarter, as the shaped
    path does (issue 9, item 8: it used to gather the whole layer on every TP rank).
    DeepSpeed's budget: 2 bytes x (params + grads) = 4 x the layer's parameters on this rank."""
    m = memory_per_gpu(2851e6, Parallelism(dp=2, tp=4, zero=3), precision="megatron-bf16",
                       largest_layer_params=32e6)
    assert m.temporary == 4 * 32e6 / 4 == 32e6
    # the shaped path, for comparison: the unit is the largest block's parameters on one TP rank
    cfg = get_preset("llama3-8b")
    shaped = [memory_per_gpu(cfg, Parallelism(dp=2, tp=tp, zero=3)).temporary for tp in (1, 4)]
    override = [memory_per_gpu(cfg, Parallelism(dp=2, tp=tp, zero=3), largest_layer_params=4e8).temporary
                for tp in (1, 4)]
    assert override == [4 * 4e8, 4 * 4e8 / 4]
    assert shaped[1] < shaped[0] / 3  # the layers split by 4, the replicated norms do not


# ---- MoE: top_k routed copies of each token keep their MLP activations --------------------------
def test_moe_layer_activations_by_hand():
    """One Llama-3-8B-shaped MoE layer (s = 2048, b = 1, h = 4096, a = 32, 8 KV heads, f = 14336,
    SwiGLU, dropout, 16-bit activations, tp = 1), top_k = 2, after Korthikanti et al. 2022, Sec. 4.1:

    * attention: QKV input 2sbh, Q/K/V/projection input 2sbh(2 + 2 x 8/32), dropout mask sbh -> 8 sbh
    * scores: a s^2 b (2 + 1 + 2)                                             -> 671,088,640
    * norms: 2 x 2sbh                                                         -> 4 sbh
    * MLP: router/dispatch input 2sbh and mask sbh, plus per routed copy (x 2)
      the expert's input 2sbh and SwiGLU's four f-sized tensors 4 x 2sbf     -> 3 sbh + 2 x 251,658,240
    with sbh = 8,388,608: 15 sbh + 671,088,640 + 503,316,480 = 1,300,234,240 bytes.
    """
    shape = dict(seq=2048, micro_batch_size=1, hidden=4096, heads=32, kv_heads=8, ffn=14336, swiglu=True)
    assert layer_bytes(**shape, experts=8, top_k=2) == 1_300_234_240
    # dense: one MLP and no dispatch copy (the second copy's 251,658,240 and the first's 2sbh go)
    assert layer_bytes(**shape) == 1_300_234_240 - 251_658_240 - 2 * 2048 * 4096 == 1_031_798_784


def test_moe_top_k_changes_activation_memory():
    """llama3-8b with 8 experts: top_k 1, 2 and 8 used to give identical activations. Each extra
    routed copy adds, per layer, 2 bytes x s x (3 f + h) = 201,326,592 B at s = 2048 (32 layers):
    the default stack's fused SwiGLU keeps 3 f-wide tensors per copy (eager PyTorch: 4)."""
    base = get_preset("llama3-8b")
    acts = {k: memory_per_gpu(base.with_(moe_experts=8, moe_top_k=k), seq=2048).activations for k in (1, 2, 8)}
    per_copy = 32 * 2 * 2048 * (3 * 14336 + 4096)
    assert acts[2] - acts[1] == per_copy and acts[8] - acts[1] == 7 * per_copy
    # the vectorised path runs the same formula
    from dtlib.analytic.vectorised import memory_batch
    batch = memory_batch(base.with_(moe_experts=8, moe_top_k=8), seq=[2048])
    assert batch["activations"][0] == acts[8]


def test_korthikanti_22b_activations():
    """Korthikanti et al. 2022, Table 3/4 setting: 22B, s=2048, b=4, t=8: 59.25 GiB of layer
    activations without recompute and 9.5625 GiB with sequence parallelism + selective recompute.
    Both are exact arithmetic, so the tolerance is 1e-9 relative."""
    cfg = get_preset("megatron-22b")
    base = Parallelism(tp=8, micro_batch_size=4)
    paper = dict(convention="korthikanti-2022")  # explicit attention and dropout, as the paper counts
    none = memory_per_gpu(cfg, base, gpus=8, **paper).activation_detail["layers"]
    sel = memory_per_gpu(cfg, base.with_(sequence_parallel=True, recompute="selective"),
                         **paper).activation_detail["layers"]
    assert none / GiB == pytest.approx(59.25, rel=1e-9)
    assert sel / GiB == pytest.approx(9.5625, rel=1e-9)


@pytest.mark.parametrize("s,b,h,a,t", [(2048, 4, 6144, 64, 8), (4096, 1, 12288, 96, 4), (1024, 3, 1024, 16, 2)])
def test_layer_formula_reduces_to_the_papers_table_2(s, b, h, a, t):
    sbh = s * b * h
    kw = dict(seq=s, micro_batch_size=b, hidden=h, heads=a, kv_heads=a, ffn=4 * h)
    paper = {  # Korthikanti et al. 2022, Table 2
        ("none", 1, False): sbh * (34 + 5 * a * s / h),
        ("none", t, False): sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        ("none", t, True): sbh / t * (34 + 5 * a * s / h),
        ("selective", t, False): sbh * (10 + 24 / t),
        ("selective", t, True): sbh * 34 / t,
        ("full", 1, False): 2 * sbh,
        ("full", t, True): 2 * sbh / t,
    }
    for (recompute, tp, sp), expected in paper.items():
        got = layer_bytes(tp=tp, sequence_parallel=sp, recompute=recompute, **kw)
        assert got == pytest.approx(expected, rel=1e-12), (recompute, tp, sp)


def test_pipeline_in_flight_microbatches():
    assert [float(x) for x in in_flight("gpipe", 4, 16)] == [16, 16]
    assert [float(x) for x in in_flight("1f1b", 4, 16)] == [4, 1]
    assert [float(x) for x in in_flight("1f1b", 4, 2)] == [2, 1]
    first, _ = in_flight("interleaved", 4, 16, 2)  # Korthikanti Sec. 4.2.3: 1 + (p-1)/(p v)
    assert float(first) == pytest.approx(4 * (1 + 3 / 8))
    assert [float(x) for x in in_flight("gpipe", 1, 16)] == [1, 1]  # no pipeline: accumulation


def test_interleaving_needs_two_virtual_stages_and_a_pipeline():
    """Megatron-LM interleaves only with virtual_pipeline_model_parallel_size > 1 and
    pipeline_model_parallel_size > 1; with one chunk per rank the warm-up count would claim 7
    micro-batches in flight on rank 0 (p = 4) where 1F1B holds 4, for the same bubble."""
    with pytest.raises(ValueError, match="interleaved schedule needs virtual_stages >= 2, got 1"):
        in_flight("interleaved", 4, 8, 1)
    with pytest.raises(ValueError, match="virtual_stages >= 2"):
        in_flight("interleaved", 4, 8, np.array([2, 1]))
    with pytest.raises(ValueError, match="interleaved schedule needs virtual_stages >= 2, got 1"):
        Parallelism(pp=4, num_microbatches=8, schedule="interleaved")
    with pytest.raises(ValueError, match="needs pipeline parallelism, pp >= 2, got pp=1"):
        Parallelism(virtual_stages=2, schedule="interleaved")
    with pytest.raises(ValueError, match="multiple of pp=4 .*valid: 4, 8, 12"):
        Parallelism(pp=4, virtual_stages=2, num_microbatches=6, schedule="interleaved")
    ok = memory_per_gpu("llama3-8b", Parallelism(pp=4, virtual_stages=2, num_microbatches=8, schedule="interleaved"))
    plain = memory_per_gpu("llama3-8b", Parallelism(pp=4, num_microbatches=8, schedule="1f1b"))
    assert ok.activations < 1.5 * plain.activations  # 1 + (p-1)/(p v) of the layers, not 7/4


# ---- the memory calculator widget ------------------------------------------------------------
def test_calculator_keeps_the_pipeline_controls_consistent():
    from dtlib.widgets.memory import memory_calculator, pipeline_controls

    assert pipeline_controls("schedule", "interleaved", 1, 1) == {"schedule": "interleaved", "virtual_stages": 2, "pp": 2}
    assert pipeline_controls("schedule", "gpipe", 4, 8) == {"schedule": "gpipe", "virtual_stages": 1, "pp": 8}
    assert pipeline_controls("schedule", "dualpipe", 4, 1) == {"schedule": "dualpipe", "virtual_stages": 1, "pp": 2}
    assert pipeline_controls("pp", "dualpipe", 1, 1) == {"schedule": "1f1b", "virtual_stages": 1, "pp": 1}
    assert pipeline_controls("schedule", "dualpipev", 1, 1) == {"schedule": "dualpipev", "virtual_stages": 2, "pp": 2}
    assert pipeline_controls("virtual_stages", "dualpipev", 4, 4) == {"schedule": "interleaved", "virtual_stages": 4, "pp": 4}
    assert pipeline_controls("virtual_stages", "1f1b", 4, 1) == {"schedule": "interleaved", "virtual_stages": 4, "pp": 2}
    assert pipeline_controls("virtual_stages", "interleaved", 1, 4) == {"schedule": "1f1b", "virtual_stages": 1, "pp": 4}
    assert pipeline_controls("pp", "interleaved", 2, 1) == {"schedule": "1f1b", "virtual_stages": 1, "pp": 1}
    with pytest.raises(ValueError, match="changed must be 'schedule', 'virtual_stages' or 'pp'"):
        pipeline_controls("dp", "1f1b", 1, 1)

    explorer = memory_calculator()
    c = explorer.controls
    for control, value, expect in [("schedule", "interleaved", ("interleaved", 2, 2)),
                                   ("pp", 1, ("1f1b", 1, 1)),
                                   ("virtual_stages", 4, ("interleaved", 4, 2)),
                                   ("virtual_stages", 1, ("1f1b", 1, 2)),
                                   ("schedule", "interleaved", ("interleaved", 2, 2)),
                                   ("schedule", "gpipe", ("gpipe", 1, 2))]:
        updates = explorer.updates
        c[control].value = value
        assert (c["schedule"].value, c["virtual_stages"].value, c["pp"].value) == expect, (control, value)
        assert explorer.updates == updates + 1, f"{control}={value!r} should redraw once"
        assert explorer.error is None and explorer.result.total > 0
        assert "image/png" in explorer.out.outputs[0]["data"]
    # a configuration that is still impossible shows dtlib's message as text, not a traceback
    c["schedule"].value = "interleaved"
    c["num_microbatches"].value = 7
    assert "multiple of pp=2" in explorer.error
    assert "multiple of pp=2" in explorer.out.outputs[0]["text"]
    c["num_microbatches"].value = 8
    assert explorer.error is None and "image/png" in explorer.out.outputs[0]["data"]


def test_pipeline_stages_split_the_parameters():
    for name, tied in (("llama3-8b", False), ("gpt3-175b", True)):
        cfg = get_preset(name)
        st = stage_parameters(**model_numbers(cfg), pp=2)
        extra = tied * cfg.vocab * cfg.hidden  # a tied head is a second copy on the last stage
        assert st["first"]["dense"] + st["last"]["dense"] == cfg.num_parameters() + extra
    one = memory_per_gpu("llama3-70b", Parallelism(pp=1), precision="zero")
    assert one.parameters == 2 * get_preset("llama3-70b").num_parameters()


def test_tensor_parallel_shards_all_but_norms_and_row_biases():
    cfg = tiny_gpt_config(layers=3)
    model = TinyGPT(cfg)
    replicated = sum(p.numel() for n, p in model.named_parameters()
                     if "norm" in n or n.endswith(("proj.bias", "down.bias")) or n.startswith("wpe"))
    for tp in (2, 4):
        st = stage_parameters(**model_numbers(cfg), tp=tp)["first"]["dense"]
        assert tp * st == cfg.num_parameters() + (tp - 1) * replicated


def test_zero_stages_shrink_memory_and_offload_moves_it_to_cpu():
    cfg = get_preset("llama3-8b")
    totals = [memory_per_gpu(cfg, Parallelism(dp=8, zero=z)).model_states for z in range(4)]
    assert all(a > b for a, b in zip(totals, totals[1:]))
    on_gpu = memory_per_gpu(cfg, Parallelism(dp=8, zero=2))
    off = memory_per_gpu(cfg, Parallelism(dp=8, zero=2, offload="optimizer"))
    assert off.optimizer == 0 and off.gradients == 0 and off.cpu == pytest.approx(on_gpu.optimizer + on_gpu.gradients)


def test_conventions_bytes_per_parameter():
    assert {k: v.total for k, v in CONVENTIONS.items()} == {
        "zero": 16, "megatron-bf16": 18, "megatron-fp16": 20, "fp32": 16, "fsdp-mixed": 16, "sgd-momentum": 12,
        "adam-8bit": 10}
    with pytest.raises(ValueError, match="optimizer must be one of"):
        precision(optimizer="lion")


def test_most_loaded_gpu_is_reported():
    cfg = get_preset("llama3-8b")
    # long vocabulary, few micro-batches: the last stage (LM head + fp32 logits) is the heavier
    m = memory_per_gpu(cfg, Parallelism(pp=4, num_microbatches=1, recompute="full"))
    assert m.stage == 3 and m.activation_detail["output"] > 0
    m = memory_per_gpu(cfg, Parallelism(pp=4, num_microbatches=16))
    assert m.stage == 0


# ---- measured: a real AdamW step of TinyGPT on CPU ------------------------------------------------
def _train_step(cfg, batch, dropout):
    torch.manual_seed(0)
    model = TinyGPT(cfg, dropout=dropout).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq))

    def forward():
        return F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())

    saved = saved_activation_bytes(model, forward)
    saved["result"].backward()
    opt.step()
    return model, opt, saved["bytes"]


@pytest.mark.parametrize("overrides,dropout", [
    (dict(), 0.0),
    (dict(layers=3, tied_embeddings=True), 0.1),
    (dict(activation="swiglu", norm="rmsnorm", position="rope", kv_heads=2, bias=False), 0.0),
])
def test_predictions_match_a_real_adamw_step(overrides, dropout):
    cfg = tiny_gpt_config(**overrides)
    model, opt, saved = _train_step(cfg, batch=4, dropout=dropout)
    held = model_state_bytes_held(model, opt)
    # TinyGPT writes attention out (scores stored) and runs SwiGLU eagerly (torchtitan's stack)
    pred = memory_per_gpu(cfg, Parallelism(micro_batch_size=4), precision=precision("fp32", optimizer="adamw"),
                          dropout=dropout > 0, flash_attention=False, stack="torchtitan",
                          mask_bytes=4,  # CPU dropout keeps a float mask (native_dropout is GPU-only)
                          norm_saved=2 if cfg.norm == "rmsnorm" else 1)  # composite nn.RMSNorm
    # model states: exact
    assert pred.parameters == held["parameters"]
    assert pred.gradients == held["gradients"]
    assert pred.optimizer == held["optimizer"]
    assert held["optimizer_scalars"] == 4 * len(list(model.parameters()))  # Adam's 'step' counters
    # activations: within 10% of the storages autograd saved
    assert pred.activations == pytest.approx(saved, rel=0.10)


def test_full_recompute_matches_checkpointed_tinygpt():
    """torch.utils.checkpoint per block keeps only block inputs: the 'full' formula. The rebuilt
    layer (``recompute_buffer``) lives only during backward, so it is not among the saved tensors."""
    cfg = tiny_gpt_config(layers=4)
    idx = torch.randint(0, cfg.vocab, (4, cfg.seq))
    saved = {}
    for ck in (False, True):
        torch.manual_seed(0)
        model = TinyGPT(cfg, checkpoint=ck)
        r = saved_activation_bytes(model, lambda: F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()))
        r["result"].backward()
        saved[ck] = (r["bytes"], model.lm_head.weight.grad.clone())
    torch.testing.assert_close(saved[True][1], saved[False][1])  # same gradients
    pred = memory_per_gpu(cfg, Parallelism(micro_batch_size=4, recompute="full"), precision=precision("fp32"),
                          dropout=False, flash_attention=False, stack="torchtitan")
    kept = pred.activations - pred.activation_detail["recompute_buffer"]
    assert kept == pytest.approx(saved[True][0], rel=0.10)
    assert saved[True][0] < saved[False][0] / 5
