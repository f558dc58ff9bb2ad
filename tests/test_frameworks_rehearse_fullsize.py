"""``--rehearse``'s full-size part (:mod:`dtlib.frameworks.fullsize`): the planned model at its real
width under fake tensors, FSDP2 as torchtitan applies it, PyTorch's FSDPMemTracker beside
``dtlib memory`` term by term; bad inputs refused in one line."""
import pytest
import torch

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.analytic.units import GiB
from dtlib.cli import main
from dtlib.frameworks.fullsize import (RMSNorm, Transformer, check_fullsize, compare_with_dtlib, measure,
                                       rehearse_full_size)

LLAMA = get_preset("llama3-8b")
GPT = TransformerConfig(name="gpt-small", layers=2, hidden=64, heads=4, vocab=100, seq=32, tied_embeddings=True)


@pytest.mark.parametrize("cfg", [LLAMA, get_preset("llama3-70b"), GPT], ids=lambda c: c.name)
def test_the_module_is_the_preset_parameter_for_parameter(cfg):
    """Built on the meta device: the same count as dtlib's formula (a tied head counted once)."""
    with torch.device("meta"):
        net = Transformer(cfg)
    assert sum(p.numel() for p in net.parameters()) == cfg.num_parameters()


def test_rmsnorm_saving_what_the_gpu_kernel_saves_has_nn_rmsnorms_gradients():
    torch.manual_seed(0)
    ours, reference = RMSNorm(16, eps=1e-5), torch.nn.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(16))
        reference.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(3, 5, 16)
    ours(x).backward(g)
    reference(x2).backward(g)
    torch.testing.assert_close(ours(x), reference(x2))
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.weight.grad, reference.weight.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model, layout, match", [
    (LLAMA, Parallelism(dp=4, pp=2, zero=3), "pp 2 is not measured"),
    (LLAMA, Parallelism(dp=8, zero=1), "zero 1 with dp 8"),
    (LLAMA, Parallelism(dp=8, zero=3, recompute="selective"), "recompute 'selective'"),
    (get_preset("mixtral-8x7b"), Parallelism(dp=8, zero=3), "mixtral-8x7b has moe_experts"),
    (LLAMA, Parallelism(dp=1, tp=3), "heads 32 is not divisible by tp 3"),
])
def test_what_fsdp2_and_tp_cannot_express_is_refused_in_one_line(model, layout, match):
    with pytest.raises(ValueError, match=match) as info:
        check_fullsize(model, layout)
    assert "\n" not in str(info.value)
    assert rehearse_full_size(model, layout) == {"why": str(info.value)}


@pytest.fixture(scope="module")
def two_layers():
    """llama3-8b at full width, vocabulary and 8,192-token sequence, 2 of its 32 layers (a few
    seconds; the whole model is docs/rehearse.md's table), FSDP over 8 ranks."""
    cfg, layout = LLAMA.with_(layers=2), Parallelism(dp=8, zero=3)
    measured = measure(cfg, layout)
    return cfg, measured, compare_with_dtlib(cfg, layout, measured)


def test_full_size_fsdp_matches_dtlib_memory_term_by_term(two_layers):
    """Each term against dtlib's, with each difference's cause as a number:

    * parameters and optimizer: FSDP2's fp32 shards and AdamW's two fp32 moments are dtlib's
      ``fsdp-mixed`` convention exactly (8 divides every dimension sharded: no padding) -- 0.1%;
    * activations: dtlib's count under FlashAttention, no dropout, eager SwiGLU -- within 1% (the
      rope tables cast to bf16 per layer and RMSNorm's fp32 rstd are what dtlib leaves out);
    * gradients: 0 at the peak, which is in the loss's backward, before any gradient exists
      (torchtitan zeroes gradients to None; dtlib counts a gradient buffer that persists);
    * temporary: the bf16 gather of [norm, output] (FSDP2's unit at the peak) plus the loss
      backward's two fp32 vocabulary-sized gradients (nll_loss's and log_softmax's) plus the
      fp32 rope tables -- within 1% of that sum, where dtlib counts the largest unit (the
      embedding) gathered with its gradient at the convention's 4 bytes each (2 x 4 x vocab x hidden).
    """
    cfg, measured, c = two_layers
    rows = c["terms"]
    for term in ("parameters", "optimizer"):
        assert rows[term]["tracker"] == pytest.approx(rows[term]["dtlib"], rel=1e-3), term
    assert rows["activations"]["tracker"] == pytest.approx(rows["activations"]["dtlib"], rel=0.01)
    assert rows["gradients"]["tracker"] == 0 and rows["gradients"]["dtlib"] > 0
    tokens = cfg.seq  # micro-batch 1
    gather = 2 * (cfg.vocab * cfg.hidden + cfg.hidden)  # bf16 output weight and final norm
    loss_backward = 2 * 4 * tokens * cfg.vocab
    rope = cfg.layers * 2 * 4 * cfg.seq * cfg.head_dim
    assert rows["temporary"]["tracker"] == pytest.approx(gather + loss_backward + rope, rel=0.01)
    assert rows["temporary"]["dtlib"] == pytest.approx(2 * 4 * cfg.vocab * cfg.hidden, rel=1e-3)
    assert c["totals"]["tracker"] == pytest.approx(measured.peak) and measured.world_size == 8


