"""JAX GSPMD next to one device and next to dtlib's analytic counts: the four layouts of
:data:`dtlib.frameworks.jax_gspmd.LAYOUTS` train equal to the unsharded run, the collectives XLA
compiled in are the ones dtlib counts (where they differ, the test says how), FSDP keeps 1/N of
the parameters per device, and ``shard_map``'s gradient pitfall shows and is fixed.

Every JAX run is a subprocess with its own host device count; the four layouts and the reference
share one (module fixture)."""
from collections import Counter
from importlib.util import find_spec

import numpy as np
import pytest

from dtlib.analytic.comm import strategy_volumes
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import memory_per_gpu
from dtlib.frameworks.common import compare
from dtlib.frameworks.jax_gspmd import (LAYOUTS, MODEL, hlo_collective_calls, hlo_collectives, reference_run,
                                        run_jax, run_layouts, shard_map_pitfall, validate_layout)

# find_spec, not importorskip: jax runs only in subprocesses with their own device count
pytestmark = pytest.mark.skipif(find_spec("jax") is None, reason="jax is not installed")

# dtlib's description of the same model: no biases, RMSNorm, no position embedding ("rope" has
# no parameters either), untied head
CFG = TransformerConfig(layers=MODEL["layers"], hidden=MODEL["hidden"], heads=MODEL["heads"],
                        vocab=MODEL["vocab"], seq=MODEL["seq"], ffn=MODEL["ffn"], bias=False,
                        norm="rmsnorm", position="rope")
# the same layouts in dtlib's terms; a data replica holds global_batch / dp sequences
DTLIB = {"dp": Parallelism(dp=8), "fsdp": Parallelism(dp=8, zero=3),
         "dp_tp": Parallelism(dp=4, tp=2, micro_batch_size=2),
         "fsdp_tp": Parallelism(dp=4, tp=2, zero=3, micro_batch_size=2)}
FP32 = 4
# Megatron splits the embedding and the head over the vocabulary on TP ranks
# (VocabParallelEmbedding); these layouts leave both whole over `model`, so each device holds
# 1/tp of them more than dtlib's Megatron count
EMBED_AND_HEAD = 2 * MODEL["vocab"] * MODEL["hidden"] * FP32
# XLA combines the loss's mean (one f32) into the gradient all-reduce
LOSS_SCALAR = FP32
# Tolerances: losses are ~4.16, where one float32 ulp is 4.8e-7; a sharded step sums the batch
# and the gradients in another order, so a few ulps (seen: 1) differ. Parameters move by
# lr * gradient ~1e-3 per step and are at most 1 (norm weights, ulp 1.2e-7): seen 7.5e-9.
LOSS_TOL = 2e-6
PARAM_TOL = 1e-6


@pytest.fixture(scope="module")
def runs():
    return run_layouts(timeout=120.0)


def _calls(run):
    return Counter((c["op"], c["group_size"], c["bytes"]) for c in run.settings["hlo_collectives"])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_trains_equal_to_one_device(runs, name):
    reference = runs["reference"]
    assert reference.losses[0] != reference.losses[-1]  # it trained
    assert reference.collectives == [{}]
    diff = compare(runs[name], reference)
    assert diff["max_loss_diff"] <= LOSS_TOL and diff["max_param_diff"] <= PARAM_TOL, diff
    assert len(runs[name].memory) == len(runs[name].collectives) == 8


def test_the_reference_in_a_one_device_process_is_the_same_run(runs):
    alone = reference_run(timeout=60.0)
    assert compare(alone, runs["reference"]) == {"max_loss_diff": 0.0, "max_param_diff": 0.0}
    assert len(alone.memory) == 1


