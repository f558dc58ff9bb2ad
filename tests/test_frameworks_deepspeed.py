"""DeepSpeed ZeRO 1-3 and CPU optimizer offload on 2 CPU ranks = one process = dtlib's ZeRO/FSDP.

Each DeepSpeed run is shared through a module-scoped fixture (the first costs ~10 s: importing
DeepSpeed and the torch.compile machinery its ZeRO optimizer check pulls in; later ones ~1 s);
the CPU Adam op compiles once per machine (~40-60 s on 2 idle cores, cached in
~/.cache/torch_extensions) in the test process, before the offload run starts its ranks.
"""
from __future__ import annotations

import copy
import os

import pytest

pytest.importorskip("deepspeed")

from dtlib.analytic.layout import Parallelism  # noqa: E402
from dtlib.analytic.memory import memory_per_gpu  # noqa: E402
from dtlib.analytic.precision import precision  # noqa: E402
from dtlib.frameworks.common import compare  # noqa: E402
from dtlib.frameworks.deepspeed_zero import (MODEL, dtlib_run, memory_estimates, reference_run,  # noqa: E402
                                             run_deepspeed, validate_deepspeed_config)

WORLD = 2
# SGD with momentum: an update proportional to the gradient (a gradient off by a constant factor,
# e.g. summed instead of averaged over ranks, moves the weights; Adam's normalised step would hide
# it), and a state tensor per parameter for ZeRO-1 to shard.
SGD = {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}
# fp32 on 2 ranks: the runs differ from one process only by summation order (micro-batch means
# averaged over ranks vs one mean over the batch). The loss (~5.5) is then within a few fp32 ulps
# (one ulp at 5.5 is 4.8e-7; seen: 2.4e-7) and the parameters within a few ulps of their size
# (seen: 3e-8). A real error (a gradient not averaged, a micro-batch dropped, clipping) moves
# them by lr x gradient ~ 1e-3 or more.
LOSS_TOL, PARAM_TOL = 1e-6, 1e-6


def config(stage: int, **changes) -> dict:
    """Global batch 4 = 1 sequence x 2 accumulation steps x 2 ranks; clipping off (DeepSpeed's
    default is 1.0); ZeRO-3 shards every parameter (its default persistence threshold, 1e5
    elements, would keep all of TinyGPT's whole on every rank)."""
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    base = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "optimizer": SGD,
            "zero_optimization": zero}
    base.update(changes)
    return copy.deepcopy(base)


@pytest.fixture(scope="module")
def reference():
    return reference_run(config(1))


@pytest.fixture(scope="module")
def deepspeed_runs():
    return {stage: run_deepspeed(config(stage), WORLD, timeout=90) for stage in (1, 2, 3)}


