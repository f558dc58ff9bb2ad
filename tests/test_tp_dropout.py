"""Dropout under tensor parallelism (dtlib.parallel.random, Megatron's RNG tracker): a mask is the
same on every TP rank where the activation is replicated and each rank's own where the ranks hold
different parts (heads; sequence shards under SP). Checked on 2 ranks by what it must cause:
replicated parameters stay bit-identical across the TP ranks while training with dropout, the
attention masks of the two ranks' heads differ, and the default stream is left where it was."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.launcher import launch
from dtlib.models import TinyGPT, tiny_gpt_config
from dtlib.parallel import tensor_parallel
from dtlib.parallel.random import RNGStatesTracker, model_parallel_manual_seed
from dtlib.parallel.tensor import full_state_dict, vocab_parallel_cross_entropy

TIMEOUT = 60
CFG = dict(layers=2, hidden=32, heads=4, vocab=64, seq=16)


def _train(sp: bool, dropout: float) -> dict:
    torch.manual_seed(0)
    model = tensor_parallel(TinyGPT(tiny_gpt_config(**CFG), dropout=dropout), sequence_parallel=sp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(6):  # one batch, learnt by heart: the loss falls through the dropout noise
        loss = vocab_parallel_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    replicated = {n: p.detach().clone() for n, p in model.named_parameters()
                  if not getattr(p, "tensor_model_parallel", False)}
    full = full_state_dict(model)
    return {"losses": losses, "replicated": replicated, "full": full}


def _attention_masks() -> list[torch.Tensor]:
    """The dropout mask of each rank's attention probabilities (ones through dropout)."""
    torch.manual_seed(0)
    model = tensor_parallel(TinyGPT(tiny_gpt_config(**CFG), dropout=0.5))
    with model.blocks[0].attn.dropout_rng():
        local = F.dropout(torch.ones(1, 2, 16, 16), 0.5, True)
    masks = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(masks, local)
    return masks


def _worker(rank, world_size):
    return {"sp": _train(True, 0.2), "tp": _train(False, 0.2), "masks": _attention_masks()}


@pytest.fixture(scope="module")
def ranks():
    return launch(_worker, 2, timeout=TIMEOUT)


@pytest.mark.parametrize("layout", ["tp", "sp"])
def test_replicated_parameters_stay_identical_across_tp_ranks_with_dropout(ranks, layout):
    """A residual-stream mask that differed between ranks without SP (or an attention mask shared
    by ranks that hold other heads) would make the replicas' gradients differ: the norms drift."""
    a, b = ranks[0][layout], ranks[1][layout]
    assert a["replicated"].keys() == b["replicated"].keys() and a["replicated"]
    for name in a["replicated"]:
        assert torch.equal(a["replicated"][name], b["replicated"][name]), name
    assert a["losses"] == b["losses"]
    assert a["losses"][-1] < a["losses"][0]  # it trains


def test_each_rank_drops_its_own_heads(ranks):
    first, second = ranks[0]["masks"]
    assert not torch.equal(first, second)
    assert 0.3 < (first == 0).float().mean().item() < 0.7  # p = 0.5


def test_dropout_changes_the_run(ranks):
    """With dropout the run is not the dropout-free one (the masks really apply)."""
    torch.manual_seed(0)
    plain = TinyGPT(tiny_gpt_config(**CFG))
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    no_dropout = F.cross_entropy(plain(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).item()
    assert ranks[0]["tp"]["losses"][0] != pytest.approx(no_dropout, abs=1e-4)


def test_tracker_fork_leaves_the_default_stream_alone():
    tracker = model_parallel_manual_seed(7, tp_rank=1)
    before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    with tracker.fork():
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the stream advanced
    other = model_parallel_manual_seed(7, tp_rank=0)
    with other.fork():
        assert not torch.equal(torch.rand(3), first)  # another rank, another stream
    with pytest.raises(ValueError, match="no random stream"):
        with RNGStatesTracker().fork():
            pass
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        model_parallel_manual_seed(-1, 0)