def test_dp_is_one_combined_gradient_all_reduce_as_dtlib_counts(runs):
    dtlib = strategy_volumes(CFG, DTLIB["dp"], precision="fp32")
    grads = dtlib["dp_grad_all_reduce"]
    assert runs["dp"].collectives[0] == {"all_reduce": int(grads["calls"])} == {"all_reduce": 1}
    # one all-reduce over all 8 devices of every gradient at once (XLA's combiner = DDP's buckets)
    assert _calls(runs["dp"]) == {("all_reduce", grads["ranks"], grads["bytes"] + LOSS_SCALAR): 1}


def test_fsdp_gathers_each_parameter_once_and_all_reduces_the_gradients(runs):
    dtlib = strategy_volumes(CFG, DTLIB["fsdp"], precision="fp32")
    params = dtlib["dp_param_gather"]["bytes"]
    calls = runs["fsdp"].settings["hlo_collectives"]
    gathers = [c for c in calls if c["op"] == "all_gather"]
    assert {c["group_size"] for c in calls} == {8}
    # dtlib (ZeRO-3) gathers the parameters twice, in forward and again in backward, and
    # reduce-scatters the gradients. XLA gathers each matrix once and keeps it until backward;
    # only the 5 norm weights (128 bytes each) are gathered again
    norms = 2 * MODEL["layers"] + 1
    assert dtlib["dp_param_gather"]["calls"] == 2
    assert sum(c["bytes"] for c in gathers) == params + norms * MODEL["hidden"] * FP32
    norm_gathers = [c for c in gathers if c["bytes"] == MODEL["hidden"] * FP32]
    assert Counter(c["backward"] for c in norm_gathers) == {False: norms, True: norms}
    # the CPU backend writes the reduce-scatter as a full all-reduce, each device keeping its slice
    assert "reduce_scatter" in {v["collective"] for v in dtlib.values()}
    assert "reduce_scatter" not in runs["fsdp"].collectives[0]
    assert [c for c in calls if c["op"] == "all_reduce"] == [
        {"op": "all_reduce", "group_size": 8, "bytes": params + LOSS_SCALAR, "backward": True}]


def test_dp_tp_has_megatrons_activation_all_reduces_and_a_gradient_all_reduce_over_data(runs):
    dtlib = strategy_volumes(CFG, DTLIB["dp_tp"], precision="fp32")
    tp, grads = dtlib["tp_activations"], dtlib["dp_grad_all_reduce"]
    assert tp["calls"] == 4 * MODEL["layers"]  # 2 forward + 2 backward per block (lesson 05)
    # each an all-reduce of one replica's (2, seq, hidden) activations over a model pair, half of
    # them in backward
    activations = [c for c in runs["dp_tp"].settings["hlo_collectives"] if c["group_size"] == tp["ranks"]]
    assert Counter(c["backward"] for c in activations) == {False: tp["calls"] / 2, True: tp["calls"] / 2}
    assert _calls(runs["dp_tp"]) == {
        ("all_reduce", tp["ranks"], tp["bytes"]): tp["calls"],
        ("all_reduce", grads["ranks"], grads["bytes"] + EMBED_AND_HEAD / 2 + LOSS_SCALAR): 1}