@pytest.fixture(scope="module")
def dtlib_runs():
    return {stage: dtlib_run(config(stage), WORLD, timeout=60) for stage in (1, 2, 3)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_equals_one_process_and_dtlib(stage, reference, deepspeed_runs, dtlib_runs):
    ds = deepspeed_runs[stage]
    diff = compare(ds, reference)
    assert diff["max_loss_diff"] < LOSS_TOL and diff["max_param_diff"] < PARAM_TOL, diff
    mine = compare(dtlib_runs[stage], reference)
    assert mine["max_loss_diff"] < LOSS_TOL and mine["max_param_diff"] < PARAM_TOL, mine
    side_by_side = compare(ds, dtlib_runs[stage])
    assert side_by_side["max_param_diff"] < 2 * PARAM_TOL, side_by_side
    assert len(set(ds.losses)) == 3  # it trained: the loss changed at every step
    assert ds.settings == config(stage)  # the config reported as given


def test_cpu_adam_offload_equals_one_process():
    """ZeRO-2 with the optimizer on the CPU (DeepSpeed's CPU Adam, compiled on first use)."""
    adam = config(2, optimizer={"type": "Adam", "params": {"lr": 1e-2}},
                  zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
    del adam["zero_allow_untested_optimizer"]
    run = run_deepspeed(adam, WORLD, timeout=60)  # CPU Adam is compiled before the ranks start
    diff = compare(run, reference_run(adam))
    # CPU Adam's vectorised update rounds differently from torch.optim.AdamW's, and Adam divides
    # by sqrt(v): a rounding difference in a tiny gradient becomes a visible one in its update
    # (seen: 1.1e-5). 1e-4 is 1% of one step (each element moves by about lr = 1e-2 per step); a
    # wrong rule (no bias correction, a skipped or repeated step, another lr) moves by ~lr.
    assert diff["max_loss_diff"] < LOSS_TOL and diff["max_param_diff"] < 1e-4, diff
    shard = 4 * _params() / WORLD  # fp32 bytes of one rank's partition
    largest = 4 * max(p.numel() for p in _model().parameters())
    for held in run.memory:
        # on the CPU: the fp32 master and Adam's two moments, a partition each, and the reduced
        # gradient partition twice (the master's .grad and the accumulator across micro-batches,
        # which holds the parameter cut by the partition boundary whole); none left beside the model
        assert held["master"] == shard and held["optimizer_states"] == 2 * shard
        assert 2 * shard <= held["offloaded_gradients"] <= 2 * shard + largest
        assert held["offloaded"] == held["optimizer"] + held["offloaded_gradients"]
        assert held["gradients"] == 0
    rows = memory_estimates(adam, WORLD, measured=run)
    assert rows["measured"]["gpu"] == rows["dtlib (fp32)"]["gpu"] == 4 * _params()  # the parameters


def test_default_gradient_clipping_changes_the_numbers(reference, deepspeed_runs):
    """The pitfall: DeepSpeed 0.19 clips the gradient norm at 1.0 unless told otherwise."""
    user = config(1)
    del user["gradient_clipping"]
    run = run_deepspeed(user, WORLD, timeout=60)
    assert run.settings == user  # kept as the user wrote it, not "fixed"
    assert any("gradient_clipping" in note and "1.0" in note for note in run.notes)
    assert run.losses[0] == pytest.approx(reference.losses[0], abs=LOSS_TOL)  # no update yet
    assert compare(run, reference)["max_param_diff"] > 1e-3  # seen: 5e-2
    assert compare(deepspeed_runs[1], reference)["max_param_diff"] < PARAM_TOL  # the same with 0.0


def _model():
    from dtlib.models.gpt import TinyGPT

    return TinyGPT(MODEL)


def _params() -> int:
    return sum(p.numel() for p in _model().parameters())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_held_per_rank(stage, deepspeed_runs):
    """ZeRO-1 shards the optimizer state, ZeRO-2 the gradients too, ZeRO-3 the parameters too:
    measured from DeepSpeed's optimizer on each rank, against dtlib.analytic.memory."""
    full = 4 * _params()  # fp32 bytes of every parameter
    shards = {1: {"parameters": 1, "gradients": 1, "optimizer_states": 1 / WORLD},
              2: {"parameters": 1, "gradients": 1 / WORLD, "optimizer_states": 1 / WORLD},
              3: {"parameters": 1 / WORLD, "gradients": 1 / WORLD, "optimizer_states": 1 / WORLD}}[stage]
    predicted = memory_per_gpu(MODEL, Parallelism(dp=WORLD, zero=stage),
                               precision=precision("fp32", "fp32", "sgd-momentum"))
    analytic = {"parameters": predicted.parameters, "gradients": predicted.gradients,
                "optimizer_states": predicted.optimizer}
    # between micro-batches ZeRO-2 keeps the whole gradient of the parameter its partition
    # boundary cuts (blocks.1.mlp.down.weight here): at most one parameter more than the shard
    largest = 4 * max(p.numel() for p in _model().parameters())
    for held in deepspeed_runs[stage].memory:
        for kind, fraction in shards.items():
            assert fraction * full <= held[kind] <= fraction * full + largest, (kind, held)
            assert analytic[kind] == fraction * full, (kind, analytic)
        # DeepSpeed keeps an fp32 master partition even in fp32 training; dtlib's fp32 convention
        # has none (docs/frameworks.md, "DeepSpeed")
        assert held["master"] == pytest.approx(full / WORLD, rel=0.01)


def test_collectives_per_stage(deepspeed_runs, dtlib_runs):
    """What DeepSpeed issues on gloo over 3 steps of 2 micro-batches (counted at the c10d layer)."""
    steps, micro = 3, 2
    for stage, run in deepspeed_runs.items():
        assert run.collectives[0] == run.collectives[1]
    one, two, three = (deepspeed_runs[s].collectives[0] for s in (1, 2, 3))
    # ZeRO-1: one all-reduce of the gradients at the accumulation boundary and one of the
    # gradient norm (4 bytes), then the updated partitions all-gathered
    assert one == {"all_reduce": 2 * steps, "all_gather": steps}
    # ZeRO-2: its "reduce-scatter" is an all-reduce of each gradient bucket, every micro-batch
    # (use_multi_rank_bucket_allreduce), each rank keeping its slice; + the norm
    assert two == {"all_reduce": (micro + 1) * steps, "all_gather": steps}
    # ZeRO-3: parameters all-gathered (module by module in the first step, then as one prefetched
    # bucket), gradients reduce-scattered once per micro-batch, the norm all-reduced, and the
    # first step's trace checked across ranks with broadcasts
    assert three["reduce_scatter"] == micro * steps and three["all_reduce"] == steps
    assert three["all_gather"] > micro * steps and "broadcast" in three
    # dtlib's ZeRO-2 reduce-scatters where DeepSpeed all-reduces
    assert dtlib_runs[2].collectives[0] == {"reduce_scatter": micro * steps, "all_gather": steps}


def test_memory_estimates_side_by_side(deepspeed_runs):
    p = _params()
    two = memory_estimates(config(2), WORLD, measured=deepspeed_runs[2])
    # DeepSpeed's ZeRO-2 estimator = dtlib's formula with the convention it assumes (2 + 18/N)
    assert two["deepspeed"]["gpu"] == pytest.approx(2 * p + 18 * p / WORLD)
    assert two["dtlib (megatron-fp16)"]["gpu"] == pytest.approx(two["deepspeed"]["gpu"])
    # ZeRO-3: DeepSpeed counts 18 bytes/param (no 16-bit parameter shard) and 4 x the largest
    # module's own parameters (the 8192-element embedding); dtlib 20 and 2 x 2 x the largest block
    three = memory_estimates(config(3), WORLD, measured=deepspeed_runs[3])
    assert three["deepspeed"]["gpu"] == pytest.approx(4 * MODEL.vocab * MODEL.hidden + 18 * p / WORLD)
    dtlib3 = three["dtlib (megatron-fp16)"]
    assert dtlib3["gpu"] - dtlib3["temporary"] == pytest.approx(20 * p / WORLD)
    # what the fp32 run holds = dtlib's fp32 formula + DeepSpeed's fp32 master partition (+ at
    # ZeRO-2 the whole gradient of the parameter cut by the partition boundary, see above)
    largest = 4 * max(t.numel() for t in _model().parameters())
    for rows in (two, three):
        fp32 = rows["dtlib (fp32)"]
        expected = fp32["parameters"] + fp32["gradients"] + fp32["optimizer"] + 4 * p / WORLD
        assert expected <= rows["measured"]["gpu"] <= expected + largest


def test_validation_names_the_key():
    good = config(2)
    validate_deepspeed_config(good, WORLD)
    cases = [
        (dict(train_batch_size=6), "train_batch_size must equal train_micro_batch_size_per_gpu x "
                                   "gradient_accumulation_steps x world_size = 1 x 2 x 2 = 4, got 6"),
        (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps must be an integer >= 1"),
        (dict(zero_optimization={"stage": 4}), "zero_optimization.stage must be 0, 1, 2 or 3, got 4"),
        (dict(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}}),
         "zero_optimization.offload_optimizer needs zero_optimization.stage >= 1, got stage 0"),
        (dict(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}}),
         "zero_optimization.offload_param needs zero_optimization.stage >= 3, got stage 2"),
        (dict(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}),
         "optimizer.type must be one of Adam, AdamW, Adagrad, Lion with zero_optimization.offload_optimizer"),
        (dict(zero_optimization={"stage": 3, "offload_param": {"device": "gpu"}}),
         "zero_optimization.offload_param.device must be 'none', 'cpu' or 'nvme', got 'gpu'"),
        (dict(zero_optimization=3), "zero_optimization must be a JSON object (a dict), got 3"),
        (dict(gradient_cliping=0.0), "'gradient_cliping' is not a key DeepSpeed reads (it would be ignored "
                                     "silently); did you mean 'gradient_clipping'?"),
        (dict(optimizer={"type": "SGD", "parms": {"lr": 0.5}}),
         "optimizer.parms is not a key DeepSpeed reads (it would be ignored silently); optimizer takes 'type' and "
         "'params'"),
        # DeepSpeed's own DeepSpeedConfig, its pydantic error in one line
        (dict(zero_optimization={"stage": 2, "overlap_com": True}),
         "DeepSpeedConfig refused the config: zero_optimization.overlap_com: Extra inputs are not permitted"),
        (dict(bf16={"enabled": True}, fp16={"enabled": True}),
         "DeepSpeedConfig refused the config: bfloat16 and fp16 modes cannot be simultaneously enabled"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError) as error:
            validate_deepspeed_config({**good, **changes}, WORLD)
        assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
    with pytest.raises(ValueError, match="train_batch_size must equal .* x 3 = 6, got 4"):
        validate_deepspeed_config(good, 3)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got 0"):
        validate_deepspeed_config(good, 0)
    with pytest.raises(ValueError, match="ds_config must be a dict"):
        validate_deepspeed_config("ds_config.json", WORLD)


