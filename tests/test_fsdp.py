"""Toy FSDP (ZeRO-3): exact single-process results, dim-0 sharded parameters and gradients (FSDP2),
small parameters replicated below a threshold, memory vs fully_shard."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dtlib.experiments.zero import compare_fully_shard
from dtlib.launcher import launch
from dtlib.measure import CollectiveCounter
from dtlib.analytic.memory import model_numbers, model_state_bytes, stage_parameters
from dtlib.models import MnistCNN, TinyGPT, tiny_gpt_config
from dtlib.models.gpt import Block
from dtlib.parallel import FSDP
from dtlib.analytic.precision import get_precision
from workloads import loss_fn, make_batches

TIMEOUT = 60
GPT = dict(layers=3, hidden=32, heads=2, vocab=64, seq=16, tied_embeddings=True)


def _model(kind, frozen=False):
    torch.manual_seed(0)
    model = MnistCNN() if kind == "cnn" else TinyGPT(tiny_gpt_config(**GPT))
    if frozen:  # a frozen layer inside a unit (GPT: block 1's qkv) or in the root (CNN: conv 1)
        layer = model.features[0] if kind == "cnn" else model.blocks[1].attn.qkv
        layer.requires_grad_(False)
    return model


def _data(kind, steps, batch=8):
    return make_batches(kind, steps, batch, seed=5)


def _vs_single_process(rank, world_size, kind, steps=3, frozen=False):
    torch.use_deterministic_algorithms(True)
    data = _data(kind, steps)
    model = _model(kind, frozen)
    fsdp = FSDP(model, unit_types=(Block,) if kind == "gpt" else ())
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    # references: the same micro-batches accumulated in one process (the same arithmetic, so
    # equal bit for bit), and the full batch in one go (equal up to rounding)
    micro, full = _model(kind, frozen), _model(kind, frozen)
    micro_opt, full_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (micro, full))
    grad_shapes_ok = True
    for x, y in data:
        opt.zero_grad()
        xs, ys = torch.tensor_split(x, world_size)[rank], torch.tensor_split(y, world_size)[rank]
        loss_fn(fsdp, xs, ys).backward()
        fsdp.finish_gradient_synchronization()
        grad_shapes_ok &= all(p.grad.shape == p.shape for p in fsdp.parameters() if p.requires_grad)
        opt.step()
        micro_opt.zero_grad()
        for mx, my in zip(torch.tensor_split(x, world_size), torch.tensor_split(y, world_size)):
            (loss_fn(micro, mx, my) / world_size).backward()
        micro_opt.step()
        full_opt.zero_grad()
        loss_fn(full, x, y).backward()
        full_opt.step()
    state = fsdp.gather_full_params()
    ref = micro.state_dict()
    frozen_names = [n for n, p in micro.named_parameters() if not p.requires_grad]
    return {"keys": list(state) == list(ref),
            "frozen_unchanged": all(torch.equal(state[n], _model(kind).state_dict()[n])
                                    for n in frozen_names),
            "n_frozen": len(frozen_names),
            "exact": all(torch.equal(state[k], ref[k]) for k in ref),
            "full_batch": max((state[k] - v).abs().max().item() for k, v in full.state_dict().items()
                              if v.is_floating_point()),
            "grad_shapes": grad_shapes_ok,
            "shards_1d": all(p.dim() == 1 for p in fsdp.flat_shards),
            # the model's own parameters, by name, each its dim-0 rows (same ndim), a view of a flat shard
            "names": [n for n, _ in fsdp.named_parameters()] == [f"module.{n}" for n, _ in micro.named_parameters()],
            "trainable_are_views": all(p.dim() == q.dim() and p.shape[1:] == q.shape[1:] and any(
                p.untyped_storage().data_ptr() == f.untyped_storage().data_ptr() for f in fsdp.flat_shards)
                for p, q in zip(fsdp.parameters(), micro.parameters()) if p.requires_grad),
            "piece_numel": sum(p.numel() for p in fsdp.parameters() if p.requires_grad),
            "shard_numel": sum(p.numel() for p in fsdp.flat_shards)}


@pytest.mark.parametrize("kind", ["gpt", "cnn"])
def test_fp32_equals_single_process_exactly(kind):
    # with a frozen layer: it stays an ordinary replicated parameter, is not sharded, is not
    # updated, and gather_full_params() returns it under its original name
    model = _model(kind, frozen=True)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_frozen = sum(not p.requires_grad for p in model.parameters())
    results = launch(_vs_single_process, 2, args=(kind, 3, True), timeout=TIMEOUT)
    for out in results:
        assert out["keys"] and out["exact"] and out["grad_shapes"] and out["shards_1d"], out
        assert out["names"] and out["trainable_are_views"] and out["full_batch"] < 1e-5, out
        assert out["n_frozen"] == n_frozen > 0 and out["frozen_unchanged"], out
        assert n_params / 2 <= out["shard_numel"] <= n_params / 2 + 2 * 4  # 1/N (+ padding)
    assert sum(out["piece_numel"] for out in results) == n_params  # every element on one rank


def test_four_ranks_equal_single_process():
    for out in launch(_vs_single_process, 4, args=("gpt", 2), timeout=TIMEOUT):
        assert out["keys"] and out["grad_shapes"] and out["full_batch"] < 1e-5, out


def _padded(params, n):
    """Elements of ``params`` sharded on dim 0 over n ranks, each padded to n x ceil(rows / n) rows."""
    return sum(n * -(-p.shape[0] // n) * p[0].numel() for p in params)


def test_peak_parameter_memory_vs_prediction_and_fully_shard():
    world_size = 2
    ref = _model("gpt")
    block = sum(p.numel() for p in ref.blocks[0].parameters())
    total = sum(p.numel() for p in ref.parameters())
    root = total - GPT["layers"] * block
    root_params = [p for n, p in ref.named_parameters() if not n.startswith("blocks.")]
    padded_root, padded_block = _padded(root_params, world_size), _padded(ref.blocks[0].parameters(), world_size)
    # the toy and PyTorch's fully_shard on the same model, data and ranks, in the same run
    out = compare_fully_shard(world_size=world_size, cfg=tiny_gpt_config(**GPT), steps=3, batch=8)
    ours = out["ours"]
    # persistent: 1/N of every parameter's rows (each padded to a multiple of N rows), fp32
    padded_total = padded_root + GPT["layers"] * padded_block
    assert ours["sharded_param_bytes"] == 4 * padded_total // world_size
    # gathered at most: the root unit (it encloses the blocks) and one block, never two
    assert ours["peak_unsharded_bytes"] == 4 * (padded_root + padded_block)
    # dtlib.analytic.memory: P/N parameters + one unit gathered at a time; the toy also holds the root
    cfg = tiny_gpt_config(**GPT)
    n = stage_parameters(**model_numbers(cfg))["first"]
    predicted = model_state_bytes(n["dense"], 0, n["unit"], get_precision("fp32"), zero=3,
                                  shard_size=world_size)
    assert n["dense"] == total
    assert abs(ours["sharded_param_bytes"] - predicted["parameters"]) <= 4 * 4
    unit_bytes = predicted["temporary"] / 2  # dtlib.analytic.memory counts params + grads of a unit
    assert ours["peak_param_bytes"] <= predicted["parameters"] + unit_bytes + 4 * root + 16
    # PyTorch's fully_shard on the same model, same data, same run
    assert out["max_param_diff"] < 1e-5
    # fully_shard pads each parameter, we pad each unit: the same bytes up to padding
    torch_mem = out["torch"]
    close = lambda a, b: abs(a - b) <= 0.05 * a  # noqa: E731
    assert close(torch_mem["SHARDED_PARAM"], ours["sharded_param_bytes"])
    # at its peak fully_shard also holds the root and one block unsharded ...
    assert close(torch_mem["UNSHARDED_PARAM"], ours["peak_unsharded_bytes"])
    # ... plus one block's all-gather output buffer (FSDP2 gathers into a separate buffer,
    # copies out, and prefetches the next block; the toy gathers into the viewed buffer)
    assert 0 < torch_mem["ALL_GATHER"] <= 4 * padded_block
    assert ours["peak_param_bytes"] < 4 * total  # less than one unsharded replica


def _gathers_per_phase(rank, world_size):
    fsdp = FSDP(_model("gpt"), unit_types=(Block,))
    x, y = _data("gpt", 1)[0]
    with CollectiveCounter() as forward:
        loss = loss_fn(fsdp, x, y)
    live_after_forward = fsdp._live_bytes
    with CollectiveCounter() as backward:
        loss.backward()  # FSDP finishes its gradient synchronisation at the end of backward
    return {"forward": forward.counts, "backward": backward.counts, "units": len(fsdp.units),
            "live_after_forward": live_after_forward, "live_after_backward": fsdp._live_bytes}


def test_every_unit_is_gathered_in_forward_and_again_in_backward_and_freed():
    for out in launch(_gathers_per_phase, 2, timeout=TIMEOUT):
        units = out["units"]
        assert units == GPT["layers"] + 1
        assert out["forward"] == {"all_gather": units}
        # backward gathers every unit again and reduce-scatters its gradients
        assert out["backward"]["all_gather"] == units and out["backward"]["reduce_scatter"] >= units
        assert out["live_after_forward"] == 0 and out["live_after_backward"] == 0


def _bf16(rank, world_size):
    out = {}
    for dtype in (None, torch.bfloat16):
        model = _model("gpt")
        fsdp = FSDP(model, compute_dtype=dtype, unit_types=(Block,))
        opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
        losses = []
        for x, y in _data("gpt", 3):
            opt.zero_grad()
            xs, ys = torch.tensor_split(x, world_size)[rank], torch.tensor_split(y, world_size)[rank]
            loss = loss_fn(fsdp, xs, ys)
            loss.backward()
            fsdp.finish_gradient_synchronization()
            opt.step()
            losses.append(loss.item())
        out[str(dtype)] = (losses, fsdp.memory_stats(), {p.dtype for p in fsdp.parameters()},
                           {p.grad.dtype for p in fsdp.parameters()})
    return out


def test_bf16_compute_halves_gathered_bytes_and_keeps_fp32_shards():
    out = launch(_bf16, 2, timeout=TIMEOUT)[0]
    fp32_losses, fp32_mem, _, _ = out["None"]
    bf16_losses, bf16_mem, dtypes, grad_dtypes = out["torch.bfloat16"]
    assert dtypes == grad_dtypes == {torch.float32}  # master shards and their grads stay fp32
    assert bf16_mem["peak_unsharded_bytes"] * 2 == fp32_mem["peak_unsharded_bytes"]
    assert bf16_mem["sharded_param_bytes"] == fp32_mem["sharded_param_bytes"]
    assert max(abs(a - b) for a, b in zip(fp32_losses, bf16_losses)) < 0.05


def _bf16_vs_reference(rank, world_size):
    torch.use_deterministic_algorithms(True)
    model = _model("gpt")
    master = copy.deepcopy(model)  # the reference keeps fp32 master weights, as FSDP's shards
    fsdp = FSDP(model, compute_dtype=torch.bfloat16, unit_types=(Block,))
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    for x, y in _data("gpt", 3):
        opt.zero_grad()
        xs, ys = torch.tensor_split(x, world_size)[rank], torch.tensor_split(y, world_size)[rank]
        loss_fn(fsdp, xs, ys).backward()
        fsdp.finish_gradient_synchronization()
        opt.step()
        # one process: each rank's micro-batch through a bf16 copy of the master, gradients / N
        # summed in bf16 (what the reduce-scatter does), then an fp32 AdamW step on the master
        total = None
        for mx, my in zip(torch.tensor_split(x, world_size), torch.tensor_split(y, world_size)):
            low = copy.deepcopy(master).to(torch.bfloat16)
            loss_fn(low, mx, my).backward()
            grads = [p.grad / world_size for p in low.parameters()]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        for p, g in zip(master.parameters(), total):
            p.grad = g.float()
        ref_opt.step()
        ref_opt.zero_grad()
    ours, ref = fsdp.gather_full_params(), master.state_dict()
    return max((ours[k] - ref[k]).abs().max().item() for k in ref)


def test_bf16_compute_equals_a_single_process_bf16_reference():
    # Two ranks add two bf16 gradients, which is exact in any order, so the match is bit for bit
    # (with 3 ranks the ring's order of bf16 additions differs from the reference's).
    assert launch(_bf16_vs_reference, 2, timeout=TIMEOUT) == [0.0, 0.0]


# ---- training loops as PyTorch users write them -------------------------------------------------
def _configure_optimizers(model, weight_decay=0.1):
    """nanoGPT's ``configure_optimizers`` groups: decay for matrices, none for norms and biases
    (built on the model before wrapping, as nanoGPT builds its optimizer before DDP)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _plain_loops(rank, world_size):
    """``backward(); step()`` with no finish call; activation checkpointing inside and across units;
    nanoGPT's param groups; all against one process on the same micro-batches."""
    torch.use_deterministic_algorithms(True)
    data = _data("gpt", 5)
    ref = _model("gpt")
    ref_opt = torch.optim.AdamW(_configure_optimizers(ref), lr=1e-2)
    for x, y in data:
        ref_opt.zero_grad()
        for mx, my in zip(torch.tensor_split(x, world_size), torch.tensor_split(y, world_size)):
            (loss_fn(ref, mx, my) / world_size).backward()
        ref_opt.step()
    reference = ref.state_dict()
    out = {}
    for name, checkpoint, units in [("plain", False, (Block,)), ("checkpoint, root only", True, ()),
                                    ("checkpoint, block units", True, (Block,))]:
        torch.manual_seed(0)
        model = TinyGPT(tiny_gpt_config(**GPT), checkpoint=checkpoint)
        groups = _configure_optimizers(model)
        fsdp = FSDP(model, unit_types=units)
        opt = torch.optim.AdamW(groups, lr=1e-2)
        start = fsdp.gather_full_params()
        pending = []
        for x, y in data:
            model.zero_grad()  # the model's zero_grad works as well as the optimizer's
            xs, ys = torch.tensor_split(x, world_size)[rank], torch.tensor_split(y, world_size)[rank]
            loss_fn(fsdp, xs, ys).backward()  # no finish_gradient_synchronization()
            pending.append(sum(len(u.pending) for u in fsdp.units))
            opt.step()
        fsdp.finish_gradient_synchronization()  # still allowed: nothing left to do
        state = fsdp.gather_full_params()
        out[name] = {"moved": min((state[k] - start[k]).abs().max().item() for k in reference),
                     "vs_reference": max((state[k] - reference[k]).abs().max().item() for k in reference),
                     "pending": pending, "live": fsdp._live_bytes}
    return out


