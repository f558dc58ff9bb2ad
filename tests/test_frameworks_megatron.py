"""Megatron-Core side by side with one process and with dtlib: tensor-parallel layers, GPTModel at
TP 2 (+SP), data parallelism through Megatron's DDP, the 1F1B and interleaved schedules (their
order of passes = dtlib's schedule generator's), the batch_p2p_comm pitfall, the collectives and
bytes per rank, and Megatron-LM's flags.

Tolerances: every run does the same fp32 arithmetic as the one-rank reference except that tensor
parallelism sums partial products in a different order (observed differences: losses 1.2e-7,
parameters 2e-8, for parameters of size ~0.02-1 after 3 SGD steps at lr 0.5); 1e-6 is 5-50x
that, and about 1e-4 of what one training step changes (the loss moves by ~1e-2 per step).
"""
import pytest
import torch

from dtlib.frameworks.common import compare
from dtlib.frameworks.megatron_core import (executed_order, run_megatron, run_megatron_flags,
                                            schedule_order)
from dtlib.frameworks.megatron_cpu import cpu_shims, needs_cpu_shims
from dtlib.frameworks.megatron_flags import megatron_configs, parse_megatron_flags
from dtlib.frameworks.megatron_layers import compare_parallel_layers
from dtlib.parallel.schedules import schedule

TOL = 1e-6
TIMEOUT = 60.0  # a hung rank fails the test in a minute, not in the default two
BATCH = dict(micro_batch_size=2, num_microbatches=4)  # global batch 8 = dp x 2 x micro-batches
M, LAYERS = BATCH["num_microbatches"], 4


def _run(**kwargs):
    return run_megatron(**{**BATCH, "timeout": TIMEOUT, **kwargs})


@pytest.fixture(scope="module")
def reference():
    return _run()


@pytest.fixture(scope="module")
def runs():
    """One run per layout, shared by the equality, order, collective and memory tests."""
    return {"tp2": _run(tp=2), "tp2-sp": _run(tp=2, sequence_parallel=True),
            "dp2": _run(dp=2, num_microbatches=2), "1f1b": _run(pp=2),
            "interleaved": _run(pp=2, virtual_stages=2)}


def _equal(run, reference):
    diff = compare(run, reference)
    assert diff["max_loss_diff"] <= TOL and diff["max_param_diff"] <= TOL, (run.layout, diff)


