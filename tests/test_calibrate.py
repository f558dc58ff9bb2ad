"""``dtlib calibrate`` and ``dtlib plan --calibration``: the measured device and link, the profile,
the planner answering from it, and bad input (one line on stderr, exit 2)."""
import dataclasses
import json
import re

import numpy as np
import pytest

from dtlib.analytic.comm import collective_time, nccl_time
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.measured import MeasuredAccelerator, MeasuredLink
from dtlib.cli import main
from dtlib.plan.gemm import gemm_time
from dtlib.analytic.hardware import KERNEL_LAUNCH_S
from dtlib.plan.measured import (FORMAT, attention_efficiency, calibrated_cluster, counted_forward_kernels,
                                 counted_zero3_kernels, load_profile, memory_bound_bandwidth, profile_sources)
from dtlib.plan.steptime import StepOptions, step_time
from dtlib.trainer import TrainConfig

MODEL = TrainConfig(layers=2, hidden=64, heads=4, seq=32).model_config()
OPTIONS = StepOptions(precision="fp32", flash_attention=False, fused_elementwise=False, dp_overlap=0.0,
                      tp_overlap=0.0)
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "p2p")


def _accelerator(rows=((64, 64, 64, 1, 1e-4), (128, 128, 128, 1, 4e-4))):
    return MeasuredAccelerator("cpu", {"bf16": 1e10, "fp32": 1e10}, 2 ** 30, 1e9, "test", gemms=rows)


def _profile(gflops=10.0, busbw=1e9):
    """A profile as dtlib calibrate writes it, with chosen figures: every GEMM at ``gflops``, every
    collective at ``busbw`` (time = S x factor / busbw: the latency left out)."""
    from dtlib.plan.calibrate import planned_gemm_shapes

    gemm = [{"m": m, "n": n, "k": k, "batch": b, "seconds": 2 * m * n * k * b / (gflops * 1e9),
             "flops_per_s": gflops * 1e9} for m, n, k, b in planned_gemm_shapes(MODEL, (1, 2), (1, 2, 4), OPTIONS)]
    rows = [{"op": op, "bytes": s, "seconds": 1.0, "algbw_bytes_per_s": 1.0, "busbw_bytes_per_s": busbw}
            for op in OPS for s in (1024, 2 ** 20)]
    return {"format": FORMAT, "date": "2026-11-29T10:00:00+00:00", "dtype": "fp32", "clock": "cpu",
            "versions": {"torch": "2.13", "dtlib": "0.1.0", "python": "3.11"},
            "machine": {"hostname": "box", "cpu": "test CPU", "cpu_cores": 2, "gpu": None, "gpu_count": 0,
                        "device": "cpu", "ranks": 2, "nodes": 1, "ranks_per_node": 2, "threads_per_rank": 1,
                        "memory_bytes_per_rank": 2 ** 32},
            "gemm": gemm, "attention": {"micro_batch_size": 2, "heads": 4, "seq": 32, "head_dim": 16,
                                        "causal": True, "seconds": 1e-3},
            "elementwise": {"bytes": 3 * 2 ** 20, "seconds": 1e-3, "bytes_per_s": 3 * 2 ** 20 / 1e-3},
            "intra": {"ranks": 2, "groups": 1, "rows": rows}, "inter": None, "step": None}


def test_measured_gemms_are_exact_where_measured_and_interpolated_between():
    acc = _accelerator()
    assert acc.gemm_seconds(64, 64, 64) == pytest.approx(1e-4)
    assert acc.gemm_seconds(128, 128, 128) == pytest.approx(4e-4)
    # the two shapes run at 5.2 and 10.5 GFLOP/s: a shape between them runs between them
    rate = 2 * 96 ** 3 / acc.gemm_seconds(96, 96, 96)
    assert 2 * 64 ** 3 / 1e-4 < rate < 2 * 128 ** 3 / 4e-4
    assert acc.gemm_seconds(0, 64, 64) == 0.0
    # gemm_time answers from the measurement on a measured device, batched GEMMs included
    assert gemm_time(np.array([64, 128]), 64, 64, acc, batch=3) == pytest.approx(acc.gemm_seconds([64, 128], 64, 64, 3))
    with pytest.raises(ValueError, match="at least one timed GEMM"):
        MeasuredAccelerator("cpu", {"bf16": 1.0}, 1, 1.0, "test")


