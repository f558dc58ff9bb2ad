"""The TP collectives outside the transformer layers (dtlib.plan.vocab_parallel) against what
dtlib.parallel.tensor makes on 2 gloo ranks, counted by dtlib.measure.CollectiveCounter; and where
the step time puts them (the first stage's embedding, the last stage's output layer and loss)."""
import json
from collections import Counter

import numpy as np
import pytest
import torch

from dtlib.analytic.comm import collective_time
from dtlib.analytic.hardware import cluster
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.validate import InvalidArgument
from dtlib.launcher import launch
from dtlib.measure import CollectiveCounter
from dtlib.models import TinyGPT, tiny_gpt_config
from dtlib.parallel.tensor import tensor_parallel, vocab_parallel_cross_entropy
from dtlib.plan.steptime import StepOptions, step_time
from dtlib.plan.vocab_parallel import vocab_parallel_collectives

TIMEOUT = 60
B, FP32 = 2, 4
CFG = tiny_gpt_config(layers=2, hidden=32, heads=2, vocab=64, seq=8)


def _expected(parts: tuple[str, ...], sp: bool, cross_entropy_all_reduces: int = 2) -> Counter:
    """(op, bytes) -> calls of the planner's count, for the ``parts`` named."""
    out = Counter()
    for part, op, nbytes, calls in vocab_parallel_collectives(B * CFG.seq, CFG.hidden, FP32, sp, 1, 1,
                                                              cross_entropy_all_reduces):
        if part in parts and int(calls):
            out[(op, int(nbytes))] += int(calls)
    return out


def _counted(rank: int, world_size: int, sp: bool) -> dict[str, Counter]:
    torch.manual_seed(0)
    model = tensor_parallel(TinyGPT(CFG), sequence_parallel=sp, sequence_parallel_grads="manual")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab, (B, CFG.seq + 1), generator=g)
    idx, targets = tokens[:, :-1], tokens[:, 1:]
    out = {}
    with CollectiveCounter() as embedding:
        model.wte(idx).square().sum().backward()
    out["embedding"] = embedding
    x = torch.randn(B, CFG.seq // (2 if sp else 1), CFG.hidden, generator=g, requires_grad=True)
    with CollectiveCounter() as head:
        vocab_parallel_cross_entropy(model.lm_head(x), targets).backward()
    out["head"] = head
    with CollectiveCounter() as whole:  # one micro-batch as dtlib train runs it
        vocab_parallel_cross_entropy(model(idx), targets).backward()
    out["whole"] = whole
    return {k: Counter(c.calls) for k, c in out.items()}


@pytest.mark.parametrize("sp", [False, True])
def test_counted_collectives_are_dtlib_tensors(sp):
    for counted in launch(_counted, 2, args=(sp,), timeout=TIMEOUT):
        assert counted["embedding"] == _expected(("embedding",), sp)
        # under SP the column-parallel output layer gathers its input again in backward (as Megatron's),
        # which the planner, as for the layers' column-parallel GEMMs, does not count
        regather = Counter({("all_gather", B * CFG.seq * CFG.hidden * FP32): int(sp)})
        assert counted["head"] == _expected(("output_layer", "cross_entropy"), sp) + regather
        if not sp:  # the layers' 4 all-reduces of b s h each (Shoeybi et al. 2019) and the rest: 12
            layers = Counter({("all_reduce", B * CFG.seq * CFG.hidden * FP32): 4 * CFG.layers})
            everything = _expected(("embedding", "output_layer", "cross_entropy"), sp)
            assert counted["whole"] == layers + everything
            assert sum(counted["whole"].values()) == 12


def test_megatron_cross_entropy_sends_the_same_bytes_in_three_messages():
    fused, unfused = (_expected(("cross_entropy",), False, k) for k in (2, 3))
    stats = B * CFG.seq * FP32
    assert fused == Counter({("all_reduce", stats): 1, ("all_reduce", 2 * stats): 1})
    assert unfused == Counter({("all_reduce", stats): 3})
    with pytest.raises(InvalidArgument, match="cross_entropy_all_reduces"):
        vocab_parallel_collectives(16, 32, 4, False, 1, 1, 4)
    with pytest.raises(InvalidArgument, match="cross_entropy_all_reduces"):
        StepOptions(cross_entropy_all_reduces=1)


def _tp_comm(layout: Parallelism, **options) -> float:
    # fp32 activations and no overlap: the layers' all-reduces are the 4 x layers x m of Shoeybi et al.
    opts = StepOptions(precision="fp32", tp_overlap=0.0, **options)
    return step_time(CFG, layout, cluster("h100-sxm", nodes=1, gpus_per_node=4), options=opts).breakdown["tp_comm"]


def test_step_time_counts_them_on_the_stages_that_hold_them():
    link = cluster("h100-sxm", nodes=1, gpus_per_node=4).intra
    m, tokens = 2, B * CFG.seq
    act, stats = tokens * CFG.hidden * FP32, tokens * FP32

    def ar(nbytes):
        return collective_time("all_reduce", nbytes, 2, link)

    layers = 4 * CFG.layers * m * ar(act)
    tp2 = Parallelism(dp=2, tp=2, micro_batch_size=B, num_microbatches=m)
    # one stage: the embedding's forward, the output layer's backward, the loss's max and sums
    assert _tp_comm(tp2, cross_entropy_all_reduces=2) == pytest.approx(
        layers + m * (2 * ar(act) + ar(stats) + ar(2 * stats)))
    assert _tp_comm(tp2) == pytest.approx(layers + m * (2 * ar(act) + 3 * ar(stats)))
    # two stages: the last is the slowest (the LM head), one layer, no embedding there
    pp2 = Parallelism(tp=2, pp=2, micro_batch_size=B, num_microbatches=m)
    assert _tp_comm(pp2, cross_entropy_all_reduces=2) == pytest.approx(
        layers / 2 + m * (ar(act) + ar(stats) + ar(2 * stats)))
    # without TP: nothing
    assert _tp_comm(Parallelism(dp=4, micro_batch_size=B, num_microbatches=m)) == 0
    assert np.isfinite(_tp_comm(Parallelism(dp=2, tp=2, sequence_parallel=True, micro_batch_size=B,
                                            num_microbatches=m)))


def test_plan_cli_takes_the_loss_convention(capsys):
    from dtlib.cli import main
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--tp", "8", "--pp", "1",
            "--cp", "1", "--zero", "1", "--micro-batch", "1", "--recompute", "none", "--tp-overlap", "0", "--json"]
    times = []
    for k in ("2", "3"):
        assert main(base + ["--cross-entropy-all-reduces", k]) == 0
        times.append(json.loads(capsys.readouterr().out)["configs"][0]["breakdown"]["tp_comm"])
    assert times[0] < times[1]  # the same bytes in one message less
    assert main(base + ["--cross-entropy-all-reduces", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cross-entropy-all-reduces" in err[0] and "2, 3" in err[0]