def test_the_reference_trains(reference):
    # the tolerance is far below what one step changes, so equality is not vacuous
    assert abs(reference.losses[1] - reference.losses[0]) > 1e3 * TOL
    assert "decoder.layers.3.mlp.linear_fc2.weight" in reference.params
    assert reference.params["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (96, 32)


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp", "dp2", "1f1b", "interleaved"])
def test_gpt_model_under_megatron_equals_one_process(runs, reference, layout):
    _equal(runs[layout], reference)


@pytest.mark.parametrize("kwargs", [dict(tp=2, recompute_granularity="full"),
                                    dict(dp=2, num_microbatches=2, overlap_grad_reduce=True)],
                         ids=["recompute", "overlap-grad-reduce"])
def test_memory_and_overlap_options_keep_the_numbers(reference, kwargs):
    _equal(_run(**kwargs), reference)


@pytest.mark.parametrize("layout, pp, v", [("1f1b", 2, 1), ("interleaved", 2, 2)])
def test_megatron_runs_the_passes_in_dtlib_schedule_order(runs, layout, pp, v):
    expected = [[str(a) for a in ops] for ops in
                schedule("interleaved" if v > 1 else "1f1b", pp, M, v)]
    assert executed_order(runs[layout]) == expected


def test_schedule_order_runs_its_own_pipeline():
    assert schedule_order(2, 2) == [["F0", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]]


def test_batch_p2p_comm_makes_interleaved_pp2_silently_wrong_on_gloo(runs, reference):
    # the default of Megatron-Core's ModelParallelConfig: both neighbours of a rank are the same
    # peer at pp = 2, gloo pairs the batched sends and receives up wrongly; nothing raises, the
    # parameters end up far off (deterministic here, but only "far" is asserted)
    wrong = _run(pp=2, virtual_stages=2, batch_p2p_comm=True)
    assert compare(wrong, reference)["max_param_diff"] > 1.0
    _equal(runs["interleaved"], reference)  # the same run with batch_p2p_comm=False


def test_tensor_parallel_collectives_per_step(runs):
    # per micro-batch: 2 all-reduces forward + 2 backward per layer (Shoeybi et al. 2019, Sec. 3),
    # 1 for the vocabulary-parallel embedding (forward), 1 for the output layer's input gradient,
    # 3 in the vocabulary-parallel cross-entropy (max, target logit, sum of exponentials);
    # per step: the data-parallel gradient all-reduce (issued on a group of one rank too) and the
    # optimizer's gradient norm
    for counts in runs["tp2"].collectives:
        assert counts == {"all_reduce": M * (4 * LAYERS + 5) + 2}
    # sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2): per layer 2 all-gathers + 2
    # reduce-scatters forward, 4 all-gathers (2 of them re-gathering inputs for the weight
    # gradients) + 2 reduce-scatters backward; the output layer adds 2 all-gathers + 1
    # reduce-scatter and the embedding's backward 1 all-gather
    for counts in runs["tp2-sp"].collectives:
        assert counts["all_gather"] == M * (6 * LAYERS + 3)
        assert counts["reduce_scatter"] == M * (4 * LAYERS + 1)


@pytest.mark.parametrize("layout, v", [("1f1b", 1), ("interleaved", 2)])
def test_pipeline_point_to_point_calls(runs, layout, v):
    # each micro-batch crosses each of the p v - 1 stage boundaries once forward, once backward;
    # with p = 2 every rank sends and receives m (2v - 1) tensors
    for counts in runs[layout].collectives:
        assert counts["send"] == counts["recv"] == M * (2 * v - 1)


def test_parameter_bytes_per_rank(runs, reference):
    full = reference.memory[0]["parameters"]
    stages = [m["parameters"] for m in runs["1f1b"].memory]
    assert sum(stages) == full and min(stages) > 0  # each stage holds its own layers, once
    # TP: the matrices, biases of column-parallel layers and the vocabulary are split in two;
    # norms, positions and the row-parallel layers' biases are replicated
    replicated = sum(p.nbytes for name, p in reference.params.items()
                     if "norm" in name or "position" in name or "proj.bias" in name or "fc2.bias" in name)
    for m in runs["tp2"].memory:
        assert m["parameters"] == replicated + (full - replicated) // 2
        assert m["gradients"] == m["parameters"]  # Megatron's DDP buffer: one fp32 grad per parameter


@pytest.fixture(scope="module")
def mlp_reference():
    return _run(model="mlp")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_row_parallel_block_trains_equal_to_one_process(mlp_reference, sequence_parallel):
    run = _run(model="mlp", tp=2, sequence_parallel=sequence_parallel)
    _equal(run, mlp_reference)
    if not sequence_parallel:  # f and g: one all-reduce forward, one backward; + DDP and norm
        assert run.collectives == [{"all_reduce": 2 * M + 2}] * 2


@pytest.fixture(scope="module", params=[False, True], ids=["tp", "tp-sp"])
def layers(request):
    return request.param, compare_parallel_layers(2, sequence_parallel=request.param, timeout=TIMEOUT)


def test_megatron_layers_equal_the_full_layer_and_dtlib(layers):
    _, got = layers
    # one forward/backward of a 16 -> 64 -> 16 MLP on 16 tokens: outputs ~1, weight gradients
    # ~10; fp32 partial sums in another order differ by a few ulps of those
    assert got["megatron_vs_full_output"] <= 1e-6 and got["dtlib_vs_megatron_output"] <= 1e-6
    assert got["megatron_vs_full_grad"] <= 1e-5 and got["dtlib_vs_megatron_grad"] <= 1e-5


def test_megatron_and_dtlib_issue_the_same_collectives(layers):
    sequence_parallel, got = layers
    assert got["megatron_collectives"] == got["dtlib_collectives"]
    assert got["megatron_layer_collectives"] == got["dtlib_block_collectives"]
    if sequence_parallel:
        assert got["megatron_layer_collectives"] == {"forward": {"all_gather": 2, "reduce_scatter": 2},
                                                     "backward": {"all_gather": 4, "reduce_scatter": 2}}
    else:
        assert got["megatron_layer_collectives"] == {"forward": {"all_reduce": 2},
                                                     "backward": {"all_reduce": 2}}


# ---- Megatron-LM's flags ---------------------------------------------------------------------------
FLAGS = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
         "--num-layers-per-virtual-pipeline-stage 1 --micro-batch-size 2 --global-batch-size 8 "
         "--untie-embeddings-and-output-weights --optimizer sgd --seed 0")


def test_flags_become_run_arguments():
    got = parse_megatron_flags(FLAGS, world_size=4)
    assert {k: got[k] for k in ("tp", "pp", "dp", "virtual_stages", "num_microbatches",
                                "batch_p2p_comm")} == dict(tp=2, pp=2, dp=1, virtual_stages=2,
                                                           num_microbatches=4, batch_p2p_comm=False)
    assert parse_megatron_flags("--micro-batch-size 2", world_size=4)["num_microbatches"] == 1
    assert parse_megatron_flags(["--no-overlap-p2p-communication"], 2)["batch_p2p_comm"] is True