def test_fsdp_tp_keeps_the_tp_all_reduces_and_reduces_gradients_over_fsdp(runs):
    dtlib = strategy_volumes(CFG, DTLIB["fsdp_tp"], precision="fp32")
    tp = dtlib["tp_activations"]
    calls = _calls(runs["fsdp_tp"])
    # the 8 of the blocks, and one more: the embedding lookup of an fsdp-sharded table
    assert calls[("all_reduce", tp["ranks"], tp["bytes"])] == tp["calls"] + 1
    gradient = [key for key in calls if key[0] == "all_reduce" and key[1] == 4]
    assert len(gradient) == 1 and calls[gradient[0]] == 1
    assert runs["fsdp_tp"].collectives[0]["all_gather"] > 0
    assert "reduce_scatter" not in runs["fsdp_tp"].collectives[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_device_holds_the_parameters_dtlib_predicts(runs, name):
    layout = DTLIB[name]
    predicted = memory_per_gpu(CFG, layout, precision="fp32").parameters
    if layout.tp > 1:  # embed and head whole over `model` here, split over the vocab in Megatron
        predicted += EMBED_AND_HEAD / layout.tp / (layout.dp if layout.zero == 3 else 1)
    assert [m["parameters"] for m in runs[name].memory] == [predicted] * 8


def test_fsdp_keeps_one_eighth_of_the_parameters_per_device(runs):
    full = runs["reference"].memory[0]["parameters"]
    assert full == sum(a.nbytes for a in runs["reference"].params.values())
    assert [m["parameters"] * 8 for m in runs["fsdp"].memory] == [full] * 8


def test_run_jax_with_the_default_batch_spec_is_tensor_parallel_alone(runs):
    run = run_jax({"model": 2}, LAYOUTS["dp_tp"]["specs"], steps=3, timeout=60.0)
    assert run.settings["batch"] == [None, None]  # no data axis: every device sees the whole batch
    diff = compare(run, runs["reference"])
    assert diff["max_loss_diff"] <= LOSS_TOL and diff["max_param_diff"] <= PARAM_TOL, diff
    # the 8 activation all-reduces of the blocks, no gradient all-reduce
    assert run.collectives == [{"all_reduce": 4 * MODEL["layers"]}] * 2


def test_shard_map_grad_then_pmean_is_n_times_the_mean_and_the_fixes_are_not():
    got = shard_map_pitfall(devices=8, timeout=60.0)
    # float32 sums of 32 squared-error terms in another order: relative 1e-5 is ~100 ulps
    np.testing.assert_allclose(got["naive"], 8 * got["reference"], rtol=1e-5)
    assert got["ratio"] == pytest.approx(8.0, rel=1e-5)
    assert len(got["fixes"]) == 3
    for name, grad in got["fixes"].items():
        np.testing.assert_allclose(grad, got["reference"], rtol=1e-5, err_msg=name)


MEGATRON = LAYOUTS["dp_tp"]["specs"]


@pytest.mark.parametrize("mesh, specs, batch, message", [
    ({"data": 8}, {"mlp.gate": [None, None]}, None, "unknown role 'mlp.gate'; valid roles: embed"),
    ({"data": 8}, {"mlp.up": [None, "model"]}, None, r"specs\['mlp.up'\]: unknown axis 'model' on dim ffn"),
    ({"tensor": 2}, {}, None, "mesh: unknown axis 'tensor'; valid axes: data, fsdp, model"),
    ({"data": 4, "model": 4}, MEGATRON, None, "needs 16 devices; at most 8"),
    ({"data": 0}, {}, None, r"mesh\['data'\] must be an integer >= 1, got 0"),
    ({"data": 2, "model": 3}, MEGATRON, None, r"specs\['attn.out'\]: dim hidden of size 32 is not divisible by 3"),
    ({"fsdp": 2, "model": 2}, {"mlp.up": ["fsdp", "fsdp"]}, None, "axis 'fsdp' is used twice"),
    ({"fsdp": 2, "model": 2}, {"mlp.up": [["fsdp", "model"], "model"]}, None, "axis 'model' is used twice"),
    ({"data": 2}, {"norm": [None, None]}, None, r"specs\['norm'\] must be a list with one entry per dim \(hidden\)"),
    ({"data": 2}, {"norm": [3]}, None, "dim hidden must be None, an axis name or a list"),
    ({"data": 3}, {}, None, "batch_spec: dim global_batch of size 8 is not divisible by 3"),
    ({"data": 2}, {}, [None, "data"], "batch_spec: dim seq\\+1 of size 17 is not divisible by 2"),
])
def test_bad_layouts_are_refused_before_any_process_starts(mesh, specs, batch, message):
    with pytest.raises(ValueError, match=message):
        run_jax(mesh, specs, batch)


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, "steps must be an integer >= 1, got 0"),
    ({"seed": -1}, "seed must be an integer >= 0, got -1"),
    ({"timeout": float("inf")}, "timeout must be a finite number > 0, got inf"),
])
def test_bad_run_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_jax({"data": 2}, {}, **kwargs)


