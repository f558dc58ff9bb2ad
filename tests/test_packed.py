"""Packed sequences (``packed_doc_length``): attention within each document, against a block-diagonal
causal mask built from the documents' boundaries (``cu_seqlens``), in FLOPs, in the FlashAttention time
and through ``dtlib plan/flops/memory`` (bad values: one line, exit 2)."""
import json

import numpy as np
import pytest

from dtlib.analytic import validate
from dtlib.analytic.flops import (attention_flops_per_token, flops_report, keys_per_query, shape_of, step_flops)
from dtlib.analytic.hardware import cluster, get_gpu
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.analytic.vectorised import layout_arrays
from dtlib.cli import main
from dtlib.plan.gemm import transformer_compute
from dtlib.plan.steptime import StepOptions, step_time, with_packing

LLAMA = get_preset("llama2-7b")  # seq 4096
SEQ = LLAMA.seq


def packed_mask(lengths):
    """The attention mask of one packed sequence: causal within each document, nothing across (what
    FlashAttention's varlen kernels and Megatron-Core's THD format compute from ``cu_seqlens``)."""
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
    doc = np.searchsorted(cu_seqlens, np.arange(cu_seqlens[-1]), side="right")
    same = doc[:, None] == doc[None, :]
    return same & np.tril(np.ones_like(same))


@pytest.mark.parametrize("lengths", [[16, 16, 16, 16], [5, 20, 7, 32], [64]])
def test_keys_per_query_counts_the_block_diagonal_mask(lengths):
    seq = sum(lengths)
    mask = packed_mask(lengths)
    # documents of equal length L = E[l^2] / E[l] do the same work as the real mix of lengths
    equal = sum(l * l for l in lengths) / seq
    # full convention: every key of the query's document; causal: the mask's pairs, counted continuously
    # (s^2 / 2 per document, Megatron-Core's halving: the mask's diagonal, s / 2 pairs, left out)
    assert seq * keys_per_query(seq, 0, "full", equal) == pytest.approx(sum(l * l for l in lengths))
    assert seq * keys_per_query(seq, 0, "causal", equal) == pytest.approx(mask.sum() - seq / 2)
    assert equal >= np.mean(lengths)  # the mean length would undercount whenever lengths vary


def test_a_document_as_long_as_the_sequence_is_the_unpacked_count_and_a_quarter_of_it_a_quarter():
    shape = shape_of(LLAMA)
    for attention in ("full", "causal"):
        whole = attention_flops_per_token(attention=attention, **shape)
        assert attention_flops_per_token(attention=attention, **shape, packed_doc_length=SEQ) == whole
        assert attention_flops_per_token(attention=attention, **shape, packed_doc_length=SEQ // 4) == pytest.approx(
            whole / 4, rel=1e-12)
    # a sliding window at least as long as the document changes nothing: the document is the span
    assert keys_per_query(SEQ, 2048, "causal", 1024) == keys_per_query(SEQ, 0, "causal", 1024) == 512


def test_the_causal_count_holds_for_a_sequence_whose_square_overflows_int64():
    # s - s^2 / 2s = s / 2: on int64 arrays s * s wraps past 2**31.5 (3.04e9), which gave a negative count
    seq = np.array([2 ** 32, 2 ** 53])
    assert keys_per_query(seq, 0, "causal").tolist() == [2 ** 31, 2 ** 52]


