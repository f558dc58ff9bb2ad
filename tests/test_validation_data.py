"""The validation data (dtlib.plan.published): every row carries its link, source, metric and unit;
no row is there twice; the counts per GPU family, precision and stack; the numbers and shapes are
the sources' (spot checks against the published tables); the rows waiting for issue 26's names
fail loudly; and the one-pass grid gives the same numbers as one search per grid point."""
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from dtlib.analytic import hardware, presets
from dtlib.plan import published as data
from dtlib.plan.published import (INCLUDE_DEEPSEEK_V3, INCLUDE_PENDING, LAYOUT_KEYS, METRIC_UNITS, PUBLISHED,
                                  SOURCES, STACKS, deepseek_v3_runs, pending_runs)
from dtlib.plan.steptime import DTYPES, resolve
from dtlib.plan.validation import _options, _prediction, error_grid, ignored, predict


def test_every_row_has_a_link_a_source_a_metric_and_a_unit():
    for run in PUBLISHED:
        assert "https://" in run.reference, run.name
        assert run.source in SOURCES and run.source, run.name
        assert run.metric in METRIC_UNITS and run.unit == METRIC_UNITS[run.metric] and run.published > 0, run.name
        assert run.stack in STACKS and set(run.layout) <= set(LAYOUT_KEYS), run.name
        assert run.dtype in DTYPES and (run.fp8_recipe == "" or run.dtype == "fp8"), run.name
        if {"dp", "tp", "pp", "cp"} <= set(run.layout):  # a full layout multiplies to the GPU count
            lay = run.layout
            assert lay["dp"] * lay["tp"] * lay["pp"] * lay["cp"] == run.cluster.world_size, run.name


def test_no_row_is_there_twice():
    """No configuration twice, except one re-measurement across torchtitan's two benchmark files
    (Llama 3.1 70B, FSDP 32 x TP 8, Float8: 829 tokens/s in Dec 2024, 809.8 with vanilla TP in June 2025)."""
    assert len({r.name for r in PUBLISHED}) == len(PUBLISHED)
    rows: dict[tuple, list[str]] = {}
    for r in PUBLISHED:
        key = (r.model, r.cluster.gpu.name, r.cluster.world_size, r.cluster.inter.name, r.global_batch,
               tuple(sorted(r.layout.items())), r.dtype, r.fp8_recipe, resolve(_options(r), r.dropout), r.fine_tuning)
        rows.setdefault(key, []).append(r.name)
    twice = [names for names in rows.values() if len(names) > 1]
    assert twice == [["Llama 3.1 70B, FSDP 32 x TP 8, compile + Float8 (torchtitan T4)",
                      "Llama 3.1 70B, FSDP 32 x TP 8, float8 tensorwise, vanilla TP (torchtitan asyncTP)"]]


def test_counts_per_source_family_precision_and_stack():
    """Issue 26 item 8: at least 8 sources and 60 runs across A100, H100, H200, B200 and GB200 (and GB300),
    BF16 and FP8, dense and MoE, the four stacks."""
    assert INCLUDE_PENDING is True and INCLUDE_DEEPSEEK_V3 is True and len(PUBLISHED) == 186 and len(SOURCES) == 17
    assert Counter(r.source for r in PUBLISHED) == {
        "MosaicML llm-foundry": 18, "torchtitan": 15, "Narayanan 2021": 10, "NeMo 2024": 18, "NeMo 2025": 12,
        "Megatron-Bridge": 32, "Korthikanti 2022": 4, "DeepSpeed Azure 2022": 3, "Llama 3 2024": 3, "Trainy H200": 2,
        "BLOOM 2022": 1, "DeepSeek-V3 2024": 1, "Megatron-Bridge NVFP4": 4, "NeMo 2024 fine-tuning": 6,
        "Megatron-Bridge fine-tuning": 10, "DGXC 2025": 45, "AMD Primus 2026": 2}
    assert Counter(r.family for r in PUBLISHED) == {"h100": 75, "a100": 23, "b200": 14, "gb200": 54, "gb300": 15,
                                                    "h200": 2, "h800": 1, "mi325x": 1, "mi355x": 1}
    assert Counter(r.dtype for r in PUBLISHED) == {"bf16": 79, "fp8": 103, "nvfp4": 4}
    assert Counter(r.stack for r in PUBLISHED) == {"megatron": 144, "torchtitan": 20, "fsdp": 18, "deepspeed": 4}
    assert Counter(r.metric for r in PUBLISHED) == {"tokens_per_gpu_s": 111, "hardware_tflops_per_gpu": 14,
                                                    "step_time_s": 49, "model_tflops_per_gpu": 12}
    assert Counter(r.model.name for r in PUBLISHED if r.model.moe_experts) == {
        "mixtral-8x7b": 2, "mixtral-8x22b": 3, "deepseek-v3": 11, "grok1-314b": 8, "llama4-maverick": 8,
        "gpt-oss-120b": 4, "qwen3-30b-a3b": 4, "qwen3-235b-a22b": 4}