def test_plain_training_loops_checkpointing_and_param_groups_equal_one_process():
    # fp32, deterministic algorithms, the same micro-batch arithmetic: equal bit for bit
    for out in launch(_plain_loops, 2, timeout=TIMEOUT):
        for name, r in out.items():
            assert r["moved"] > 0, (name, r)  # every parameter trained, without a finish call
            assert r["vs_reference"] == 0.0, (name, r)
            assert r["pending"] == [0] * 5 and r["live"] == 0, (name, r)  # nothing piles up


def _checkpoint_round_trip(rank, world_size):
    """save (full model state + per-rank optimizer state) -> fresh model -> identical next step;
    and keyword inputs are cast to compute_dtype like positional ones."""
    data = _data("gpt", 3)
    shards = [(torch.tensor_split(x, world_size)[rank], torch.tensor_split(y, world_size)[rank])
              for x, y in data]
    built = []
    for _ in range(2):
        model = _model("gpt")
        groups = _configure_optimizers(model)
        fsdp = FSDP(model, unit_types=(Block,))
        built.append((fsdp, torch.optim.AdamW(groups, lr=1e-2)))
    (fsdp, opt), (fresh, fresh_opt) = built
    for x, y in shards[:2]:
        opt.zero_grad()
        loss_fn(fsdp, x, y).backward()
        opt.step()
    saved = {"model": fsdp.gather_full_params(), "optim": copy.deepcopy(opt.state_dict())}
    fresh.load_full_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["optim"])
    loaded_equal = all(torch.equal(a, b) for a, b in zip(fresh.gather_full_params().values(),
                                                         saved["model"].values()))
    for f, o in ((fsdp, opt), (fresh, fresh_opt)):
        o.zero_grad()
        loss_fn(f, *shards[2]).backward()
        o.step()
    after, fresh_after = fsdp.gather_full_params(), fresh.gather_full_params()
    out = {"loaded_equal": loaded_equal,
           "next_step_equal": all(torch.equal(after[k], fresh_after[k]) for k in after),
           "stepped": any(not torch.equal(after[k], saved["model"][k]) for k in after)}
    try:
        fresh.load_full_state_dict({k: v for k, v in saved["model"].items() if k != "norm_f.weight"})
    except KeyError as e:
        out["missing"] = str(e)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 3)

        def forward(self, *, x):
            return self.lin(x)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = Head()

        def forward(self, x):
            return self.head(x=x)  # a unit called with a keyword argument

    low = FSDP(Outer(), compute_dtype=torch.bfloat16, unit_types=(Head,))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    y = low(x)  # fp32 input passed on by keyword: cast to bf16 by the unit's pre-hook
    ref = Head().to(torch.bfloat16)(x=x.to(torch.bfloat16))
    out["kwargs_cast"] = y.dtype == torch.bfloat16 and torch.equal(y, ref)
    return out