def test_measured_link_times_from_busbw_with_the_collectives_factor():
    link = MeasuredLink("m", 1e9, 1e-5, "test", busbw=(("all_reduce", 1024, 1e7), ("all_reduce", 2 ** 20, 1e9),
                                                          ("p2p", 1024, 1e8), ("p2p", 2 ** 20, 2e9)))
    # at a measured size: S x 2(n-1)/n / busbw; another rank count keeps the busbw, not the time
    assert link.seconds("all_reduce", 2 ** 20, 2) == pytest.approx(2 ** 20 * 1.0 / 1e9)
    assert link.seconds("all_reduce", 2 ** 20, 4) == pytest.approx(2 ** 20 * 1.5 / 1e9)
    assert link.seconds("all_reduce", 2 ** 20, 1) == 0.0 and link.seconds("p2p", 1024, 2) == pytest.approx(1024 / 1e8)
    # below the smallest size: the smallest size's time (the latency floor)
    assert link.seconds("all_reduce", 16, 2) == pytest.approx(link.seconds("all_reduce", 1024, 2))
    sizes = np.array([2 ** 12, 2 ** 14, 2 ** 16, 2 ** 18])
    assert np.all(np.diff(link.seconds("all_reduce", sizes, 2)) > 0)
    assert collective_time("all_reduce", 2 ** 20, 2, link) == link.seconds("all_reduce", 2 ** 20, 2)
    nccl = nccl_time("all_reduce", 2 ** 21, 2, 2, link, link, calls=2)
    assert nccl["best"] == pytest.approx(2 * link.seconds("all_reduce", 2 ** 20, 2))
    with pytest.raises(ValueError, match="no broadcast measured"):
        link.seconds("broadcast", 1024, 2)


def test_a_smaller_message_never_takes_longer_than_a_larger_one():
    # a spike at 4 KiB (a loaded machine): capped at the 16 KiB time
    link = MeasuredLink("m", 1e9, 0.0, "test", busbw=(("all_gather", 4096, 1e5), ("all_gather", 16384, 1e8)))
    assert link.seconds("all_gather", 4096, 2) == pytest.approx(link.seconds("all_gather", 16384, 2))


def test_the_planner_asks_for_the_shapes_calibrate_times():
    from dtlib.plan.calibrate import planned_gemm_shapes

    shapes = planned_gemm_shapes(MODEL, (1, 2), (2,), OPTIONS)
    tokens, h, vocab = 2 * 32, 64, MODEL.vocab
    assert (tokens, 3 * h, h, 1) in shapes and (tokens, 3 * h // 2, h, 1) in shapes  # QKV, whole and split
    assert (tokens, vocab, h, 1) in shapes and (h, vocab, tokens, 1) in shapes  # the head and its dW
    assert (32, 32, 16, 2 * 4) in shapes  # explicit attention's scores: one s x s GEMM per head
    # with FlashAttention-style attention (a preset's plan) attention is no GEMM the planner asks for
    assert all(b == 1 for *_, b in planned_gemm_shapes(MODEL, (1,), (2,), StepOptions(flash_attention=True)))
    # timed on the profile's figures, the plan's compute is the GEMMs' FLOPs at that rate
    cl = calibrated_cluster(_profile(gflops=10.0))
    t = step_time(MODEL, Parallelism(dp=2, micro_batch_size=2), cl, options=OPTIONS)
    assert t.breakdown["compute"] == pytest.approx(t.hardware_flops / 2 / 10e9, rel=0.05)


def test_the_profile_is_the_cluster_and_says_where_it_came_from(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile()))
    profile = load_profile(str(path))
    cl = calibrated_cluster(profile)
    assert cl.gpu.name == "cpu" and cl.gpus_per_node == 2 and cl.nodes == 1 and "box" in cl.gpu.source
    assert 0 < attention_efficiency(profile) <= 1
    with pytest.raises(ValueError, match="no figures across nodes"):
        calibrated_cluster(profile, nodes=2)