def test_flags_run_equal_one_process(reference):
    run = run_megatron_flags(FLAGS, world_size=4)
    _equal(run, reference)
    assert run.settings["flags"].startswith("--tensor-model-parallel-size 2")


@pytest.mark.parametrize("flags, world_size, message", [
    ("--tensor-model-parallel-size 3", 4, "--tensor-model-parallel-size 3 .* must divide the world size 4"),
    ("--context-parallel-size 2 --tensor-model-parallel-size 2", 2, "= 4 must divide the world size 2"),
    ("--micro-batch-size 3 --global-batch-size 8", 2, "--global-batch-size 8 must be a multiple of "
                                                      "--micro-batch-size 3 x data-parallel size 2"),
    ("--pipeline-model-parallel-size 3", 3, "--num-layers 4 must be divisible by --pipeline-model"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3", 2,
     "--num-layers-per-virtual-pipeline-stage 3 must divide the 2 layers per pipeline stage"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
     "--no-overlap-p2p-communication", 2, "needs --pipeline-model-parallel-size >= 3"),
    ("--num-layers-per-virtual-pipeline-stage 2", 1, "needs --pipeline-model-parallel-size >= 2, got 1"),
    ("--overlap-param-gather", 2, "--overlap-param-gather needs --use-distributed-optimizer"),
    ("--recompute-granularity selective --recompute-method uniform", 1, "--recompute-method is not"),
    ("--recompute-granularity most", 1, "--recompute-granularity must be one of full, selective"),
    ("--micro-batch-size two", 1, "--micro-batch-size must be an integer, got 'two'"),
    ("--micro-batch-size 0", 1, "--micro-batch-size must be an integer >= 1"),
    ("--global-batch-size", 1, "--global-batch-size needs a value"),
    ("--sequence-parallel=1", 2, "--sequence-parallel is a switch"),
    ("--tensor-parallel-size 2", 2, "unknown or unsupported Megatron-LM flag '--tensor-parallel-size'"),
])
def test_bad_flags_are_refused_naming_the_flag(flags, world_size, message):
    with pytest.raises(ValueError, match=message):
        parse_megatron_flags(flags, world_size)


def test_sequence_parallel_without_tensor_parallelism_is_ignored_as_megatron_lm_does():
    with pytest.warns(UserWarning, match="--sequence-parallel ignored"):
        assert parse_megatron_flags("--sequence-parallel", 2)["sequence_parallel"] is False


def test_megatron_own_config_classes_check_the_flags():
    config, ddp = megatron_configs(FLAGS + " --overlap-grad-reduce", world_size=4)
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
            config.virtual_pipeline_model_parallel_size) == (2, 2, 2)
    assert ddp.overlap_grad_reduce is True
    # our checks leave head divisibility to Megatron's TransformerConfig, which refuses it
    with pytest.raises(ValueError, match="num_attention_heads .* must be a multiple of"):
        megatron_configs("--tensor-model-parallel-size 2 --num-attention-heads 3 --hidden-size 30", 2)


# ---- bad arguments and the CPU shims ---------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=0), "tp must be"),
    (dict(sequence_parallel=True), "sequence_parallel=True needs tp > 1"),
    (dict(virtual_stages=2), "interleaved schedule needs pipeline parallelism"),
    (dict(pp=2, virtual_stages=2, num_microbatches=3), "multiple of pp=2"),
    (dict(pp=3), "num_layers \\(4\\) must be divisible by pp x virtual_stages = 3"),
    (dict(model="bert"), "model must be one of"),
    (dict(model="mlp", pp=2), "model='mlp' is one block"),
    (dict(tp=4, dp=4), "at most 8 run on one machine"),
    (dict(context_parallel_size=2), "needs Transformer Engine's attention"),
    (dict(timeout=float("nan")), "timeout must be"),
])
def test_bad_arguments_are_refused_before_any_rank_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_megatron(**kwargs)


@pytest.mark.skipif(not needs_cpu_shims(), reason="the shims apply only without GPUs")
def test_cpu_shims_redirect_cuda_only_inside_the_block():
    current = torch.cuda.current_device
    with cpu_shims() as notes:
        assert torch.zeros(1, device="cuda").device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
        assert any("current_device" in n for n in notes)
    assert torch.cuda.current_device is current
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    with pytest.raises(ValueError, match="use_distributed_optimizer=True needs one GPU per rank"):
        run_megatron(dp=2, optimizer="adam", use_distributed_optimizer=True)


def test_runs_record_the_shims_and_decisions(runs):
    run = runs["tp2"]
    notes = " ".join(run.notes)
    assert "clip_grad 0" in notes and ("TorchFunctionMode" in notes) == needs_cpu_shims()
    assert run.settings["tp"] == 2 and run.settings["batch_p2p_comm"] is False
    assert run.layout == "tp2 pp1 dp1"