def test_full_state_dict_round_trip_and_keyword_inputs():
    for out in launch(_checkpoint_round_trip, 2, timeout=TIMEOUT):
        assert out["loaded_equal"] and out["stepped"] and out["next_step_equal"], out
        assert "missing ['norm_f.weight']" in out["missing"], out
        assert out["kwargs_cast"], out


def _misuse(rank, world_size):
    errors = {}
    for name, call in {"int dtype": lambda: FSDP(nn.Linear(2, 2), compute_dtype=torch.int32),
                       "unit types": lambda: FSDP(nn.Linear(2, 2), unit_types=("Block",)),
                       "module": lambda: FSDP("model"),
                       "mixed": lambda: FSDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())),
                       "frozen fp32 with bf16": lambda: FSDP(
                           nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).requires_grad_(False)),
                           compute_dtype=torch.bfloat16)
                       }.items():
        try:
            call()
        except (ValueError, TypeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    # the module FSDP took over, called directly (as FSDP2's fully_shard allows): a clear error,
    # not autograd's "setStorage ... storage of size 0" in backward
    model = _model("gpt")
    fsdp = FSDP(model, unit_types=(Block,))
    x = torch.randint(0, GPT["vocab"], (2, GPT["seq"]))
    for name, call in {"original module": lambda: model(x).sum().backward(),
                       "a unit's module": lambda: model.blocks[0](torch.zeros(2, GPT["seq"], GPT["hidden"]))}.items():
        try:
            call()
        except RuntimeError as e:
            errors[name] = str(e)
    fsdp(x).sum().backward()  # the wrapper still works after the refusals
    errors["wrapper trains"] = all(p.grad is not None for p in fsdp.parameters())
    dist.barrier()
    return errors


def test_bad_input_gives_clear_errors():
    errors = launch(_misuse, 2, timeout=TIMEOUT)[0]
    assert errors["int dtype"].startswith("ValueError") and "floating" in errors["int dtype"]
    assert errors["unit types"].startswith("TypeError")
    assert errors["module"].startswith("TypeError")
    assert "mixes parameter dtypes" in errors["mixed"]
    assert "frozen parameters ['1.weight', '1.bias']" in errors["frozen fp32 with bf16"]
    assert errors["original module"].startswith("TinyGPT was called directly after FSDP(model) sharded its "
                                                "parameters: call the wrapper, fsdp = FSDP(model); fsdp(x)")
    assert errors["a unit's module"].startswith("Block was called directly after FSDP(model)")
    assert errors["wrapper trains"]


# ---- FSDP2's dim-0 sharding: parameters keep their dimensions (issue 19) --------------------------
def _nanogpt_groups(named, weight_decay=0.1):
    """nanoGPT's ``configure_optimizers``, verbatim in spirit: decay every parameter with >= 2
    dimensions (matrices, embeddings), none for the others (norms, biases)."""
    params = {n: p for n, p in named if p.requires_grad}
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    return ([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            sorted(n for n, p in params.items() if p.dim() >= 2))


def _train_side_by_side(rank, world_size, fsdp, opt, ref, ref_opt, steps=3):
    """``steps`` AdamW steps: FSDP on this rank's slice, and the reference accumulating every
    rank's slice in one process (the same arithmetic)."""
    for x, y in _data("gpt", steps):
        opt.zero_grad()
        xs, ys = torch.tensor_split(x, world_size)[rank], torch.tensor_split(y, world_size)[rank]
        loss_fn(fsdp, xs, ys).backward()
        opt.step()
        ref_opt.zero_grad()
        for mx, my in zip(torch.tensor_split(x, world_size), torch.tensor_split(y, world_size)):
            (loss_fn(ref, mx, my) / world_size).backward()
        ref_opt.step()


def _dims_and_groups(rank, world_size):
    torch.use_deterministic_algorithms(True)
    ref = _model("gpt")
    original = {n: p.shape for n, p in ref.named_parameters()}
    ref_groups, ref_decayed = _nanogpt_groups(ref.named_parameters())
    fsdp = FSDP(_model("gpt"), unit_types=(Block,))
    named = [(n.removeprefix("module."), p) for n, p in fsdp.named_parameters()]
    groups, decayed = _nanogpt_groups(named)  # built *after* wrapping
    rows = {}
    for n, p in named:
        c = -(-original[n][0] // world_size)  # torch.chunk: ceil(rows / N) rows, the last ranks fewer
        rows[n] = (tuple(p.shape), (max(0, min(c, original[n][0] - rank * c)), *original[n][1:]))
    opt, ref_opt = torch.optim.AdamW(groups, lr=1e-2), torch.optim.AdamW(ref_groups, lr=1e-2)
    _train_side_by_side(rank, world_size, fsdp, opt, ref, ref_opt)
    state, expect = fsdp.gather_full_params(), ref.state_dict()
    return {"decayed": decayed, "ref_decayed": ref_decayed, "rows": rows,
            "ndim": all(p.dim() == len(original[n]) for n, p in named),
            "grad_shapes": all(p.grad.shape == p.shape for _, p in named),
            "max_diff": max((state[k] - expect[k]).abs().max().item() for k in expect)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_parameters_keep_their_dims_and_nanogpt_groups_decay_exactly_the_matrices(world_size):
    # on 3 ranks the rows do not divide: 64 vocabulary rows are 22, 22, 20 (torch.chunk)
    for out in launch(_dims_and_groups, world_size, timeout=TIMEOUT):
        assert out["ndim"] and out["grad_shapes"], out
        assert out["decayed"] == out["ref_decayed"] and "wte.weight" in out["decayed"], out
        assert not any(n.startswith("norm") or n.endswith(".bias") for n in out["decayed"])
        for name, (got, expect) in out["rows"].items():
            assert got == expect, (name, got, expect)
        # weight decay on exactly the matrices, after wrapping: one process's training
        # (3 ranks: the reduce-scatter adds 3 gradients in another order; AdamW amplifies that)
        assert out["max_diff"] == 0.0 if world_size == 2 else out["max_diff"] < 1e-4, out


def _collective_per_parameter(rank, world_size):
    """What the CS336 FSDP tests do: one collective per parameter gradient, in name order."""
    fsdp = FSDP(_model("gpt"), unit_types=(Block,))
    x, y = _data("gpt", 1)[0]
    loss_fn(fsdp, torch.tensor_split(x, world_size)[rank], torch.tensor_split(y, world_size)[rank]).backward()
    sums = []
    for _, p in fsdp.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)  # the same shape on every rank (rows divide here), so it completes
        sums.append(torch.tensor([float(p.grad.double().sum()), float(p.dim())], dtype=torch.float64))
    checksum = torch.stack(sums)
    dist.all_reduce(checksum)
    return checksum


def test_a_collective_per_parameter_gradient_completes():
    # a flat 1-D layout gave ranks different shapes (and empty pieces): this hung
    ref = _model("gpt")
    x, y = _data("gpt", 1)[0]
    for mx, my in zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2)):
        (loss_fn(ref, mx, my) / 2).backward()
    expect = torch.tensor([[float(p.grad.double().sum()), 2.0 * p.dim()] for p in ref.parameters()],
                          dtype=torch.float64)
    for checksum in launch(_collective_per_parameter, 2, timeout=30):
        assert torch.allclose(checksum, expect, rtol=1e-5, atol=1e-6), (checksum, expect)


def _persistence(rank, world_size, threshold, dtype):
    torch.use_deterministic_algorithms(True)
    ref = _model("gpt")
    fsdp = FSDP(_model("gpt"), unit_types=(Block,), persistence_threshold=threshold, compute_dtype=dtype)
    named = [(n.removeprefix("module."), p) for n, p in fsdp.named_parameters()]
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train_side_by_side(rank, world_size, fsdp, opt, ref, ref_opt)
    state, expect = fsdp.gather_full_params(), ref.state_dict()
    values = [None] * world_size
    dist.all_gather_object(values, {n: p.detach().clone() for n, p in named})
    replicated = [n for n, p in named if any(p is q for q in fsdp.replicated)]
    return {"shapes": {n: tuple(p.shape) for n, p in named},
            "replicas_equal": all(torch.equal(values[0][n], v[n]) for v in values for n in replicated),
            "memory": fsdp.memory_stats(),
            "max_diff": max((state[k] - expect[k]).abs().max().item() for k in expect)}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_persistence_threshold_keeps_small_parameters_replicated(dtype):
    threshold = 100  # GPT's norms and biases (32 or 96 elements) stay whole; matrices are sharded
    ref = dict(_model("gpt").named_parameters())
    small = {n for n, p in ref.items() if p.numel() < threshold}
    assert small and len(small) < len(ref)
    outs = launch(_persistence, 2, args=(threshold, dtype), timeout=TIMEOUT)
    for out in outs:
        for n, p in ref.items():
            expect = tuple(p.shape) if n in small else (p.shape[0] // 2, *p.shape[1:])
            assert out["shapes"][n] == expect, (n, out["shapes"][n])
        assert out["replicas_equal"]  # replicated parameters trained identically on every rank
        mem = out["memory"]
        assert mem["replicated_param_bytes"] == 4 * sum(ref[n].numel() for n in small)
        big = sum(p.numel() for n, p in ref.items() if n not in small and n != "lm_head.weight")  # tied
        assert mem["sharded_param_bytes"] == 4 * big // 2  # 1/N of the sharded parameters
        if dtype is None:  # the averaged replicated gradients are exactly one process's
            assert out["max_diff"] == 0.0, out
        else:
            assert out["max_diff"] < 5e-2, out
    with pytest.raises(ValueError, match="persistence_threshold must be an integer >= 0, got -1"):
        FSDP(nn.Linear(2, 2), persistence_threshold=-1)  # checked before anything distributed


def test_gradient_hooks_on_parameters_are_refused():
    # FSDP's forward uses views of its gathered buffers: a hook on the parameter would never fire
    # (tensor_parallel's default SP-gradient sum was silently skipped that way)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].weight.register_hook(lambda g: g)
    with pytest.raises(ValueError, match=r"parameters \['1.weight'\] have gradient hooks"):
        FSDP(model)  # checked before anything distributed