def test_plan_rehearse_prints_the_full_size_section(capsys):
    """A small custom model (seconds): the section, labelled, beside dtlib's numbers."""
    code = main(["plan", "--layers", "2", "--hidden", "256", "--heads", "4", "--vocab", "1024", "--seq", "256",
                 "--activation", "swiglu", "--gpus", "8", "--global-batch", "8", "--dp", "8", "--zero", "3",
                 "--top", "1", "--emit", "torchtitan", "--rehearse"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "full size (fake tensors, PyTorch's memory tracker): custom under FSDP2 8 as torchtitan" in out
    assert "rank 0 of 8" in out and "optimizer" in out
    assert "numerics (shrunk run vs one process) under torchtitan: not run" in out


def test_tensor_and_sequence_parallel_differ_from_dtlib_by_named_terms_only():
    """TP 2 + SP x FSDP 2 on a model whose vocabulary dwarfs its width (so a loss counted at the
    global vocabulary would show): each difference is a term dtlib, following Megatron-Core, does
    not count, as bytes:

    * activations: DTensor's ColwiseParallel saves its all-gathered input (s x h) for Q/K/V, for
      w1/w3 and for the output layer, where Megatron saves the 1/tp shard and gathers again in
      backward (2 x s x h x (1 - 1/tp) bytes each), plus the bf16 rope tables of each layer;
    * temporary: loss-parallel cross-entropy's backward, three fp32 tokens x vocab/tp tensors
      -- at vocab/tp, not vocab: DTensor's global-shaped sharding propagation is not counted.
    """
    cfg = TransformerConfig(name="wide-vocab", layers=2, hidden=512, heads=8, kv_heads=4, vocab=65536, seq=2048,
                            activation="swiglu", norm="rmsnorm", position="rope", bias=False)
    layout = Parallelism(dp=2, tp=2, zero=3, sequence_parallel=True)
    measured = measure(cfg, layout)
    rows = compare_with_dtlib(cfg, layout, measured)["terms"]
    s, h, tp = cfg.seq, cfg.hidden, layout.tp
    gathered = (2 * cfg.layers + 1) * 2 * s * h * (1 - 1 / tp)
    rope = cfg.layers * 2 * 2 * s * cfg.head_dim
    assert rows["activations"]["tracker"] == pytest.approx(rows["activations"]["dtlib"] + gathered + rope, rel=1e-3)
    categories = measured.categories
    assert categories["Temp"] == pytest.approx(3 * 4 * s * cfg.vocab / tp, rel=1e-3)


def test_a_gpt_with_a_tied_head_shards_and_its_model_states_are_dtlibs():
    """Learned positions, LayerNorm with biases, GELU and a tied head (one FSDP2 group for the shared
    weight): parameters and optimizer state per rank as dtlib counts them."""
    rows = rehearse_full_size(GPT, Parallelism(dp=2, zero=3))["comparison"]["terms"]
    for term in ("parameters", "optimizer"):
        assert rows[term]["tracker"] == pytest.approx(rows[term]["dtlib"], rel=0.01), term