@pytest.mark.parametrize("text, message", [
    ("not json", "not JSON"), ('{"format": "other"}', "not a dtlib-calibration/1 profile"),
    ('{"format": "dtlib-calibration/1", "machine": {"x": 1}}', "no 'versions' section")])
def test_a_bad_profile_is_one_line(tmp_path, text, message):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_profile(str(path))


@pytest.mark.parametrize("section, index, key, value, message", [
    # each of these gave a plan of NaN or a ZeroDivisionError traceback
    ("gemm", 0, "flops_per_s", float("nan"), "gemm[0].flops_per_s must be a finite number > 0, got nan"),
    ("attention", None, "heads", 0, "attention.heads must be an integer >= 1, got 0"),
    ("elementwise", None, "bytes_per_s", 0, "elementwise.bytes_per_s must be a finite number > 0, got 0"),
    ("intra", 1, "busbw_bytes_per_s", 0, "intra.rows[1].busbw_bytes_per_s must be a finite number > 0, got 0"),
    ("step", None, "layer_forward_kernels", float("nan"), "step.layer_forward_kernels must be an integer >= 0"),
    ("inter", None, None, float("nan"), "a figure is missing or malformed"),  # was AttributeError
])
def test_a_damaged_figure_is_named(tmp_path, section, index, key, value, message):
    profile = _profile()
    profile["step"] = {"micro_batch_size": 2, "forward_backward_seconds": 1e-2, "optimizer_seconds": 1e-3,
                       "layer_forward_kernels": 30}
    if key is None:
        profile[section] = value
    else:
        where = profile[section] if index is None else (profile[section]["rows"] if section == "intra"
                                                        else profile[section])[index]
        where[key] = value
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(ValueError, match=re.escape(f"--calibration {path}: {message}")):
        load_profile(str(path))


PLAN = ["plan", "--gpus", "2", "--global-batch", "8", "--layers", "2", "--hidden", "64", "--heads", "4",
        "--vocab", "256", "--seq", "32", "--convention", "fp32", "--no-flash-attention", "--no-fused-elementwise",
        "--dp-overlap", "0", "--tp-overlap", "0"]