def test_a_run_past_its_timeout_is_stopped_with_a_clear_error():
    with pytest.raises(RuntimeError, match="did not finish within timeout=0.2 s"):
        run_jax({"data": 2}, {}, timeout=0.2)  # subprocess.run kills the child: nothing left running


def test_the_default_batch_spec_splits_over_data_and_fsdp_axes():
    assert validate_layout({"data": 2, "model": 2}, {}) == ["data", None]
    assert validate_layout({"data": 2, "fsdp": 2, "model": 2}, {}) == [["data", "fsdp"], None]
    assert validate_layout({"model": 2}, {}) == [None, None]


def test_unknown_layouts_and_device_counts_are_refused():
    with pytest.raises(ValueError, match="unknown layout"):
        run_layouts(("dp", "zero2"))
    with pytest.raises(ValueError, match="devices must be an integer from 2 to 8"):
        shard_map_pitfall(devices=16)


HLO = """
HloModule jit_step, entry_computation_layout={(f32[8,4]{1,0})->f32[]}
  %all-reduce.16 = (f32[64,32]{1,0}, f32[32]{0}, /*index=2*/f32[]) all-reduce(%a, %b, %c), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %all-reduce.1 = f32[2,16,32]{2,1,0} all-reduce(%bitcast.15), channel_id=16, replica_groups=[4,2]<=[8], to_apply=%add.2.clone, metadata={op_name="jit(step)/transpose(jvp())/dot_general" stack_frame_id=30}
  %all-gather.2 = f32[32,96]{1,0} all-gather(%param.3), channel_id=6, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}, metadata={op_name="jit(step)/jvp()/dot_general"}
  %reduce-scatter = bf16[4,32]{1,0} reduce-scatter(%x), channel_id=2, replica_groups={{0,1},{2,3}}, dimensions={0}, to_apply=%add
  %all-to-all = f32[8,8]{1,0} all-to-all(%y), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %collective-permute = f32[16,32]{1,0} collective-permute(%param), channel_id=9, source_target_pairs={{0,1},{1,0}}
  %all-gather-start = (f32[4]{0}, f32[8]{0}) all-gather-start(%p), channel_id=5, replica_groups={{0,1}}, dimensions={0}
  %all-gather-done = f32[8]{0} all-gather-done(%all-gather-start)
  %fusion = f32[8]{0} fusion(%all-reduce.1, %all-gather.2), kind=kLoop, calls=%fused_all-reduce_computation
  ROOT %tuple = (f32[]) tuple(%all-reduce.16)
"""


def test_hlo_collectives_counts_each_call_once_in_torch_spelling():
    assert hlo_collectives(HLO) == {"all_reduce": 2, "all_gather": 2, "reduce_scatter": 1, "all_to_all": 1,
                                    "send": 1}
    assert hlo_collectives("%add = f32[] add(%x, %y)") == {}


def test_hlo_collective_calls_read_group_sizes_and_bytes_in_every_spelling():
    calls = hlo_collective_calls(HLO)
    assert [c["backward"] for c in calls] == [False, True, False, False, False, False, False]
    assert [(c["op"], c["group_size"], c["bytes"]) for c in calls] == [
        ("all_reduce", 8, (64 * 32 + 32 + 1) * 4),  # combined tuple, iota groups
        ("all_reduce", 2, 2 * 16 * 32 * 4),
        ("all_gather", 4, 32 * 96 * 4),  # mesh form: the group spans axis_0
        ("reduce_scatter", 2, 4 * 32 * 2),  # explicit groups, bf16
        ("all_to_all", 8, 8 * 8 * 4),
        ("send", None, 16 * 32 * 4),  # source_target_pairs: no replica groups
        ("all_gather", 2, (4 + 8) * 4),  # an async start's tuple holds input and output
    ]