def test_published_numbers_are_the_new_sources():
    by_source = {s: [r for r in PUBLISHED if r.source == s] for s in SOURCES}
    assert [r.published for r in by_source["NeMo 2024"]] == [23406, 5851, 716, 825, 16934, 8715, 1728, 12273, 1524,
                                                             768, 730, 660, 610, 574, 555, 549, 549, 536]
    assert [r.published for r in by_source["Trainy H200"]] == [10938, 10753]
    assert [(r.published, r.cluster.gpu.name, r.global_batch) for r in by_source["AMD Primus 2026"]] == [
        (16186, "mi325x", 128), (3534, "mi355x", 128)]
    assert [r.published for r in by_source["NeMo 2025"]] == [1600, 26006, 3062, 625, 15457, 2232,
                                                             1804, 33099, 4035, 665, 19275, 2731]
    assert [r.published for r in by_source["DeepSpeed Azure 2022"]] == [204.49, 165.36, 157]
    assert [r.published for r in by_source["Llama 3 2024"]] == [430, 400, 380]
    assert [r.published for r in by_source["MosaicML llm-foundry"]] == [
        1007, 1058, 2199, 5080, 10475, 23422, 44123, 4792, 6935, 12025, 27965, 30586, 32010, 410, 916, 2262, 4641,
        20513]
    assert [r.published for r in by_source["Megatron-Bridge NVFP4"]] == [7296, 4864, 1440, 1184]
    # DGXC 25.07's step times, table by table (llama3.1, nemotron, deepseek_v3/pretraining, grok1, llama4 READMEs)
    assert [r.published for r in by_source["DGXC 2025"]] == [
        9.347, 9.484, 9.508, 6.131, 6.183, 6.244, 19.810, 13.020, 2.746, 1.988, 4.606, 3.107, 2.189, 2.19, 2.229,
        1.483, 1.517, 1.549, 32.66, 16.58, 8.468, 21.83, 11.21, 5.668, 48.948, 52.04, 34.168, 34.194, 34.274,
        7.325, 7.39, 7.324, 5.298, 5.224, 5.193, 15.933, 13.433, 7.781, 7.859, 7.992, 6.093, 6.223, 6.327, 4.426, 3.855]
    # what the recipes' code sets beyond the tables: BF16 gradients but DeepSeek-V3's, whose script also
    # turns TP overlap off and splits its layers 64/PP - 1 first, 64/PP - 2 last
    dgxc = by_source["DGXC 2025"]
    assert {r.precision for r in dgxc if not r.name.startswith("DeepSeek")} == {"bf16-mixed"}
    seek = [r for r in dgxc if r.name.startswith("DeepSeek")]
    assert {(r.precision, r.tp_overlap) for r in seek} == {("megatron-bf16", 0.0)}
    assert [(r.layout["pp"], r.layout["first_stage_layers"], r.layout["last_stage_layers"]) for r in seek] == [
        (8, 7, 6), (16, 3, 2), (4, 15, 14), (4, 15, 14), (4, 15, 14)]
    assert {r.model.moe_capacity_factor for r in dgxc if r.model.moe_experts} == {1.0}
    # docs/validation.md: Grok-1 as NeMo builds it 316.5B, Llama 4 Maverick 400.7B with 17.2B active
    grok = next(r.model for r in dgxc if r.name.startswith("Grok1"))
    maverick = next(r.model for r in dgxc if r.name.startswith("Llama4"))
    assert round(grok.num_parameters() / 1e9, 1) == 316.5 and maverick.moe_layers == 24
    assert (round(maverick.num_parameters() / 1e9, 1), round(maverick.active_parameters() / 1e9, 1)) == (400.7, 17.2)
    assert {r.dtype for r in by_source["Megatron-Bridge NVFP4"]} == {"nvfp4"}
    tuned = by_source["NeMo 2024 fine-tuning"]
    assert [r.published for r in tuned] == [16891, 10176, 1816, 24824, 14629, 2621]
    assert [(r.finetune, r.lora_rank, r.lora_targets) for r in tuned] == [("full", None, None)] * 3 + [
        ("lora", 32, ("q_proj", "k_proj", "v_proj"))] * 3
    bridge = by_source["Megatron-Bridge fine-tuning"]
    assert [r.published for r in bridge] == [4819, 4312, 3864, 3593, 1638, 7481, 7447, 6206, 5958, 2643]
    assert [(r.finetune, r.lora_rank, r.lora_targets) for r in bridge] == [("full", None, None)] * 5 + [
        ("lora", 16, ("q_proj", "k_proj", "v_proj"))] * 5
    tuning = {"NeMo 2024 fine-tuning", "Megatron-Bridge fine-tuning"}
    assert {r.finetune for r in PUBLISHED if r.source not in tuning} == {"full"}
    mx = [r.published for r in by_source["Megatron-Bridge"] if r.fp8_recipe == "mxfp8"]
    assert mx == [29521, 624, 36108, 4357, 28934, 29789, 4018, 23766, 2139, 9299, 3269]