def test_plan_with_a_calibration_uses_it_and_says_so(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile(gflops=10.0, busbw=1e9)))
    assert main(PLAN + ["--calibration", str(path), "--dp", "2", "--micro-batch", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gpu"] == "cpu" and d["calibration"]["file"] == str(path)
    assert set(d["calibration"]["sources"]) >= {"gemm", "attention", "elementwise", "collectives"}
    slower = tmp_path / "slow.json"
    slower.write_text(json.dumps(_profile(gflops=5.0, busbw=1e8)))
    assert main(PLAN + ["--calibration", str(slower), "--dp", "2", "--micro-batch", "2", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    fast, slow = d["configs"][0]["breakdown"], s["configs"][0]["breakdown"]
    assert slow["compute"] == pytest.approx(2 * fast["compute"], rel=1e-6)  # half the GEMM rate
    assert slow["dp_comm"] == pytest.approx(10 * fast["dp_comm"], rel=1e-6)  # a tenth of the busbw


def test_plan_times_dtlib_trains_model_as_the_api_does(tmp_path, capsys):
    # the plan's --layers/--hidden/--heads/--vocab/--seq shape is dtlib train's TinyGPT exactly
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile()))
    pins = ["--dp", "2", "--tp", "1", "--pp", "1", "--cp", "1", "--micro-batch", "2", "--zero", "1",
            "--recompute", "none", "--no-sequence-parallel"]
    assert main(PLAN + ["--calibration", str(path), "--json"] + pins) == 0
    c = json.loads(capsys.readouterr().out)["configs"]
    assert len(c) == 1 and c[0]["microbatches"] == 2
    api = step_time(MODEL, Parallelism(dp=2, zero=1, micro_batch_size=2, num_microbatches=2),
                    calibrated_cluster(load_profile(str(path))), options=OPTIONS)
    assert c[0]["step_time_s"] == pytest.approx(api.step_time, rel=1e-9)


def test_plan_uses_the_measured_kernel_cost_and_count_and_the_trainers_gradients(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_with_step(_profile(), per_kernel=2e-5)))
    pins = ["--dp", "2", "--tp", "1", "--pp", "1", "--cp", "1", "--micro-batch", "1", "--zero", "3",
            "--recompute", "none", "--no-sequence-parallel", "--calibration", str(path)]
    trainer = ["--no-grad-accumulation-fusion", "--grad-bucket-copy", "--zero3-reduce-per-microbatch",
               "--zero3-unit-copies"]
    assert main(PLAN + pins + trainer) == 0
    assert "kernel launch: measured 20 us per kernel, 56 kernels per layer forward counted on the model" in \
        capsys.readouterr().out
    assert main(PLAN + pins + trainer + ["--json"]) == 0
    c = json.loads(capsys.readouterr().out)["configs"][0]
    options = dataclasses.replace(OPTIONS, forward_kernels=56, grad_accumulation_fusion=False, grad_bucket_copy=True,
                                  zero3_reduce_per_microbatch=True, zero3_unit_copies=True, zero3_kernels=214)
    zero3 = Parallelism(dp=2, zero=3, micro_batch_size=1, num_microbatches=4)
    api = step_time(MODEL, zero3, calibrated_cluster(load_profile(str(path))), options=options)
    assert c["step_time_s"] == pytest.approx(api.step_time, rel=1e-9)
    uncopied = step_time(MODEL, zero3, calibrated_cluster(load_profile(str(path))),
                         options=dataclasses.replace(options, zero3_unit_copies=False))
    assert api.breakdown["dp_comm"] > uncopied.breakdown["dp_comm"]  # the flag reached the plan
    # the layers' own operators, and those dtlib.parallel.FSDP adds to each, counted by calibrate
    assert c["breakdown"]["launch"] == pytest.approx(MODEL.layers * 4 * (3 * 56 + 214) * 2e-5, rel=1e-9)


@pytest.mark.parametrize("extra, message", [
    (["--gpu", "h100-sxm"], "--gpu contradicts --calibration"),
    (["--gemm-efficiency", "0.5"], "--gemm-efficiency contradicts --calibration"),
    (["--gpus", "4"], "no figures across nodes")])
def test_plan_refuses_what_contradicts_the_profile(tmp_path, capsys, extra, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile()))
    assert main(PLAN + ["--calibration", str(path)] + extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_plan_names_a_missing_profile(capsys):
    assert main(PLAN + ["--calibration", "/nonexistent/p.json"]) == 2
    err = capsys.readouterr().err
    assert "--calibration /nonexistent/p.json: cannot read it" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3"], "--tp 3 does not divide the model's 4 heads"),
    (["--repeats", "2"], "--repeats must be an integer >= 3"),
    (["--model", "llama3-8b", "--layers", "2"], "drop --layers"),
    (["--micro-batch", "0"], "--micro-batch must be an integer >= 1"),
    (["--clock", "sundial"], "--clock: invalid choice"),
    (["--statistic", "max"], "--statistic: invalid choice"),
    (["--factor", "1"], "--factor must be an integer >= 2")])