def test_model_flops_count_the_whole_sequence_by_default_and_the_documents_on_request():
    tokens = 8 * SEQ
    shape = shape_of(LLAMA)
    plain = step_flops(tokens, **shape)
    packed = step_flops(tokens, **shape, packed_doc_length=SEQ // 4)
    documents = step_flops(tokens, packed_flops="documents", **shape, packed_doc_length=SEQ // 4)
    saved = 3 * tokens * attention_flops_per_token(**shape) * 3 / 4  # forward and backward of 3/4 of it
    assert packed["model"] == plain["model"]  # Megatron-LM's and torchtitan's MFU convention
    assert plain["hardware"] - packed["hardware"] == pytest.approx(saved, rel=1e-12)
    assert documents["model"] == pytest.approx(documents["hardware"], rel=1e-12)  # no recompute
    with pytest.raises(ValueError, match="packed_flops must be one of"):
        step_flops(tokens, packed_flops="samples", **shape)


@pytest.mark.parametrize("length", [0, SEQ + 1, 2.5, True])
def test_the_api_refuses_a_length_outside_one_to_seq(length):
    message = f"packed_doc_length must be an integer from 1 to {SEQ}"
    with pytest.raises(validate.InvalidArgument, match=message):
        flops_report(LLAMA, 1, packed_doc_length=length)
    with pytest.raises(validate.InvalidArgument, match=message):
        step_time(LLAMA, Parallelism(dp=8), cluster("h100-sxm", 1, 8), packed_doc_length=length)
    with pytest.raises(validate.InvalidArgument, match="unset with a bare parameter count"):
        flops_report(7e9, 1, seq=SEQ, packed_doc_length=512)


def compute(length, flash_attention=True):
    """One layer's attention and the weight GEMMs of Llama 2 7B, dp 8, micro-batch 2, on an H100."""
    n, _ = layout_arrays(LLAMA, {k: np.asarray([v]) for k, v in dict(
        dp=8, tp=1, pp=1, cp=1, ep=1, micro_batch_size=2, num_microbatches=2, gpus=8).items()}, "1f1b", "none",
        on_invalid="raise")
    return transformer_compute(with_packing(n, length), get_gpu("h100-sxm"), recompute="none", dtype="bf16",
                               flash_attention=flash_attention, gemm_efficiency=0.6, attention_efficiency=0.5)


def test_flash_attention_time_scales_with_the_document_length_and_explicit_attention_does_not():
    whole, same, quarter = compute(None), compute(SEQ), compute(SEQ // 4)
    assert same["attention"] == whole["attention"] and same["gemm"] == whole["gemm"]
    assert quarter["attention"] == pytest.approx(whole["attention"] / 4, rel=1e-12)  # matmuls and exponentials
    assert quarter["gemm"] == whole["gemm"]
    # an explicit mask (no varlen kernel) computes every score of the sequence: packing saves nothing
    assert compute(SEQ // 4, False)["attention"] == compute(None, False)["attention"]


def test_the_step_is_faster_by_the_attention_it_no_longer_does():
    c, layout = cluster("h100-sxm", 1, 8), Parallelism(dp=8, micro_batch_size=2, num_microbatches=2)
    whole = step_time(LLAMA, layout, c)
    assert step_time(LLAMA, layout, c, packed_doc_length=SEQ).breakdown == whole.breakdown
    packed = step_time(LLAMA, layout, c, packed_doc_length=SEQ // 4)
    saved = 3 / 4 * compute(None)["attention"][0]
    assert whole.breakdown["compute"] - packed.breakdown["compute"] == pytest.approx(saved, rel=1e-9)
    assert packed.model_flops == whole.model_flops and packed.hardware_flops < whole.hardware_flops
    documents = step_time(LLAMA, layout, c, packed_doc_length=SEQ // 4, options=StepOptions(packed_flops="documents"))
    assert documents.step_time == packed.step_time and documents.model_flops < packed.model_flops


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


PLAN = ("plan", "--model", "llama2-7b", "--gpus", "8", "--global-batch", "32", "--dp", "8", "--tp", "1", "--pp", "1",
        "--micro-batch", "1", "--zero", "1", "--recompute", "none")


@pytest.mark.parametrize("command", [PLAN, ("flops", "--model", "llama2-7b"), ("memory", "--model", "llama2-7b")])
@pytest.mark.parametrize("value", ["0", "4097", "abc"])
def test_cli_refuses_a_length_outside_one_to_seq_in_one_line(capsys, command, value):
    code, out, err = run(capsys, *command, "--packed-doc-length", value)
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0
    assert "--packed-doc-length must be an integer from 1 to 4096" in err


@pytest.mark.parametrize("command", [PLAN, ("flops", "--model", "llama2-7b")])
def test_cli_refuses_documents_flops_when_nothing_is_packed(capsys, command):
    code, out, err = run(capsys, *command, "--packed-flops", "documents")
    assert code == 2 and out == "" and err.strip().count("\n") == 0
    assert "--packed-flops must be 'sequence' (the default) unless --packed-doc-length is given" in err


def test_plan_states_the_packing_and_times_it(capsys):
    code, out, _ = run(capsys, *PLAN, "--packed-doc-length", "512", "--json")
    packed = json.loads(out)
    code_whole, out, _ = run(capsys, *PLAN, "--json")
    whole = json.loads(out)
    assert code == code_whole == 0
    assert packed["assumed"]["packed_doc_length"] == 512 and whole["assumed"]["packed_doc_length"] is None
    assert packed["configs"][0]["step_time_s"] < whole["configs"][0]["step_time_s"]
    code, out, _ = run(capsys, *PLAN, "--packed-doc-length", "512", "--packed-flops", "documents")
    assumed = next(line for line in out.splitlines() if line.startswith("assumed:"))
    assert code == 0 and "packed sequences: documents of 512 tokens" in assumed and "--packed-flops documents" in assumed


def test_flops_and_memory_state_the_packing(capsys):
    code, out, _ = run(capsys, "flops", "--model", "llama2-7b", "--packed-doc-length", "1024", "--json")
    d = json.loads(out)
    assert code == 0 and d["conventions"]["packed_doc_length"] == 1024
    assert any("documents of 1,024 tokens" in note for note in d["notes"])
    code, packed, _ = run(capsys, "memory", "--model", "llama2-7b", "--packed-doc-length", "1024")
    code_whole, whole, _ = run(capsys, "memory", "--model", "llama2-7b")
    assert code == code_whole == 0 and "memory unchanged" in packed
    assert packed.splitlines()[:8] == whole.splitlines()[:8]  # the same bytes