def test_nemo_2025_rows_give_the_tables_gradient_accumulation():
    """The GA column of the NeMo 25.02 / 25.04 tables follows from each row as transcribed (GBS over
    MBS x DP): a check on every layout cell, and on the Mixtral-8x22B rows, whose printed GBS 1 and
    MBS 64 are the two columns swapped (GA 16 = 64 / (1 x 4))."""
    rows = [r for r in PUBLISHED if r.source == "NeMo 2025"]
    ga = [r.global_batch // (r.layout["dp"] * r.layout["micro_batch_size"]) for r in rows]
    assert ga == [32, 8, 32, 32, 2, 16, 16, 8, 2, 32, 2, 16]
    assert {r.fp8_recipe for r in rows if "(NeMo 25.04)" in r.name} == {"current"}  # the 25.04 text states it
    racks = [r for r in rows if r.family == "gb200"]
    assert [r.cluster.gpus_per_node for r in racks] == [64, 8, 64, 64, 64, 64]  # NVL72: one domain up to 64


def test_deepseek_v3_report_row_as_the_report_states_it():
    """180K H800 GPU hours per trillion tokens is 1,543 tokens/s/GPU; PP 16 x EP 64 x ZeRO-1 DP on
    2,048 GPUs, DualPipe's EP overlap, RMSNorm and MLA up-projections recomputed, fine-grained FP8."""
    (run,) = deepseek_v3_runs()
    assert INCLUDE_DEEPSEEK_V3 is True and run.name in {r.name for r in PUBLISHED}
    assert run.published == pytest.approx(1543.2, abs=0.05) and run.cluster.world_size == 2048
    lay = run.layout
    assert (lay["tp"], lay["pp"], lay["ep"], lay["dp"], lay["zero"]) == (1, 16, 64, 128, 1)
    assert lay["recompute_modules"] == ("layernorm", "mla_up_proj") and run.ep_overlap == 1.0
    assert run.fp8_recipe == "blockwise" and run.dtype == "fp8"
    assert run.cluster.gpu.name == "h800" and run.cluster.intra.name == "nvlink-h800"
    assert "https://arxiv.org/abs/2412.19437" in run.reference


# llm-foundry's NumParams column for the rows' (model, seq): learned positions make it grow with seq
MPT_PARAMS = {("mpt-70b", 2048): 64862437376, ("mpt-30b", 2048): 29975214080, ("mpt-13b", 2048): 12853954560,
              ("mpt-7b", 2048): 6658859008, ("mpt-3b", 2048): 2651837440, ("mpt-1b", 2048): 1315950592,
              ("mpt-7b", 8192): 6684024832, ("mpt-1b", 32768): 1378865152, ("mpt-3b", 512): 2647905280,
              ("mpt-1b", 8192): 1328533504}


def test_model_shapes_give_the_published_parameter_counts():
    mpt = [r for r in PUBLISHED if r.source == "MosaicML llm-foundry"]
    for run in mpt:
        assert run.model.num_parameters() == MPT_PARAMS[run.model.name, run.model.seq], run.name


def test_published_run_rejects_bad_rows():
    run = PUBLISHED[0]
    with pytest.raises(ValueError, match="stack must be one of"):
        replace(run, stack="jax")
    with pytest.raises(ValueError, match="metric must be one of"):
        replace(run, metric="mfu")
    with pytest.raises(ValueError, match=r"unknown layout keys \['pipeline'\]"):
        replace(run, layout={"pipeline": 2})


def test_pending_rows_fail_loudly_until_the_contract_names_exist():
    """Nothing is skipped silently: either every pending row builds, or the first missing name raises."""
    try:
        rows = pending_runs()
    except ValueError as exc:
        assert any(name in str(exc) for name in ("gb300", "gb200", "deepseek-v3", "gpt-oss-120b", "qwen3"))
    else:
        assert len(rows) == 25


def test_pending_rows_build_with_stand_in_names(monkeypatch):
    """The pending rows' own arithmetic (layouts, clusters) is right today: with stand-ins for the
    missing names (B200 for the racks, Llama 3 8B for the MoE presets) all 25 build."""
    real_gpu, real_preset = hardware.get_gpu, presets.get_preset
    monkeypatch.setattr(data, "get_preset", lambda name: real_preset(name if name in presets.PRESETS else "llama3-8b"))
    monkeypatch.setattr(hardware, "get_gpu", lambda name: real_gpu("b200" if name.startswith("gb") else name))
    rows = pending_runs()
    assert len(rows) == 25 and len({r.name for r in rows}) == 25
    for run in rows:
        lay = run.layout
        assert lay["dp"] * lay["tp"] * lay["pp"] * lay["cp"] == run.cluster.world_size, run.name
        assert run.global_batch % (lay["dp"] * lay["micro_batch_size"]) == 0, run.name
        assert lay["etp"] == 1 and run.source == "Megatron-Bridge" and run.stack == "megatron"
    racks = [r for r in rows if r.name.split(" x ")[-1].startswith("GB")]
    assert len(racks) == 18 and {r.cluster.gpus_per_node for r in racks} == {8, 64}


def test_untimed_knobs_are_reported_not_dropped():
    h100_8b = next(r for r in PUBLISHED if r.name.startswith("llama3-8b FP8-CS, 8 x H100"))
    assert h100_8b.layout["recompute_layers"] == 5  # recipe: recompute_num_layers=5
    assert predict(h100_8b, rank=False)["ignored"] == ignored(h100_8b)


def test_one_pass_grid_equals_one_search_per_point():
    """error_grid's one step-time pass per run gives :func:`_prediction`'s numbers (same layouts
    enumerated, fastest picked) on two rows of every source, and the LoRA ones, at off-grid efficiencies."""
    runs = [r for s in SOURCES for r in [x for x in PUBLISHED if x.source == s][:2]]
    runs += [r for r in PUBLISHED if r.finetune == "lora"]
    gemm, attention = (0.45, 0.73), (0.22, 0.61)
    fast = error_grid(gemm, attention, runs=runs)
    for i, g in enumerate(gemm):
        for j, a in enumerate(attention):
            slow = [np.log(_prediction(r, g, a) / r.published) for r in runs]
            np.testing.assert_allclose(fast[i, j], slow, rtol=0, atol=1e-12)


def test_the_table_and_the_fits_time_the_same_layout():
    """Every row's error in the table (:func:`predict`) is the error the fits see at the same
    efficiencies: both time the fastest layout of the published flags that fits dtlib's memory model
    (the limit lifted only when none fits). Five rows once differed, Llama 3 405B on 8,192 GPUs by
    22 points: the fits timed an interleaved ZeRO-1 layout the memory model rejects."""
    fast = error_grid((0.6,), (0.5,))
    for r, run in enumerate(PUBLISHED):
        row = predict(run, 0.6, 0.5, rank=False)
        assert np.log(row["predicted"] / run.published) == pytest.approx(fast[0, 0, r], abs=1e-12), run.name
        if row["fits"]:
            assert row["memory_gib"] * 2 ** 30 <= run.cluster.gpu.memory_bytes, run.name


def test_a_row_no_layout_can_run_gets_a_clear_error():
    run = next(r for r in PUBLISHED if r.name.startswith("Llama 3 405B, 8,192"))
    bad = replace(run, layout=dict(run.layout, virtual_stages=8, micro_batch_size=3))
    with pytest.raises(ValueError, match="no layout of its published flags"):
        predict(bad, rank=False)


def test_bridge_rows_overlap_what_their_recipe_notes_say():
    """moe_a2a_overlap in a row's recipe note <=> ep_overlap 1; 'no TP communication overlap' <=> tp_overlap 0."""
    for run in pending_runs():
        assert (run.ep_overlap == 1.0) == ("moe_a2a_overlap" in run.note), run.name
        assert (run.tp_overlap == 0.0) == ("no TP communication overlap" in run.note), run.name


def test_nemo_finetuning_flops_per_token_are_dtlibs():
    """NeMo 24.07's fine-tuning table prints model TFLOP/s beside tokens/s: their ratio is NeMo's FLOPs
    per token. dtlib's count of the weights' FLOPs agrees within 1% on all six rows: 6N per token for SFT,
    and for LoRA 4N of the frozen weights (forward + activation gradients, no weight gradients) + 6 x the
    rank-32 QKV adapters; a LoRA count of 6N would be 50% off. Attention is left out of both: the column
    counts almost none (the sequences are packed from short SQuAD samples), while dtlib's full count over
    4,096 tokens is 16% above it for 7B SFT, the bias docs/validation.md states for these rows."""
    from dtlib.analytic.flops import attention_flops_per_token, flops_report

    runs = [r for r in PUBLISHED if r.source == "NeMo 2024 fine-tuning"]
    assert len(runs) == len(data.NEMO_FINETUNING) == 6
    for (label, task, gpus, tp, pp, tps, tflops), run in zip(data.NEMO_FINETUNING, runs):
        assert label in run.name and task in run.name and run.published == tps
        nemo = tflops * 1e12 / tps
        report = flops_report(run.model, 1, finetune=run.fine_tuning)
        attention = 3 * attention_flops_per_token(attention="full", **run.model.numbers())
        assert report["flops_per_token"] - attention == pytest.approx(nemo, rel=0.01), run.name
    seven_b = flops_report(runs[0].model, 1)["flops_per_token"]
    assert seven_b / (673e12 / 16891) == pytest.approx(1.157, abs=0.005)


def test_a_published_run_checks_its_fine_tuning():
    run = next(r for r in PUBLISHED if r.finetune == "lora")
    with pytest.raises(ValueError, match="lora_rank"):
        replace(run, lora_rank=None)
    with pytest.raises(ValueError, match="lora_targets"):
        replace(run, lora_targets=("q_proj", "wq"))
    with pytest.raises(ValueError, match="lora_rank must be unset unless finetune is 'lora'"):
        replace(run, finetune="full", lora_targets=None)
    with pytest.raises(ValueError, match="finetune"):
        replace(run, finetune="qlora")


def test_bridge_finetuning_rows_are_the_26_06_tables():
    """Megatron-Bridge 26.06's SFT and LoRA tables (Llama 3 70B, seq 4096, GBS 32, MBS 1), row by row:
    GPUs, TP, PP, VP as printed, DP the rest; FP8 = current scaling (the ``*_fp8cs_config`` recipes),
    MXFP8 = mxfp8; BF16 gradients; one NVL72 rack's 32 or 8 GPUs in one NVLink domain, DGX-H100 nodes of 8."""
    runs = [r for r in PUBLISHED if r.source == "Megatron-Bridge fine-tuning"]
    assert len(runs) == len(data.BRIDGE_FINETUNING) == 10
    for (task, system, precision, gpus, tp, pp, vp, tps, _), run in zip(data.BRIDGE_FINETUNING, runs):
        lay = run.layout
        assert f"{task} {precision}" in run.name and run.published == tps and run.cluster.world_size == gpus
        assert (lay["tp"], lay["pp"], lay["virtual_stages"], lay["dp"]) == (tp, pp, vp, gpus // (tp * pp)), run.name
        assert (run.global_batch, lay["micro_batch_size"], run.model.seq, run.model.name) == (32, 1, 4096,
                                                                                                "llama3-70b")
        assert run.fp8_recipe == {"FP8": "current", "MXFP8": "mxfp8"}[precision] and run.precision == "bf16-mixed"
        assert run.finetune == ("lora" if task == "LoRA" else "full") and run.family == run.cluster.gpu.name.split("-")[0]
        assert run.cluster.gpus_per_node == (8 if system == "DGX-H100" else gpus), run.name
        assert "067f987df03b8355b03192d88d70f1709fedf51a" in run.reference and "llama3.py:" in run.note
    # GA = GBS / (MBS x DP): 2 micro-batches per step on the GB300 SFT row, 32 on the H100 LoRA row
    assert [32 // r.layout["dp"] for r in runs] == [2, 2, 8, 8, 16, 8, 8, 8, 16, 32]


def test_bridge_finetuning_flops_per_token_are_dtlibs():
    """The 26.06 tables print model TFLOP/s beside tokens/s (tokens = GBS x 4,096 per step, padding
    included: train_utils.py at v0.5.0, the 26.06 release): their ratio is Megatron-Bridge's FLOPs per
    token. SFT: v0.5.0 counts causal attention over the whole 4,096-token row (flop_utils.py:657,
    ``seq_length**2`` per row, train_utils.py:1122); the column's attention share, above dtlib's
    no-attention count, is within 15% of dtlib's causal count over the whole row (an effective length
    of 3.5K-4.7K tokens, not a SQuAD sample's): no sample length in it. LoRA: v0.5.0 counts 2/3 of
    6N for the frozen weights (flop_utils.py:388-396), no adapters, and attention as the packed rows'
    sum of squared sample lengths; the column is dtlib's LoRA count without attention (4N frozen +
    rank-16 QKV adapters) within 0.5%, and what is left for attention scatters around zero across the
    five rows (below 3% of a whole row's): one number per row cannot give both the rows' fill and the
    samples' lengths, so no citable length; the rows are timed unpacked (docs/validation.md)."""
    from dtlib.analytic.flops import attention_flops_per_token, flops_report

    runs = [r for r in PUBLISHED if r.source == "Megatron-Bridge fine-tuning"]
    left = []
    for (task, *_, tps, tflops), run in zip(data.BRIDGE_FINETUNING, runs):
        bridge = tflops * 1e12 / tps
        causal = flops_report(run.model, 1, attention="causal", finetune=run.fine_tuning)["flops_per_token"]
        row = 3 * attention_flops_per_token(attention="causal", **run.model.numbers())
        if task == "SFT":
            assert bridge == pytest.approx(causal, rel=0.01), run.name
            assert 0.85 < (bridge - (causal - row)) / row < 1.15, run.name
        else:
            assert bridge == pytest.approx(causal - row, rel=0.005), run.name
            left.append((bridge - (causal - row)) / (2 * row))  # of the whole row's unhalved attention
    assert max(abs(x) for x in left) < 0.03 and min(left) < 0 < max(left)
