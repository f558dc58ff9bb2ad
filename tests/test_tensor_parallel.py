"""Tensor and sequence parallelism (dtlib.parallel.tensor): equal to one process, equal to
PyTorch's DTensor TP, collectives counted per block, activation memory per rank against
Korthikanti et al. 2022 Table 2, and bad input refused before any collective.

Few launches (process start-up dominates): one 2-rank launch (tp=2, DTensor, bad input) and one
4-rank launch (tp=4, dp2 x tp2); each rank runs every configuration and returns numbers, which
the tests below assert on.

Tolerances: fp32 throughout. Tensor parallelism sums the same products in another order
(row-parallel partial sums added by the all-reduce, the loss's softmax from per-shard sums), so
results agree to rounding, ~1e-7 relative per operation: losses within 1e-6, gradients within
1e-6 absolute (they are up to ~1e-2). Parameters after 5 AdamW steps (lr 1e-3) within 5e-6:
Adam divides by sqrt(v), so an entry whose gradient is tiny (~1e-9, carrying ~1e-11 of rounding)
moves by ~lr whatever its size, and its rounding becomes ~1e-3 of that step: 5 steps x lr x 1e-3
= 5e-6 (measured: at most 1.3e-6). The key bias is left out of that comparison: its exact gradient
is zero (adding b_k to every key adds q.b_k to every score of a row, which softmax ignores), so
both runs move it by Adam-normalised rounding noise alone; its gradient is compared (~1e-11).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.analytic.comm import strategy_volumes
from dtlib.experiments.tensor import block_behaviour, predicted_layer_bytes
from dtlib.launcher import launch
from dtlib.measure import CollectiveCounter
from dtlib.models import TinyGPT, tiny_gpt_config
from dtlib.parallel import BucketedDDP, tensor_parallel
from dtlib.parallel.dtensor import dtensor_full_grads, parallelize_tinygpt
from dtlib.parallel.tensor import (ColumnParallelLinear, RowParallelLinear,
                                   allreduce_sequence_parallel_grads, full_grad_dict,
                                   full_state_dict, initialize_model_parallel,
                                   model_parallel_ranks, vocab_parallel_cross_entropy)
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.precision import get_precision

TIMEOUT = 120
LOSS_TOL, GRAD_TOL, STATE_TOL = 1e-6, 1e-6, 5e-6
STEPS, LR, BATCH = 5, 1e-3, 2
BASE = dict(layers=2, hidden=32, vocab=64, seq=16)
# together they cover GELU/SwiGLU, MHA/GQA, learned/rotary/ALiBi positions, LayerNorm/RMSNorm,
# biases, tied embeddings and an embedding norm
CONFIGS = {
    "gelu-mha-learned": dict(heads=4, activation="gelu", position="learned"),
    "swiglu-gqa-rope": dict(heads=8, kv_heads=4, activation="swiglu", ffn=64, position="rope",
                            norm="rmsnorm", bias=False),
    "gelu-gqa-alibi-tied": dict(heads=8, kv_heads=4, position="alibi", tied_embeddings=True,
                                embedding_norm=True),
}


def _cfg(name):
    return tiny_gpt_config(**BASE, **CONFIGS[name])


def _model(name, checkpoint=False):
    torch.manual_seed(0)
    return TinyGPT(_cfg(name), checkpoint=checkpoint)


def _batches(cfg, batch=BATCH, steps=STEPS):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g) for _ in range(steps)]


def _max_diff(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _without_key_bias(state, cfg):
    """``state`` with the K slice of every QKV bias zeroed (see the module docstring)."""
    out = dict(state)
    for k, v in state.items():
        if k.endswith("attn.qkv.bias"):
            out[k] = v.clone()
            out[k][cfg.hidden:cfg.hidden + cfg.kv_heads * cfg.head_dim] = 0.0
    return out


def _reference(name, batches):
    """Single-process TinyGPT: first-step loss and gradients, parameters after all steps."""
    model = _model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for i, tokens in enumerate(batches):
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if i == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters(remove_duplicate=False)}
            first = loss.item(), grads
        opt.step()
    return first[0], first[1], {k: v.clone() for k, v in model.state_dict().items()}


def _tp_step(model, tokens, group, microbatches=1):
    """A plain training step: backward and nothing else (sequence-parallel gradients are summed
    by the model itself); ``microbatches`` > 1 accumulates gradients over equal slices."""
    total = 0.0
    for part in tokens.tensor_split(microbatches):
        logits = model(part[:, :-1])
        loss = vocab_parallel_cross_entropy(logits, part[:, 1:], group) / microbatches
        loss.backward()
        total += loss.item()
    return torch.tensor(total)


def _vs_single_process(name, sp, group, batches, checkpoint=False, microbatches=1, grads="backward"):
    """Our TP run of config ``name``: diffs against one process, and the logits' shape.
    ``grads="manual"``: the training loop sums the sequence-parallel gradients itself, calling
    allreduce_sequence_parallel_grads (Megatron's finalize_model_grads) after the backward."""
    ref_loss, ref_grads, ref_state = _reference(name, batches)
    model = tensor_parallel(_model(name, checkpoint), group, sequence_parallel=sp, sequence_parallel_grads=grads)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = {}
    for i, tokens in enumerate(batches):
        opt.zero_grad()
        loss = _tp_step(model, tokens, group, microbatches)
        if grads == "manual" or i == 1:  # harmless where the model already summed them
            allreduce_sequence_parallel_grads(model)
        if i == 0:
            out["loss"] = abs(loss.item() - ref_loss)
            out["grads"] = _max_diff(full_grad_dict(model, group), ref_grads)
            out["logits_shape"] = tuple(model(tokens[:, :-1]).shape)
        opt.step()
    cfg = _cfg(name)
    out["state"] = _max_diff(_without_key_bias(full_state_dict(model, group), cfg),
                             _without_key_bias(ref_state, cfg))
    out["local_params"] = sum(p.numel() for p in model.parameters())
    return out


# ---- behaviour: collectives and activation memory of one block ------------------------------------
def _block_behaviour(name, sp, group):
    """dtlib.experiments.tensor.block_behaviour (CollectiveCounter), and PyTorch's CommDebugMode
    counting a forward and backward of the same block."""
    from torch.distributed.tensor.debug import CommDebugMode
    cfg, t = _cfg(name), dist.get_world_size(group)
    # the block's own collectives: the once-per-backward sum of the norms' gradients is not one
    model = tensor_parallel(_model(name), group, sequence_parallel=sp, sequence_parallel_grads="manual")
    out = block_behaviour(model, BATCH)
    x = torch.randn(BATCH, cfg.seq // t if sp else cfg.seq, cfg.hidden, requires_grad=True)
    with CommDebugMode() as mode:
        model.blocks[0](x).sum().backward()
    out["comm_debug_counts"] = {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}
    return out


# ---- PyTorch's own TP on the same model ------------------------------------------------------------
def _ours_vs_dtensor(name, sp, group, mesh, tokens):
    """Loss and full gradients of our TP and of DTensor TP on the same batch."""
    ours = tensor_parallel(_model(name), group, sequence_parallel=sp)
    ours_loss = _tp_step(ours, tokens, group)
    theirs = parallelize_tinygpt(_model(name), mesh, sequence_parallel=sp)
    logits = theirs(tokens[:, :-1])
    theirs_loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    theirs_loss.backward()
    return {"loss": abs(ours_loss.item() - theirs_loss.item()),
            "grads": _max_diff(full_grad_dict(ours, group), dtensor_full_grads(theirs, mesh))}


def _layers(rank, world_size):
    """ColumnParallelLinear(gather_output=True) -> RowParallelLinear(input_is_parallel=False)
    against the two nn.Linear they were cut from: output, input gradient, weight gradients."""
    torch.manual_seed(3)
    built = ColumnParallelLinear(8, 12)  # same seed: the slice of nn.Linear(8, 12)
    torch.manual_seed(3)
    first, second = torch.nn.Linear(8, 12), torch.nn.Linear(12, 8, bias=False)
    col = ColumnParallelLinear.from_linear(first, gather_output=True)
    row = RowParallelLinear.from_linear(second, input_is_parallel=False)
    x = torch.randn(2, 3, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    row(col(x)).square().sum().backward()
    second(first(x_ref)).square().sum().backward()
    return max((x.grad - x_ref.grad).abs().max().item(),
               (col.weight.grad - first.weight.grad.chunk(world_size)[rank]).abs().max().item(),
               (col.bias.grad - first.bias.grad.chunk(world_size)[rank]).abs().max().item(),
               (row.weight.grad - second.weight.grad.chunk(world_size, 1)[rank]).abs().max().item(),
               (built.weight - first.weight.chunk(world_size)[rank]).abs().max().item())


# ---- the launches ------------------------------------------------------------------------------------
def _two_ranks(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    torch.use_deterministic_algorithms(True)
    out = {"tp": {}, "behaviour": {}, "dtensor": {}, "errors": {}}
    for name in CONFIGS:
        batches = _batches(_cfg(name))
        for sp in (False, True):
            out["tp"][name, sp] = _vs_single_process(name, sp, None, batches)
            out["behaviour"][name, sp] = _block_behaviour(name, sp, None)
    mesh = init_device_mesh("cpu", (world_size,))
    for name, sp in [("gelu-mha-learned", False), ("swiglu-gqa-rope", False), ("swiglu-gqa-rope", True)]:
        out["dtensor"][name, sp] = _ours_vs_dtensor(name, sp, None, mesh, _batches(_cfg(name))[0])
    out["checkpoint"] = {sp: _vs_single_process("swiglu-gqa-rope", sp, None,
                                                _batches(_cfg("swiglu-gqa-rope")), checkpoint=True)
                         for sp in (False, True)}
    out["recompute_all_reduces"] = _recompute_all_reduces()
    out["errors"] = _bad_input(rank)
    out["layers"] = _layers(rank, world_size)
    out["sp_grads"] = _sp_grads()
    return out


def _four_ranks(rank, world_size):
    torch.use_deterministic_algorithms(True)
    out = {"tp": {}, "behaviour": {}}
    for name in CONFIGS:
        batches = _batches(_cfg(name))
        for sp in (False, True):
            out["tp"][name, sp] = _vs_single_process(name, sp, None, batches)
            out["behaviour"][name, sp] = _block_behaviour(name, sp, None)
    out["dp_tp"] = {sp: _dp_tp(rank, sp) for sp in (False, True)}
    out["sp_grads"] = _sp_grads()
    return out


def _sp_grads():
    """Sequence parallelism with a plain training loop: gradient accumulation over 2
    micro-batches (RMSNorm + GQA, tied embeddings + embedding norm), the manual mode with
    Megatron's explicit call, and the all-reduces of a step's backward by mode."""
    runs = {}
    for name in ("swiglu-gqa-rope", "gelu-gqa-alibi-tied"):
        runs[name, "accumulate"] = _vs_single_process(name, True, None, _batches(_cfg(name), batch=4),
                                                     microbatches=2)
    runs["gelu-mha-learned", "manual"] = _vs_single_process("gelu-mha-learned", True, None,
                                                           _batches(_cfg("gelu-mha-learned")), grads="manual")
    tokens = _batches(_cfg("swiglu-gqa-rope"), batch=4)[0]
    calls = {}
    for mode in ("backward", "manual"):
        model = tensor_parallel(_model("swiglu-gqa-rope"), sequence_parallel=True, sequence_parallel_grads=mode)
        with CollectiveCounter() as counter:
            _tp_step(model, tokens, None, microbatches=2)
        calls[mode] = [c for c in counter.calls if c[0] == "all_reduce"]
        sp_bytes = [4 * p.numel() for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    return {"runs": runs, "all_reduces": calls, "sp_bytes": sp_bytes}


def _dp_tp(rank, sp):
    """dp=2 x tp=2: each DP replica takes half the batch; BucketedDDP averages over the DP group."""
    name = "swiglu-gqa-rope"
    tp_group, dp_group = initialize_model_parallel(2)
    batches = _batches(_cfg(name), batch=4)
    _, _, ref_state = _reference(name, batches)
    model = tensor_parallel(_model(name), tp_group, sequence_parallel=sp)
    ddp = BucketedDDP(model, bucket_size_mb=0.01, process_group=dp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    dp_rank = dist.get_rank(dp_group)
    for tokens in batches:
        opt.zero_grad()
        mine = tokens.chunk(2)[dp_rank]
        loss = vocab_parallel_cross_entropy(ddp(mine[:, :-1]), mine[:, 1:], tp_group)
        loss.backward()
        ddp.finish_gradient_synchronization()
        allreduce_sequence_parallel_grads(model)
        opt.step()
    return {"state": _max_diff(full_state_dict(model, tp_group), ref_state),  # bias=False
            "buckets": len(ddp.buckets), "dp_size": dist.get_world_size(dp_group)}


def _recompute_all_reduces():
    """All-reduces of a whole training step (forward + backward): without recompute, with full
    recompute (TinyGPT(checkpoint=True) runs each block's forward again in backward) as Megatron
    does it (the whole block), and with torch.utils.checkpoint's default early stop."""
    from torch.utils.checkpoint import set_checkpoint_early_stop
    tokens = _batches(_cfg("gelu-mha-learned"))[0]
    out = {}
    for run, checkpoint, early_stop in (("none", False, True), ("full", True, False),
                                        ("early stop", True, True)):
        model = tensor_parallel(_model("gelu-mha-learned", checkpoint))
        with set_checkpoint_early_stop(early_stop), CollectiveCounter() as counter:
            _tp_step(model, tokens, None)
        out[run] = counter.counts["all_reduce"]
    return out


def _bad_input(rank):
    """Each mistake's message, raised on every rank before any collective (then a barrier
    proves no rank is stuck in one)."""
    messages = {}

    def message(fn):
        try:
            fn()
        except (ValueError, TypeError) as e:
            return str(e)
        return None

    messages["heads"] = message(lambda: tensor_parallel(TinyGPT(tiny_gpt_config(heads=1, hidden=32))))
    messages["vocab"] = message(lambda: tensor_parallel(TinyGPT(tiny_gpt_config(vocab=63))))
    messages["ffn"] = message(lambda: tensor_parallel(TinyGPT(tiny_gpt_config(ffn=63))))
    messages["seq"] = message(lambda: tensor_parallel(TinyGPT(tiny_gpt_config(seq=15)),
                                                      sequence_parallel=True))
    mine = dist.new_group([0])
    messages["group"] = message(lambda: tensor_parallel(TinyGPT(tiny_gpt_config()), mine))
    messages["group_type"] = message(lambda: tensor_parallel(TinyGPT(tiny_gpt_config()), [0, 1]))
    twice = tensor_parallel(TinyGPT(tiny_gpt_config()))
    messages["twice"] = message(lambda: tensor_parallel(twice))
    messages["other_group"] = message(lambda: full_state_dict(twice, group=mine))
    messages["unconverted"] = message(lambda: full_state_dict(TinyGPT(tiny_gpt_config())))
    messages["dropout"] = message(lambda: tensor_parallel(TinyGPT(tiny_gpt_config(), dropout=0.1, checkpoint=True)))
    messages["row_sp"] = message(lambda: RowParallelLinear(8, 4, sequence_parallel=True))
    messages["col_out"] = message(lambda: ColumnParallelLinear(8, 5))
    messages["sp_seq_at_forward"] = message(
        lambda: tensor_parallel(TinyGPT(tiny_gpt_config()), sequence_parallel=True)(
            torch.zeros(1, 15, dtype=torch.long)))
    messages["ce_shape"] = message(lambda: vocab_parallel_cross_entropy(torch.zeros(2, 3, 8),
                                                                        torch.zeros(2, dtype=torch.long)))
    dist.barrier()
    return messages


@pytest.fixture(scope="module")
def two():
    return launch(_two_ranks, 2, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def four():
    return launch(_four_ranks, 4, timeout=TIMEOUT)



# ---- correctness ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_equals_single_process_for_every_config(world, two, four):
    results = two if world == 2 else four
    for rank, res in enumerate(results):
        for (name, sp), d in res["tp"].items():
            where = f"tp={world} rank {rank} {name} sp={sp}"
            assert d["loss"] < LOSS_TOL, where
            assert d["grads"] < GRAD_TOL, where
            assert d["state"] < STATE_TOL, where
            cfg = _cfg(name)
            assert d["logits_shape"] == (BATCH, cfg.seq, cfg.vocab // world), where


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_keeps_its_share_of_the_parameters(world, two, four):
    """The matrices are split t ways; only norms, row-parallel biases and positions replicate."""
    results = two if world == 2 else four
    for (name, sp), d in results[0]["tp"].items():
        cfg = _cfg(name)
        model = TinyGPT(cfg)
        replicated = sum(p.numel() for n, p in model.named_parameters()
                         if "norm" in n or n.endswith(("proj.bias", "down.bias")) or n.startswith("wpe"))
        total = sum(p.numel() for p in model.parameters())
        assert d["local_params"] == (total - replicated) // world + replicated, name


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_needs_no_extra_call_even_with_gradient_accumulation(world, two, four):
    """A plain loss.backward() per micro-batch and optimizer.step() equal one process (the norms'
    gradients summed over TP by the model); Megatron's explicit call (manual mode) too, and
    calling it on a model that sums them itself changes nothing (test_equals_single_process)."""
    for rank, res in enumerate(two if world == 2 else four):
        for (name, how), d in res["sp_grads"]["runs"].items():
            where = f"tp={world} rank {rank} {name} {how}"
            assert d["loss"] < LOSS_TOL and d["grads"] < GRAD_TOL and d["state"] < STATE_TOL, where


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_gradients_are_summed_once_per_backward(world, two, four):
    """Two micro-batches: two backwards, so each sequence-parallel parameter's gradient is
    all-reduced exactly twice more than in the manual mode (where nothing was summed)."""
    d = (two if world == 2 else four)[0]["sp_grads"]
    extra = list(d["all_reduces"]["backward"])
    for call in d["all_reduces"]["manual"]:
        extra.remove(call)
    assert sorted(extra) == sorted(("all_reduce", n) for n in d["sp_bytes"] * 2)


def test_dp2_x_tp2_equals_single_process_on_the_full_batch(four):
    for res in four:
        for sp, d in res["dp_tp"].items():
            assert d["dp_size"] == 2
            assert d["state"] < STATE_TOL, f"sp={sp}"


def test_full_recompute_equals_single_process_and_repeats_the_forward_all_reduces(two):
    """Checkpointed blocks under TP: same gradients and parameters; backward re-runs each block's
    forward, 2 more all-reduces per layer, as dtlib.analytic.comm counts for recompute="full".
    torch.utils.checkpoint stops recomputing by default once the tensors backward needs exist
    again: the MLP's all-reduce (its output is only added to the residual) is then skipped."""
    cfg = _cfg("gelu-mha-learned")
    predicted = {r: strategy_volumes(cfg, Parallelism(tp=2, recompute=r))["tp_activations"]["calls"]
                 for r in ("none", "full")}
    for res in two:
        for sp, d in res["checkpoint"].items():
            assert d["loss"] < LOSS_TOL and d["grads"] < GRAD_TOL and d["state"] < STATE_TOL, sp
        counts = res["recompute_all_reduces"]
        assert counts["full"] - counts["none"] == predicted["full"] - predicted["none"] == 2 * cfg.layers
        assert counts["early stop"] - counts["none"] == cfg.layers


def test_model_parallel_ranks_put_tp_ranks_side_by_side():
    assert model_parallel_ranks(4, 2) == {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]}
    assert model_parallel_ranks(8, 4) == {"tp": [[0, 1, 2, 3], [4, 5, 6, 7]],
                                          "dp": [[0, 4], [1, 5], [2, 6], [3, 7]]}
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size must be a divisor of the world size "
                                         r"6 \(1, 2, 3, 6\), got 4"):
        model_parallel_ranks(6, 4)


def test_same_loss_and_gradients_as_dtensor_parallelize_module(two):
    for res in two:
        assert len(res["dtensor"]) == 3
        for key, d in res["dtensor"].items():
            assert d["loss"] < LOSS_TOL, key
            assert d["grads"] < GRAD_TOL, key


def test_column_then_row_layers_equal_the_linears_they_were_cut_from(two):
    for res in two:
        assert res["layers"] < GRAD_TOL


# ---- behaviour -----------------------------------------------------------------------------------------
def _expected_bytes(name):
    cfg = _cfg(name)
    volume = strategy_volumes(cfg, Parallelism(tp=2, micro_batch_size=BATCH), precision=get_precision("fp32"))
    assert volume["tp_activations"]["bytes"] == BATCH * cfg.seq * cfg.hidden * 4
    return volume["tp_activations"]["bytes"]


@pytest.mark.parametrize("world", [2, 4])
def test_without_sp_two_all_reduces_forward_and_two_backward_per_block(world, two, four):
    results = two if world == 2 else four
    for name in CONFIGS:
        b = results[0]["behaviour"][name, False]
        size = _expected_bytes(name)
        assert b["forward"] == [("all_reduce", size)] * 2, name
        assert b["backward"] == [("all_reduce", size)] * 2, name
        assert b["comm_debug_counts"] == {"allreduce_": 4}  # PyTorch's own count agrees
        # dtlib.analytic.comm's TP count: 4 all-reduces per layer per micro-batch
        assert strategy_volumes(_cfg(name), Parallelism(tp=world))["tp_activations"]["calls"] \
            == 4 * _cfg(name).layers


@pytest.mark.parametrize("world", [2, 4])
def test_with_sp_gathers_and_reduce_scatters_and_no_all_reduce(world, two, four):
    """Forward: all-gather before QKV and the MLP, reduce-scatter after the projection and
    down. Backward: the conjugates, plus the re-gather of each column-parallel layer's saved
    input shard (Korthikanti Sec. 4.2.2)."""
    results = two if world == 2 else four
    for name in CONFIGS:
        b = results[0]["behaviour"][name, True]
        size = _expected_bytes(name)
        ag, rs = ("all_gather", size), ("reduce_scatter", size)
        assert b["forward"] == [ag, rs, ag, rs], name
        assert sorted(b["backward"]) == sorted([ag, ag, rs, ag, ag, rs]), name
        assert b["comm_debug_counts"] == {"_allgather_base_": 6, "_reduce_scatter_base_": 4}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_activation_memory_per_rank_equals_table_2(world, sp, two, four):
    results = two if world == 2 else four
    for rank, res in enumerate(results):
        for name in CONFIGS:
            saved = res["behaviour"][name, sp]["saved_bytes"]
            assert saved == predicted_layer_bytes(_cfg(name), BATCH, world, sp), (name, rank)
    # SP saves what TP alone replicates: 10 sbh of the 34 (Korthikanti Sec. 4.2.2)
    assert results[0]["behaviour"]["gelu-mha-learned", True]["saved_bytes"] \
        < results[0]["behaviour"]["gelu-mha-learned", False]["saved_bytes"]


# ---- bad input -------------------------------------------------------------------------------------------
EXPECTED_MESSAGES = {
    "heads": r"heads \(1\) must be divisible by the tensor-parallel degree 2; valid degrees for "
             r"heads: \[1\]; valid degrees for this model: \[1\]",
    "vocab": r"vocab \(63\) must be divisible by the tensor-parallel degree 2; "
             r"valid degrees for vocab: \[1, 3, 7, 9, 21, 63\]; valid degrees for this model: \[1\]",
    "ffn": r"ffn \(63\) must be divisible",
    "seq": r"seq \(15\) must be divisible by the tensor-parallel degree 2",
    "group": r"rank 1 is not a member of the tensor-parallel group",
    "group_type": r"group must be a torch.distributed.ProcessGroup .* got list",
    "twice": r"already tensor-parallel",
    "other_group": r"full_state_dict: group is not the group the model was converted with",
    "unconverted": r"full_state_dict needs a model converted by tensor_parallel",
    "dropout": r"dropout=0.1 with checkpoint=True: recomputation would replay",
    "row_sp": r"sequence_parallel=True needs input_is_parallel=True",
    "col_out": r"out_features \(5\) must be divisible by the tensor-parallel degree 2; "
               r"valid degrees for out_features: \[1, 5\]$",
    "sp_seq_at_forward": r"sequence length \(15\) to be divisible by the tensor-parallel degree 2",
    "ce_shape": r"targets \(2,\) must be local_logits' shape",
}


def test_bad_input_is_refused_with_a_clear_message_before_any_collective(two):
    import re
    rank1 = two[1]["errors"]
    for key, pattern in EXPECTED_MESSAGES.items():
        assert rank1[key] is not None and re.search(pattern, rank1[key]), (key, rank1[key])
    # rank 0 is in its own one-rank group: that is valid there
    assert two[0]["errors"]["group"] is None


# ---- what lesson 05 runs ---------------------------------------------------------------------------------
def test_measure_tensor_parallel_reports_what_the_lesson_shows():
    from dtlib.experiments.tensor import measure_tensor_parallel
    cfg = _cfg("gelu-mha-learned")
    r = measure_tensor_parallel(cfg, world_size=2, sequence_parallel=True, micro_batch_size=BATCH)
    assert abs(r["loss"] - r["single_process_loss"]) < LOSS_TOL
    assert r["max_grad_diff"] < GRAD_TOL
    assert r["saved_bytes"] == r["predicted_bytes"] == predicted_layer_bytes(cfg, BATCH, 2, True)
    assert [name for name, _ in r["forward"]] == ["all_gather", "reduce_scatter"] * 2
    assert r["parameters"] == sum(p.numel() for p in TinyGPT(cfg).parameters())
    assert r["local_parameters"] < r["parameters"] / 2 + 2000  # matrices halved, norms replicated


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=3), r"heads \(4\) must be divisible by the tensor-parallel degree 3"),
    (dict(world_size=1), r"world_size must be an integer in 2..8"),
    (dict(micro_batch_size=0), r"micro_batch_size must be a positive integer"),
    (dict(cfg="gpt"), r"cfg must be a TransformerConfig"),
])
def test_measure_tensor_parallel_refuses_bad_input_before_launching(kwargs, match):
    from dtlib.experiments.tensor import measure_tensor_parallel
    args = {"cfg": _cfg("gelu-mha-learned"), **kwargs}
    with pytest.raises(ValueError, match=match):
        measure_tensor_parallel(**args)
