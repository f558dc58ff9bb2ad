"""A planned layout shrunk to TinyGPT on <= 8 ranks: what is kept, dropped and relaxed (with the
trainer's reasons), the command line, and the run equal to one process."""
import itertools
import math

import pytest

from dtlib.analytic.hardware import cluster
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.cli import build_parser
from dtlib.experiments import parallel3d
from dtlib.experiments.shrunk_layout import DROP_ORDER, TINY, shrink_layout, train_command, train_shrunk
from dtlib.plan.search import search, to_layout
from dtlib.cli.train import config_from_args

EVERY_DIMENSION = Parallelism(dp=8, tp=4, pp=2, cp=2, virtual_stages=3, schedule="interleaved", micro_batch_size=4,
                              num_microbatches=32, zero=1, sequence_parallel=True)
MEGATRON = Parallelism(dp=16, tp=8, num_microbatches=64, zero=1, recompute="selective", sequence_parallel=True)


def _sizes(config):
    return {d: getattr(config, d) for d in ("dp", "tp", "pp", "cp")}


def test_the_capstones_best_layout_keeps_its_data_parallelism_and_zero_stage():
    best = search(get_preset("capstone-10b"), cluster("h100-sxm", 16, 8, inter="ib-ndr"), 1024, top=1).configs[0]
    config, lines = shrink_layout(to_layout(best))
    for d in ("dp", "tp", "pp", "cp"):
        assert getattr(config, d) == min(best[d], 2), d
    assert config.zero == best["zero"]  # FSDP (ZeRO-3) composes with every dimension but ep
    assert config.num_microbatches == min(best["microbatches"], 2)  # gradient accumulation kept
    assert f"dp {best['dp']} -> 2" in lines[0]
    assert config.optimizer == "sgd" and config.world_size <= 8


def test_every_dimension_drops_cp_first_and_keeps_sequence_parallelism_with_the_pipeline():
    config, lines = shrink_layout(EVERY_DIMENSION)
    assert _sizes(config) == {"dp": 2, "tp": 2, "pp": 2, "cp": 1}
    assert (config.schedule, config.virtual_stages, config.layers) == ("interleaved", 2, 4)
    assert (config.micro_batch_size, config.num_microbatches, config.zero) == (2, 4, 1)
    assert config.sequence_parallel  # the trainer composes SP with pp (s/t positions between stages)
    assert any(line.startswith("cp 2 -> 1: dp x tp x pp x cp = 16 > 8 ranks") for line in lines)
    assert not any(line.startswith("sequence_parallel") for line in lines)


def test_four_ranks_drop_pipeline_after_context_and_keep_sequence_parallelism():
    config, lines = shrink_layout(EVERY_DIMENSION, max_ranks=4)
    assert _sizes(config) == {"dp": 2, "tp": 2, "pp": 1, "cp": 1}
    assert config.sequence_parallel and config.zero == 1
    assert (config.schedule, config.virtual_stages, config.num_microbatches) == ("1f1b", 1, 2)
    assert [line.split(":")[0] for line in lines if "ranks (dropped" in line] == ["cp 2 -> 1", "pp 2 -> 1"]
    assert "virtual stages 3 -> 1: no pipeline left to interleave" in lines


def test_fsdp_with_tensor_parallelism_keeps_zero_3_and_sequence_parallelism():
    # FSDP composes with TP + SP (torchtitan's 2-D layout): nothing to relax
    config, lines = shrink_layout(MEGATRON.with_(zero=3))
    assert _sizes(config) == {"dp": 2, "tp": 2, "pp": 1, "cp": 1}
    assert config.zero == 3 and config.sequence_parallel and config.recompute
    assert not any(line.startswith("zero 3 -> ") for line in lines), lines


def test_sequence_parallelism_and_zero_2_both_stay_with_a_pipeline():
    # SP's norm gradients are summed in backward, before ZeRO-2's reduce-scatter: both compose
    config, lines = shrink_layout(Parallelism(dp=16, tp=2, pp=2, num_microbatches=64, zero=2, sequence_parallel=True))
    assert config.zero == 2 and config.sequence_parallel
    assert not [line for line in lines if "True -> False" in line or "zero" in line]


def test_sequence_parallelism_is_relaxed_with_the_trainers_reason_when_cp_stays():
    config, lines = shrink_layout(Parallelism(dp=16, tp=2, cp=2, zero=1, sequence_parallel=True))
    assert _sizes(config) == {"dp": 2, "tp": 2, "pp": 1, "cp": 2} and not config.sequence_parallel
    assert "does not compose with cp" in next(line for line in lines if line.startswith("sequence_parallel"))