def test_runs_refuse_before_starting():
    """What one process cannot mirror is refused before any rank starts (a typo too)."""
    for changes, message in [(dict(optimizer={"type": "Lamb"}), "optimizer.type must be one of SGD, Adam, AdamW"),
                             (dict(scheduler={"type": "WarmupLR"}), "scheduler must be left out"),
                             (dict(bf16={"enabled": True}), "bf16.enabled must be false"),
                             (dict(train_micro_batch_size_per_gpu=2), "train_batch_size must equal"),
                             (dict(optimizer={"type": "SGD", "params": {"lrr": 0.5}}),
                              "optimizer.params are not valid for SGD: .* unexpected keyword argument 'lrr'")]:
        with pytest.raises(ValueError, match=message):
            run_deepspeed(config(2, **changes), WORLD, timeout=5)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        run_deepspeed(config(2), WORLD, steps=0, timeout=5)
    with pytest.raises(ValueError, match="optimizer.type must be one of SGD"):
        reference_run(config(2, optimizer={"type": "Lamb"}))


def test_deepspeed_on_cpu_prints_nothing_of_what_it_lacks():
    """Issue 38: validating a config (DeepSpeed's first import) once logged "[WARNING] Setting
    accelerator to CPU" and probed every op, the async-io one printing "ld: cannot find -laio" and
    "collect2: error". In a fresh interpreter: silent, and no op probed."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("from dtlib.frameworks.deepspeed_zero import validate_deepspeed_config\n"
            "validate_deepspeed_config({'train_batch_size': 4, 'train_micro_batch_size_per_gpu': 2,"
            " 'gradient_accumulation_steps': 1, 'zero_optimization': {'stage': 1},"
            " 'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}, 'zero_allow_untested_optimizer': True}, 2)\n"
            "import deepspeed.ops\n"
            "print(sorted(vars(deepspeed.ops)['__compatible_ops__']))\n")
    root = str(Path(__file__).resolve().parent.parent)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "['deepspeed_shm_comm']" and run.stderr.strip() == "", (run.stdout, run.stderr)
