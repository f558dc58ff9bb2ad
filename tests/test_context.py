"""Ring attention (context parallelism) equals single-process causal attention, forward and
backward, on 2 and 4 ranks; zig-zag balances the causal work; ring traffic counted."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.analytic.activations import layer_bytes
from dtlib.launcher import launch
from dtlib.measure import CollectiveCounter, saved_activation_bytes
from dtlib.models.gpt import TinyGPT, tiny_gpt_config
from dtlib.parallel.context import (causal_work, context_parallel, ring_attention, shard_positions,
                                    shard_sequence, unshard_sequence)

TIMEOUT = 60
# float32 with a different summation order (online softmax over blocks): ~1e-7 relative; 1e-5
# leaves room without hiding a wrong mask or a missing block (those are off by > 1e-2)
ATOL = 1e-5


def _reference(q, k, v):
    """softmax(q k^T / sqrt(d) + causal mask) v, written out."""
    s = q.shape[2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return F.softmax(scores, -1) @ v


def test_shards_and_positions():
    assert shard_positions(0, 2, 8).tolist() == [0, 1, 6, 7]
    assert shard_positions(1, 2, 8).tolist() == [2, 3, 4, 5]
    assert shard_positions(1, 2, 8, zigzag=False).tolist() == [4, 5, 6, 7]
    x = torch.arange(24).view(1, 24)
    shards = [shard_sequence(x, r, 3) for r in range(3)]
    assert torch.equal(unshard_sequence(shards), x)
    with pytest.raises(ValueError, match="seq=10 must be a multiple of 4"):
        shard_positions(0, 2, 10)


def test_zigzag_balances_causal_work():
    # query at position p sees p+1 keys; seq 16 on 4 ranks
    assert causal_work(4, 16) == [34, 34, 34, 34]
    contiguous = causal_work(4, 16, zigzag=False)
    assert contiguous == [1 + 2 + 3 + 4, 5 + 6 + 7 + 8, 9 + 10 + 11 + 12, 13 + 14 + 15 + 16]
    assert sum(contiguous) == sum(causal_work(4, 16)) == 16 * 17 // 2


def _ring_vs_reference(rank, world_size):
    torch.manual_seed(0)
    b, h, s, d = 2, 3, 16, 8
    q, k, v, dout = (torch.randn(b, h, s, d) for _ in range(4))
    results = {}
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*full)
    ref.backward(dout)
    # cp = 4 on every rank, then cp = 2 on {0, 1} and {2, 3}
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for cp, group in ((4, None), (2, pairs[rank // 2])):
        r = rank % cp
        for zigzag in (True, False):
            local = [shard_sequence(t, r, cp, dim=2, zigzag=zigzag).requires_grad_() for t in (q, k, v)]
            with CollectiveCounter() as counter:
                out = ring_attention(*local, group=group, zigzag=zigzag)
            forward_sends = (counter.counts["send"], counter.bytes("send"))
            out.backward(shard_sequence(dout, r, cp, dim=2, zigzag=zigzag))
            expect = [shard_sequence(t, r, cp, dim=2, zigzag=zigzag) for t in (ref, *[f.grad for f in full])]
            errors = [(a - e).abs().max().item() for a, e in zip([out, *[t.grad for t in local]], expect)]
            results[(cp, zigzag)] = {"errors": errors, "sends": forward_sends}
    return results


def test_ring_attention_equals_single_process():
    for rank, results in enumerate(launch(_ring_vs_reference, 4, timeout=TIMEOUT)):
        for (cp, zigzag), res in results.items():
            assert max(res["errors"]) < ATOL, (rank, cp, zigzag, res["errors"])
            # forward: cp - 1 hops, each sending this rank's K and V: 2 x b x h x (s / cp) x d floats,
            # the all-gather volume dtlib.analytic.comm predicts for CP ((cp-1)/cp of the full K, V)
            count, nbytes = res["sends"]
            assert count == cp - 1
            assert nbytes == (cp - 1) * 2 * 2 * 3 * (16 // cp) * 8 * 4


def _gpt_cp(rank, world_size, position):
    torch.manual_seed(0)
    cfg = tiny_gpt_config(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, seq=16, position=position)
    model = TinyGPT(cfg)
    idx = torch.randint(0, 64, (2, 16))
    targets = torch.randint(0, 64, (2, 16))
    ref = TinyGPT(cfg)
    ref.load_state_dict(model.state_dict())
    ref_loss = F.cross_entropy(ref(idx).flatten(0, 1), targets.flatten())
    ref_loss.backward()
    context_parallel(model, dist.group.WORLD)
    local_idx, local_t = shard_sequence(idx, rank, world_size), shard_sequence(targets, rank, world_size)
    # each rank's tokens summed, over all tokens: the sum over ranks is the full mean
    loss = F.cross_entropy(model(local_idx).flatten(0, 1), local_t.flatten(), reduction="sum") / targets.numel()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        grads[name] = (p.grad - dict(ref.named_parameters())[name].grad).abs().max().item()
    return abs(total.item() - ref_loss.item()), grads


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_context_parallel_tinygpt(position):
    for loss_error, grads in launch(_gpt_cp, 2, args=(position,), timeout=TIMEOUT):
        assert loss_error < 1e-5
        assert set(grads) == {n for n, _ in TinyGPT(tiny_gpt_config(
            layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, seq=16, position=position)).named_parameters()}
        assert max(grads.values()) < 1e-6, grads


def test_bad_input():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="expand grouped KV heads"):
        ring_attention(q, torch.zeros(1, 1, 4, 8), q, group=None)


def _saved_bytes(rank, world_size):
    cfg = tiny_gpt_config(layers=1, hidden=64, heads=4, vocab=256, seq=64)
    singles = [dist.new_group([r]) for r in range(world_size)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = {}
    for cp, group in ((1, singles[rank]), (2, pairs[rank // 2]), (4, dist.group.WORLD)):
        torch.manual_seed(0)
        model = context_parallel(TinyGPT(cfg), group)
        block = model.blocks[0]
        x = torch.randn(2, 64 // cp, 64, requires_grad=True)
        out[cp] = saved_activation_bytes(block, lambda: block(x))["bytes"]
    return out


def test_activation_memory_per_rank_is_the_cp_term():
    # what autograd keeps for one block on each rank, against dtlib.analytic.activations with
    # cp: ring attention keeps no s x s matrix (Korthikanti's "selective" count: norm inputs, QKV
    # input, Q K V, projection input, MLP input and two f-sized tensors), fp32, no dropout; plus
    # the softmax log-sum-exp (b x a x s/cp floats) and LayerNorm's mean and rstd (b x s/cp each)
    b, s, h, a = 2, 64, 64, 4
    for measured in launch(_saved_bytes, 4, timeout=TIMEOUT):
        for cp, got in measured.items():
            predicted = layer_bytes(s, b, h, a, a, 4 * h, cp=cp, recompute="selective", dropout=False,
                                    act_bytes=4, norm_saved=1)
            extra = 4 * b * a * s // cp + 2 * 2 * 4 * b * s // cp
            assert got == predicted + extra, (cp, got, predicted)
        assert measured[1] == 2 * measured[2] == 4 * measured[4]