def test_context_parallel_fsdp_plan_keeps_both():
    config, _ = shrink_layout(Parallelism(dp=64, cp=2, micro_batch_size=4, num_microbatches=4, zero=3))
    assert _sizes(config) == {"dp": 2, "tp": 1, "pp": 1, "cp": 2} and config.zero == 3
    assert config.seq % (2 * config.cp) == 0


def test_zero_without_replicas_is_turned_off_and_expert_parallelism_is_said():
    config, lines = shrink_layout(Parallelism(tp=8, pp=16, num_microbatches=64, zero=3))
    assert config.zero == 0 and any("needs dp x cp >= 2" in line for line in lines)
    config, lines = shrink_layout(Parallelism(dp=8, ep=4, num_microbatches=2))
    assert config.ep == 1 and lines[1].startswith("ep 4 -> 1")


@pytest.mark.parametrize("max_ranks", [8, 4, 2])
def test_every_plan_shrinks_to_a_config_the_trainer_accepts(max_ranks):
    seen = 0
    for dp, tp, pp, cp, zero, sp, v, recompute in itertools.product(
            (1, 2, 16), (1, 2, 8), (1, 2, 4), (1, 2), range(4), (False, True), (1, 3), ("none", "selective")):
        if (sp and tp == 1) or (v > 1 and pp == 1):
            continue
        layout = Parallelism(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, sequence_parallel=sp, virtual_stages=v,
                             schedule="interleaved" if v > 1 else "1f1b", num_microbatches=4 * pp,
                             recompute=recompute)
        config, lines = shrink_layout(layout, max_ranks)
        config.check()
        assert config.world_size <= max_ranks
        used = [d for d in ("dp", "tp", "pp", "cp") if getattr(layout, d) > 1]
        kept = [d for d in used if getattr(config, d) == 2]
        dropped = [d for d in DROP_ORDER if d in used and d not in kept]
        # only as many dropped as needed, and in DROP_ORDER
        assert dropped == [d for d in DROP_ORDER if d in used][:len(dropped)]
        assert 2 ** len(kept) <= max_ranks < (2 ** (len(kept) + 1) if dropped else math.inf)
        assert config.recompute == (recompute != "none") and config.optimizer == "sgd"
        seen += 1
    assert seen > 400


@pytest.mark.parametrize("layout", [EVERY_DIMENSION, MEGATRON, Parallelism(dp=64, cp=2, num_microbatches=2, zero=3)])
def test_the_command_line_parses_back_to_the_same_config(layout):
    config, _ = shrink_layout(layout)
    command = train_command(config)
    assert command.startswith(f"dtlib train --dp {config.dp} ")
    args = build_parser().parse_args(command.split()[1:])
    assert config_from_args(args) == config


def test_the_shrunk_megatron_design_trains_like_one_process():
    run = train_shrunk(MEGATRON, max_ranks=4)
    assert run["config"].world_size == 4 and run["command"].startswith("dtlib train --dp 2 --tp 2 --zero 1 ")
    assert len(run["parallel"]) == len(run["single"]) == TINY.steps
    assert run["single"][-1] < run["single"][0]  # it trains
    assert run["max_loss_diff"] < parallel3d.LOSS_TOL and run["max_param_diff"] < parallel3d.PARAM_TOL
    assert run["equal"] and len(run["parallel_sha256"]) == 64


def test_the_comparison_notices_a_reference_that_is_not_the_same_training(monkeypatch):
    # a reference 1% off in learning rate stands for a gradient 1% off: it must not read as equal
    real = parallel3d.single_process_config
    monkeypatch.setattr(parallel3d, "single_process_config", lambda c: real(c).with_(lr=c.lr * 1.01))
    run = train_shrunk(Parallelism(dp=4, zero=1), max_ranks=2)
    assert run["max_param_diff"] > 100 * parallel3d.PARAM_TOL and not run["equal"]


def test_drop_order_dp_first_rehearses_context_parallelism_on_eight_ranks():
    """Lesson 10 rehearses the layout that uses all four dimensions: dropping dp first keeps
    tp x pp x cp = 8 ranks (on main cp was always dropped, so CP was never rehearsed)."""
    config, lines = shrink_layout(EVERY_DIMENSION, drop_order=("dp", "pp", "tp", "cp"))
    assert (config.dp, config.tp, config.pp, config.cp) == (1, 2, 2, 2)
    assert [line.split(":")[0] for line in lines if "ranks (dropped" in line] == ["dp 2 -> 1"]
    with pytest.raises(ValueError, match="drop_order must be an ordering of"):
        shrink_layout(EVERY_DIMENSION, drop_order=("dp", "tp"))