def test_calibrate_bad_flags_are_one_line(tmp_path, capsys, argv, message):
    assert main(["calibrate", "-o", str(tmp_path / "p.json")] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_calibrate_refuses_an_output_it_cannot_write_and_creates_nothing(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("")
    for bad, message in ((tmp_path / "file" / "p.json", f"cannot create it, {tmp_path / 'file'} is a file"),
                         (tmp_path, f"--output {tmp_path} is a directory")):
        assert main(["calibrate", "-o", str(bad)]) == 2
        assert message in capsys.readouterr().err
    # a run that fails after the path was checked leaves no empty profile behind (plan --calibration
    # would call it "not JSON"); the profile is written whole, in folders made for it
    import dtlib.plan.calibrate

    def failed(*args, **kwargs):
        raise ValueError("rank 1 exited with code 1")

    monkeypatch.setattr(dtlib.plan.calibrate, "calibrate", failed)
    assert main(["calibrate", "-o", str(tmp_path / "p.json")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    monkeypatch.setattr(dtlib.plan.calibrate, "calibrate", lambda *args, **kwargs: {"machine": "scripted"})
    monkeypatch.setattr("dtlib.cli.calibrate.calibration_text", lambda profile, path: "written")
    assert main(["calibrate", "-o", str(tmp_path / "new" / "p.json")]) == 0
    assert json.loads((tmp_path / "new" / "p.json").read_text()) == {"machine": "scripted"}
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["p.json"]  # no partial file left


def test_calibrate_measures_two_gloo_ranks(tmp_path, capsys):
    path = tmp_path / "p.json"
    code = main(["calibrate", "--nproc", "2", "--micro-batch", "1", "--max-bytes", "4096", "--repeats", "3",
                 "--statistic", "min", "-o", str(path)])
    out = capsys.readouterr().out
    assert code == 0 and "profile written to" in out and "cpu clock, min of 3" in out
    assert "kernel cost: " in out and " operators per layer forward" in out
    profile = load_profile(str(path))
    m = profile["machine"]
    assert m["ranks"] == 2 and m["nodes"] == 1 and m["cpu_cores"] >= 1 and profile["clock"] == "cpu"
    assert profile["statistic"] == "min"
    assert profile["units"]["seconds"] == "s (cpu clock), min of repeats of the slowest rank"
    assert profile["versions"]["torch"] and profile["date"].endswith("+00:00")
    # the shapes timed are the planner's own, every figure positive and finite
    from dtlib.plan.calibrate import planned_gemm_shapes
    assert [(r["m"], r["n"], r["k"], r["batch"]) for r in profile["gemm"]] == planned_gemm_shapes(
        TrainConfig().model_config(), (1, 2), (1,), StepOptions(flash_attention=False))
    rows = profile["intra"]["rows"]
    assert {r["op"] for r in rows} == set(OPS)
    for r in rows:  # nccl-tests: busbw = algbw x the collective's factor
        factor = {"all_reduce": 1.0, "broadcast": 1.0, "p2p": 1.0}.get(r["op"], 0.5)
        assert r["busbw_bytes_per_s"] == pytest.approx(r["algbw_bytes_per_s"] * factor)
        assert r["algbw_bytes_per_s"] == pytest.approx(r["bytes"] / r["seconds"]) and r["seconds"] > 0
    assert all(np.isfinite(r["flops_per_s"]) and r["flops_per_s"] > 0 for r in profile["gemm"])
    step = profile["step"]
    assert step["seconds"] == pytest.approx(step["forward_backward_seconds"] + step["optimizer_seconds"])
    assert step["planned_elementwise_bytes"] > 0 and step["planned_optimizer_bytes"] > 0
    # the operators of one TinyGPT layer, counted: the planner's kernels per layer for this model
    assert step["layer_forward_kernels"] > 0 and step["layer_backward_kernels"] > step["layer_forward_kernels"]
    # and those dtlib.parallel.FSDP adds to a layer under ZeRO-3 (gathers' copy-out and views, gradient copies)
    assert step["zero3_layer_kernels"] > 0 and "more per layer and micro-batch under ZeRO-3" in out
    kernel = profile["kernel"]
    assert kernel["seconds_per_kernel"] == pytest.approx(kernel["seconds"] / kernel["operators"])
    assert kernel["seconds_per_kernel"] > 0
    assert calibrated_cluster(profile).gpu.kernel_launch_s == kernel["seconds_per_kernel"]


def test_calibrate_measures_across_nodes_when_there_are_several():
    # 4 gloo ranks as 2 nodes of 2: the collectives within each node and across them (one rank per node)
    from dtlib.plan.calibrate import calibrate

    profile = calibrate(MODEL, 4, tp=(1,), micro_batch=(1,), max_bytes=4096, repeats=3, ranks_per_node=2)
    assert profile["machine"]["nodes"] == 2 and profile["intra"]["ranks"] == 2 and profile["inter"]["ranks"] == 2
    assert {r["op"] for r in profile["inter"]["rows"]} == set(OPS)
    cl = calibrated_cluster(profile)
    assert cl.nodes == 2 and cl.gpus_per_node == 2 and isinstance(cl.inter, MeasuredLink)
    t = step_time(MODEL, Parallelism(dp=4, micro_batch_size=1, num_microbatches=2), cl, options=OPTIONS)
    assert 0 < t.breakdown["dp_comm"] < t.step_time and np.isfinite(t.step_time)


def test_one_rank_per_node_plans_one_rank():
    # one GPU: nothing to measure between ranks, and a one-rank plan needs nothing
    profile = _profile()
    profile["machine"].update(ranks=1, ranks_per_node=1)
    profile["intra"] = {"ranks": 1, "groups": 1, "rows": []}
    cl = calibrated_cluster(profile)
    t = step_time(MODEL, Parallelism(micro_batch_size=2), cl, options=OPTIONS)
    assert t.breakdown["dp_comm"] == 0 and t.step_time > 0 and cl.intra.seconds("p2p", 1024, 2) == 0
    with pytest.raises(ValueError, match="no figures across nodes"):
        calibrated_cluster(profile, nodes=2, gpus_per_node=1)


def _with_step(profile, forward_backward=0.05, optimizer=0.01, per_kernel=1e-5, kernels=56, zero3_kernels=214):
    """``profile`` with a measured one-rank step (at micro-batch 2) and kernel cost, as calibrate adds them."""
    profile["model_config"] = dataclasses.asdict(MODEL)
    profile["kernel"] = {"operators": 66, "seconds": 66 * per_kernel, "seconds_per_kernel": per_kernel}
    step = {"micro_batch_size": 2, "forward_backward_seconds": forward_backward, "optimizer_seconds": optimizer,
            "seconds": forward_backward + optimizer, "layer_forward_kernels": kernels, "layer_backward_kernels": 96,
            "zero3_layer_kernels": zero3_kernels}
    step.update(memory_bound_bandwidth(MODEL, OPTIONS, step, profile["gemm"], per_kernel))
    profile["step"] = step
    return profile


def test_the_measured_step_is_what_the_plan_of_that_step_gives_back():
    # the bandwidths are the ones at which the planner's own one-rank step takes the measured times
    profile = _with_step(_profile())
    cl = calibrated_cluster(profile, 1, 1)
    assert cl.gpu.memory_bandwidth == profile["step"]["bytes_per_s"]
    assert cl.gpu.optimizer_bandwidth == profile["step"]["optimizer_bytes_per_s"] != cl.gpu.memory_bandwidth
    options = dataclasses.replace(OPTIONS, forward_kernels=counted_forward_kernels(profile, MODEL))
    t = step_time(MODEL, Parallelism(micro_batch_size=2), cl, options=options).breakdown
    assert t["compute"] + t["elementwise"] + t["launch"] == pytest.approx(0.05, rel=1e-9)
    assert t["optimizer"] == pytest.approx(0.01, rel=1e-9)
    # the launch term: layers x micro-batches x (forward + 2 x forward backward) x the measured cost
    assert t["launch"] == pytest.approx(MODEL.layers * 3 * 56 * 1e-5, rel=1e-12)
    # GEMMs and kernel costs taking the whole forward + backward: no bandwidth to tell, the add figure
    fast = _with_step(_profile(), forward_backward=1e-6)
    assert fast["step"]["bytes_per_s"] is None
    assert calibrated_cluster(fast).gpu.memory_bandwidth == fast["elementwise"]["bytes_per_s"]


def test_a_profile_without_a_kernel_cost_keeps_the_catalogues():
    cl = calibrated_cluster(_profile())
    assert cl.gpu.kernel_launch_s == KERNEL_LAUNCH_S
    assert "3 us per kernel (not in this profile)" in profile_sources(_profile(), "p.json")["kernel launch"]
    measured = profile_sources(_with_step(_profile(), per_kernel=2.5e-5), "p.json")["kernel launch"]
    assert measured.startswith("measured 25 us per kernel, 56 kernels per layer forward counted on the model, "
                               "214 operators per layer under ZeRO-3 (dtlib.parallel.FSDP)")


def test_counted_kernels_are_the_profiles_models_only():
    profile = _with_step(_profile())
    assert counted_forward_kernels(profile) == 56
    assert counted_forward_kernels(profile, MODEL.with_(layers=8, hidden=128)) == 56  # sizes do not change the count
    assert counted_forward_kernels(profile, MODEL.with_(norm="rmsnorm")) is None
    assert counted_forward_kernels(profile, MODEL.with_(kv_heads=2)) is None
    assert counted_forward_kernels(_profile(), MODEL) is None  # not measured
    assert counted_zero3_kernels(profile, MODEL.with_(layers=8)) == 214
    assert counted_zero3_kernels(profile, MODEL.with_(norm="rmsnorm")) is None
    assert counted_zero3_kernels(_with_step(_profile(), zero3_kernels=None), MODEL) is None  # one rank: not counted


def test_kernel_cost_counts_the_operators_it_times():
    import torch

    from dtlib.plan.calibrate import CHAIN, _kernel_cost
    kernel = _kernel_cost(3, torch.device("cpu"), "cpu")
    assert kernel["operators"] >= 2 * CHAIN  # each multiplication forward and its backward
    assert kernel["seconds_per_kernel"] == pytest.approx(kernel["seconds"] / kernel["operators"])
    assert kernel["seconds_per_kernel"] > 0


def _zero3_counts(rank, world_size, shapes):
    from dtlib.plan.calibrate import _zero3_layer_kernels

    return [_zero3_layer_kernels(TrainConfig(layers=1, heads=4, **shape).model_config(), b) for shape, b in shapes]


def test_the_operators_fsdp_adds_to_a_layer_do_not_depend_on_its_sizes():
    # the planner applies the count to the profile's architecture at any size (counted_zero3_kernels):
    # FSDP's bookkeeping is per parameter, not per element
    import dtlib

    shapes = [(dict(hidden=64, seq=32), 1), (dict(hidden=128, seq=16), 3)]
    counts = dtlib.launch(_zero3_counts, 2, args=(shapes,), timeout=60, output="none")[0]
    assert counts[0] == counts[1] > 0


def test_a_spell_of_interference_does_not_become_one_sizes_figure(monkeypatch):
    """calibrate's collectives take their sizes in rounds (dtlib.plan.calibrate._summaries): a spell
    that slows 20 consecutive calls of 50 costs each of two sizes a few of its 25 calls, and both
    medians stay the true costs; timed one size after the other, the spell would have been the
    first size's median (on this 2-core machine a 256 KiB all-reduce measured 0.4 ms one minute and
    2.5 ms the next, docs/plan.md)."""
    import torch
    from dtlib.plan import calibrate as cal

    clock = {"now": 0.0, "calls": 0}

    def call(cost):
        def fn():
            clock["calls"] += 1
            slow = 5 <= clock["calls"] < 25  # the spell, counted from the warm-ups on
            clock["now"] += cost * (10 if slow else 1)
        return fn

    monkeypatch.setitem(cal.CLOCKS, "fake", lambda: clock["now"])
    cpu = torch.device("cpu")
    assert cal._summaries([call(1e-3), call(4e-3)], 25, cpu, "fake") == pytest.approx([1e-3, 4e-3])
    clock.update(now=0.0, calls=0)
    one_after_the_other = [cal._summary(call(1e-3), 25, cpu, "fake"), cal._summary(call(4e-3), 25, cpu, "fake")]
    assert one_after_the_other[0] == pytest.approx(1e-2)  # what the interleaving avoids


def test_the_one_rank_step_and_the_gemms_it_is_compared_with_are_timed_in_the_same_rounds(monkeypatch):
    """The elementwise bandwidth is the one-rank step less the planner's GEMMs
    (dtlib.plan.measured.memory_bound_bandwidth): both come from one _summaries call, so that a spell of
    interference does not fall into one side of the difference (six profiles here: 7-11 ms left of a
    42-54 ms step; timed minutes apart it had been -3 to +11 ms, and <= 0 falls back to the add figure)."""
    from dtlib.plan import calibrate as cal

    calls = []
    real = cal._summaries

    def recording(fns, repeats, device, clock="wall", statistic="median"):
        calls.append(len(fns))
        return real(fns, repeats, device, clock, statistic)

    monkeypatch.setattr(cal, "_summaries", recording)
    shapes = [(16, 8, 4, 1), (8, 8, 8, 2)]
    step, rows = cal._one_rank_step(MODEL, 1, 3, "cpu", shapes)
    assert calls == [2 + len(shapes)]  # forward + backward, the optimizer step and every GEMM: one set of rounds
    assert [(r["m"], r["n"], r["k"], r["batch"]) for r in rows] == shapes
    assert all(r["seconds"] > 0 and r["flops_per_s"] == 2 * r["m"] * r["n"] * r["k"] * r["batch"] / r["seconds"]
               for r in rows)
    assert step["forward_backward_seconds"] > 0 and step["optimizer_seconds"] > 0
    assert step["layer_forward_kernels"] > 0


@pytest.mark.parametrize("statistic, expected", [("median", 3e-3), ("min", 1e-3), ("mean", 4e-3)])
def test_a_figure_is_the_statistic_it_names_of_its_repeats(monkeypatch, statistic, expected):
    """calibrate(..., statistic=): each figure is that statistic of its repeats' times (after the
    warm-up call, which is not counted), the default the median (dtlib.analytic.timing.STATISTICS)."""
    import torch
    from dtlib.plan import calibrate as cal

    durations = iter([0.5, 3e-3, 1e-3, 2e-3, 9e-3, 5e-3])  # the warm-up, then 5 timed calls
    clock = {"now": 0.0}

    def call():
        clock["now"] += next(durations)

    monkeypatch.setitem(cal.CLOCKS, "fake", lambda: clock["now"])
    args = (call, 5, torch.device("cpu"), "fake")
    figure = cal._summary(*args) if statistic == "median" else cal._summary(*args, statistic)
    assert figure == pytest.approx(expected)


def test_calibrate_names_a_bad_statistic_before_any_rank_starts(monkeypatch):
    import dtlib
    from dtlib.plan.calibrate import calibrate

    monkeypatch.setattr(dtlib, "launch", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(ValueError, match="statistic must be one of"):
        calibrate(MODEL, statistic="max")
