"""dtlib.profile: the breakdown of a hand-made trace, FLOPs against dtlib.analytic.flops, the
exported Chrome trace, the diagnosis rules, and the five injected faults found on real ranks."""
import json
import math

import pytest
import torch
import torch.utils.checkpoint
import torch.nn.functional as F

from dtlib.cli import main
from dtlib.analytic.flops import recompute_flops_per_token, step_flops
from dtlib.experiments.profiling import run_injected
from dtlib.models import TinyGPT, tiny_gpt_config
from dtlib.profile import (PARTS, Thresholds, count_flops, diagnose, parse_trace, phase,
                           profile_steps, read_dir, summarize)
from dtlib.profile.breakdown import _subtract, _union, step_intervals


def _x(name, ts, dur, tid=1, cat="user_annotation"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0, "cat": cat}


def _trace(events, wall=1e-3):
    meta = {"rank": 0, "steps": 1, "wall_seconds": [wall], "peak_flops": 1e9, "dtype": "fp32",
            "flops": {"model": 3e5, "hardware": 3e5}}
    return {"traceEvents": events, "dtlib": json.dumps(meta)}


def test_intervals():
    assert _union([(5, 7), (0, 2), (1, 3)]) == [(0, 3), (5, 7)]
    assert _subtract([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]


def test_breakdown_of_a_hand_made_step():
    """A 1000 us step: data 0-100, forward ops 100-300 with a 50 us gap, a collective on another
    thread 250-600 (250-300 and 450-600 overlapped by operators, 300-450 exposed),
    a recv wait 600-700 (bubble), optimizer 700-800, nothing 800-1000."""
    events = [_x("dtlib/step", 0, 1000), _x("dtlib/data", 0, 100), _x("aten::copy_", 10, 50, cat="cpu_op"),
              _x("dtlib/forward", 100, 200), _x("aten::mm", 100, 100, cat="cpu_op"),
              _x("aten::mm", 250, 50, cat="cpu_op"), _x("gloo:all_reduce", 250, 350, tid=2),
              _x("dtlib/backward", 300, 300), _x("aten::mm", 450, 150, cat="cpu_op"),
              _x("c10d::recv_", 600, 100, cat="cpu_op"), _x("dtlib/optimizer", 700, 100),
              _x("aten::add_", 700, 80, cat="cpu_op")]
    parts = parse_trace(_trace(events))["breakdown"]
    expected = {"data": 100, "compute": 300, "exposed_comm": 150, "bubble": 100, "optimizer": 100,
                "other": 250, "overlapped_comm": 200, "host_gaps": 50, "step": 1000}
    assert {k: round(v * 1e6) for k, v in parts.items()} == expected
    assert sum(parts[p] for p in PARTS) == pytest.approx(parts["step"])
    where = step_intervals(_trace(events))
    assert where["bubble"] == [(600e-6, 700e-6)] and where["exposed_comm"] == [(300e-6, 450e-6)]
    assert where["comm_in_flight"] == [(250e-6, 600e-6)]


def test_breakdown_on_a_gpu_reads_the_kernels():
    """With CUDA activity the device's kernels are the compute (host launches are not), and an
    NCCL kernel is communication: exposed where no compute kernel runs."""
    events = [_x("dtlib/step", 0, 1000), _x("aten::mm", 100, 10, cat="cpu_op"),
              _x("cudaDeviceSynchronize", 110, 800, cat="cuda_runtime"),
              _x("sm90_xmma_gemm", 100, 500, tid=7, cat="kernel"),
              _x("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 500, 300, tid=8, cat="kernel")]
    parts = parse_trace(_trace(events))["breakdown"]
    assert {k: round(parts[k] * 1e6) for k in ("compute", "exposed_comm", "overlapped_comm", "other")} \
        == {"compute": 500, "exposed_comm": 200, "overlapped_comm": 100, "other": 300}


def test_the_gpu_copy_of_the_step_range_is_not_a_step():
    """PyTorch draws each record_function range on the GPU stream too (first to last kernel):
    read as a second, shorter step it halved the step time of a real H200 trace (MFU 110%)."""
    events = [_x("dtlib/step", 0, 1000), _x("sm90_xmma_gemm", 100, 500, tid=7, cat="kernel"),
              _x("dtlib/step", 100, 500, tid=7, cat="gpu_user_annotation")]
    profile = parse_trace(_trace(events))
    assert len(profile["steps"]) == 1 and round(profile["breakdown"]["step"] * 1e6) == 1000


def test_trace_without_metadata_is_refused():
    with pytest.raises(ValueError, match="profile_steps"):
        parse_trace({"traceEvents": []})


@pytest.mark.parametrize("content, message", [
    (b"{garbage", "cannot read it as JSON (Expecting property name"),
    (b"\xff\xfe", "cannot read it as JSON ('utf-8' codec can't decode"),
    (b"[1, 2]", "a Chrome trace is a JSON object with traceEvents, got a list"),  # was AttributeError
    (b'{"traceEvents": []}', "this trace has no 'dtlib' metadata"),
    (b'{"dtlib": {"rank": 0}, "traceEvents": [{"ph": "X"}]}', "no 'dtlib/step' range in the trace"),
])
def test_dtlib_profile_names_the_file_it_cannot_read_in_one_line(tmp_path, capsys, content, message):
    (tmp_path / "rank0.json").write_bytes(content)
    assert main(["profile", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dtlib: error: {tmp_path / 'rank0.json'}: {message}") and err.count("\n") == 1, err


def _tiny_step(model, batch):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, model.cfg.vocab, (batch, model.cfg.seq + 1), generator=torch.Generator().manual_seed(0))

    def step():
        with phase("data"):
            x, y = tokens[:, :-1], tokens[:, 1:]
        with phase("forward"):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            opt.step()
            opt.zero_grad()
    return step


@pytest.mark.parametrize("checkpoint", [False, True])
def test_flops_counted_equal_dtlib_flops(checkpoint):
    """FlopCounterMode on a TinyGPT step: 3 x forward = dtlib's model FLOPs (full attention,
    logits counted); with full recomputation the hardware FLOPs add one forward of the layers."""
    _ = torch.manual_seed(0)
    cfg = tiny_gpt_config()
    batch = 4
    model = TinyGPT(cfg, checkpoint=checkpoint)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recompute whole blocks
        counted = count_flops(_tiny_step(model, batch))
    shape = cfg.numbers(cfg.seq)
    analytic = step_flops(batch * cfg.seq, recompute="full" if checkpoint else "none", **shape)
    assert counted["model"] == pytest.approx(analytic["model"], rel=1e-9)
    extra = counted["hardware"] - counted["model"]
    layers_forward = (analytic["forward_per_token"] - 2 * cfg.hidden * cfg.vocab) * batch * cfg.seq
    # backward skips the embedding's input gradient: nothing matmul-shaped, so only recompute differs
    assert extra == pytest.approx(recompute_flops_per_token("full" if checkpoint else "none",
                                                            layers_forward, 0), rel=1e-9)
    if checkpoint:  # by default recomputation stops after the last tensor backward needs
        early = count_flops(_tiny_step(model, batch))
        assert counted["model"] < early["hardware"] < counted["hardware"]


def test_sdpa_on_cpu_is_counted():
    q = torch.randn(2, 4, 16, 8, requires_grad=True)

    def step():
        with phase("forward"):
            out = F.scaled_dot_product_attention(q, q, q)
        with phase("backward"):
            out.sum().backward()
    counted = count_flops(step)
    forward = 2 * 2 * 2 * 4 * 16 * 16 * 8  # QK^T and AV: 2 matmuls of 2*b*h*s*s*d
    assert counted["per_phase"]["forward"] == forward
    assert counted["per_phase"]["backward"] == 2.5 * forward  # torch's sdpa_backward_flop_count


def test_profile_steps_writes_a_chrome_trace(tmp_path):
    _ = torch.manual_seed(0)
    model = TinyGPT(tiny_gpt_config(hidden=128))
    result = profile_steps(_tiny_step(model, 8), steps=2, warmup=1, trace_dir=str(tmp_path), peak=1e10,
                           tokens=8 * model.cfg.seq)
    trace = json.loads((tmp_path / "rank0.json").read_text())  # valid JSON, as Perfetto reads it
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    complete = [e for e in events if e.get("ph") == "X"]
    for e in complete:
        assert {"name", "ts", "dur", "pid", "tid"} <= e.keys()
        assert e["dur"] >= 0 and math.isfinite(e["ts"])
    names = [e["name"] for e in complete]
    assert names.count("dtlib/step") == 2
    for part in ("data", "forward", "backward", "optimizer"):
        assert names.count(f"dtlib/{part}") == 2, part
    assert any(n.startswith("aten::mm") or n == "aten::addmm" for n in names)
    # the parts add up to the step range, which lies inside the perf_counter window around it
    # (how much less it is depends on the load, not on the code: no tolerance on that side)
    parts = result["breakdown"]
    for step in result["steps"]:
        assert sum(step[p] for p in PARTS) == pytest.approx(step["step"], rel=1e-9)
    assert parts["step"] <= result["wall"] + 2e-6
    assert parts["step"] == pytest.approx(sum(e["dur"] for e in complete if e["name"] == "dtlib/step") / 2e6)
    # one process, no communication: inside forward and backward the time is operators (compute)
    # or the gaps between them (host_gaps), whatever the load; the matmuls are counted as compute
    steps = [e for e in complete if e["name"] == "dtlib/step"]
    inside = [e for e in complete if e["name"] in ("dtlib/forward", "dtlib/backward")]
    assert parts["compute"] + parts["host_gaps"] == pytest.approx(sum(e["dur"] for e in inside) / 2e6, rel=1e-3)
    first = steps[0]["ts"], steps[0]["ts"] + steps[0]["dur"]
    matmuls = _union((e["ts"], e["ts"] + e["dur"]) for e in complete
                     if e["name"] in ("aten::mm", "aten::addmm") and first[0] <= e["ts"] < first[1])
    assert result["steps"][0]["compute"] >= sum(b - a for a, b in matmuls) / 1e6 > 0
    job = summarize([result])
    assert job["tokens_per_second"] == pytest.approx(8 * model.cfg.seq / parts["step"])
    assert job["mfu"] == pytest.approx(result["flops"]["model"] / (parts["step"] * 1e10))


def _profile(parts, **extra):
    base = {p: 0.0 for p in (*PARTS, "overlapped_comm", "host_gaps")}
    breakdown = {}
    for rank, values in parts.items():
        row = dict(base, **values)
        row["step"] = sum(row[p] for p in PARTS)
        breakdown[rank] = row
    step = max(r["step"] for r in breakdown.values())
    return {"breakdown": breakdown, "step_time": step, "mfu": extra.get("mfu", 0.4),
            "hfu": extra.get("hfu", 0.4)}


def test_diagnose_rules():
    balanced = {0: {"compute": 0.6, "exposed_comm": 0.3, "data": 0.1},
                1: {"compute": 0.55, "exposed_comm": 0.35, "data": 0.1}}
    findings = diagnose(_profile(balanced))
    assert [f.kind for f in findings] == ["communication", "input"]
    assert findings[0].severity == "high" and findings[0].seconds_lost == pytest.approx(0.3)
    assert findings[1].severity == "medium"
    # the rank that waits least sets the communication cost; the other waited for a slow rank
    straggling = {0: {"compute": 0.3, "exposed_comm": 0.45}, 1: {"compute": 0.3, "other": 0.45,
                                                                   "exposed_comm": 0.02}}
    findings = diagnose(_profile(straggling))
    assert findings[0].kind == "straggler" and "rank 1" in findings[0].evidence
    assert findings[0].seconds_lost == pytest.approx(0.45)
    assert diagnose(_profile(straggling), Thresholds(report=0.6)) == []
    # recomputation: lost = compute x (1 - MFU/HFU)
    findings = diagnose(_profile({0: {"compute": 1.0}}, mfu=0.3, hfu=0.4))
    assert findings[0].kind == "recompute" and findings[0].seconds_lost == pytest.approx(0.25)
    assert diagnose(_profile({0: {"compute": 1.0}}, mfu=0.3, hfu=0.31)) == []


def test_launch_finding_is_not_a_stragglers_sleep():
    """A straggler's sleep inside forward is idle time on that rank only: the launch finding takes
    the rank with the fewest host gaps, so it does not count the sleep a second time (on main the
    mean over ranks did: 'straggler 91%' beside 'launch 46%')."""
    sleepy = {0: {"compute": 0.3, "exposed_comm": 0.9, "host_gaps": 0.01},
              1: {"compute": 0.3, "other": 0.9, "host_gaps": 0.9}}
    profile = _profile(sleepy)
    for rank in sleepy:
        profile["breakdown"][rank]["host_gaps"] = sleepy[rank]["host_gaps"]
    findings = diagnose(profile)
    assert [f.kind for f in findings] == ["straggler"]
    assert sum(f.share for f in findings) <= 1.0
    launch_bound = _profile({0: {"compute": 0.5, "other": 0.5}, 1: {"compute": 0.5, "other": 0.5}})
    for rank in (0, 1):
        launch_bound["breakdown"][rank]["host_gaps"] = 0.4
    assert [f.kind for f in diagnose(launch_bound)] == ["launch"]


@pytest.mark.parametrize("input_needs_grad", [False, True])
def test_model_flops_are_what_the_hardware_runs_without_recomputation(input_needs_grad):
    """MFU <= HFU needs model FLOPs <= the FLOPs the step really runs: the first layer's input
    gradient is not computed when the input is data (main counted 6N and printed HFU < MFU)."""
    from dtlib.experiments.profiling import mlp, model_flops

    model = mlp(16, 3)
    x = torch.randn(8, 16, requires_grad=input_needs_grad)

    def step():
        with phase("forward"):
            loss = model(x).square().mean()
        with phase("backward"):
            loss.backward()

    counted = count_flops(step)["hardware"]
    assert model_flops(model, 8, input_needs_grad) == counted


def _assert_sums(profile):
    for rank, parts in profile["breakdown"].items():
        assert sum(parts[p] for p in PARTS) == pytest.approx(profile["wall"][rank], rel=0.05), rank


def test_healthy_run_has_no_high_finding(tmp_path, capsys):
    """Other jobs on a 2-core machine can make one rank really slower for a while (a noisy
    neighbour is a true straggler): the first of up to 3 runs without a high finding counts."""
    for attempt in range(3):
        profile = run_injected("healthy", trace_dir=str(tmp_path))
        _assert_sums(profile)
        high = [(f.kind, round(f.share, 2)) for f in profile["findings"] if f.severity == "high"]
        if not high:
            break
    assert high == [], f"3 healthy runs in a row had high findings, the last: {high}"
    # no recomputation: the hardware ran exactly the FLOPs the model needs (both counted exactly)
    assert 0 < profile["mfu"] <= 1 and profile["hfu"] == pytest.approx(profile["mfu"], rel=1e-9)
    again = read_dir(str(tmp_path))  # `dtlib profile DIR` reads the same numbers back
    assert again["breakdown"] == profile["breakdown"] and again["mfu"] == profile["mfu"]
    assert main(["profile", str(tmp_path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["profile"]
    assert printed["breakdown"]["1"]["compute"] == profile["breakdown"][1]["compute"]
    assert [f["kind"] for f in printed["findings"]] == [f.kind for f in profile["findings"]]
    assert main(["profile", str(tmp_path)]) == 0
    assert "MFU" in capsys.readouterr().out
    assert main(["profile", str(tmp_path / "missing")]) == 2
    assert "DIR" in capsys.readouterr().err


@pytest.mark.parametrize("fault", ["communication", "input", "bubble", "straggler", "recompute"])
def test_injected_fault_is_the_top_finding(fault):
    """The injected fault is found in every run, and is the top finding in one of up to 3 runs.
    Only the ranking is timing: on a busy 2-core machine another job can stall one rank for a
    while, a real straggler of that run that may outrank a 25% recomputation cost (this failed
    1 run in 3 of the whole suite). Three runs in a row stalled that badly would be a machine
    too busy to profile on, which is not what this test is about."""
    seen = []
    for attempt in range(3):
        profile = run_injected(fault)
        kinds = [f.kind for f in profile["findings"]]
        seen.append([(f.kind, round(f.share, 2)) for f in profile["findings"]])
        assert fault in kinds, f"run {attempt + 1} did not find the injected {fault}: {seen[-1]}"
        _assert_sums(profile)
        assert profile["hfu"] >= profile["mfu"] * (1 - 1e-9), "HFU counts every FLOP MFU counts"
        assert sum(f.share for f in profile["findings"]) <= 1.0, seen[-1]
        if kinds[0] == fault:
            break
    top = profile["findings"][0]
    assert top.kind == fault, f"3 runs, none with {fault} on top: {seen}"
    if fault == "straggler":
        assert "rank 1 " in top.evidence
    if fault == "recompute":
        assert profile["hfu"] / profile["mfu"] > 1.2  # 4 forwards of the layers for 3
    if fault == "bubble":  # GPipe p=4, m=2: (p-1)/(m+p-1) = 60% in theory
        assert top.share > 0.3


def test_plots_draw_the_parts():
    from dtlib.viz.profile import plot_breakdown, plot_fault_shares, plot_step_timeline

    profile = _profile({0: {"compute": 0.06, "exposed_comm": 0.03, "data": 0.01},
                        1: {"compute": 0.05, "exposed_comm": 0.04, "data": 0.01}})
    findings = diagnose(profile)
    fig = plot_breakdown(profile, findings)
    ax = fig.axes[0]
    widths = sorted(round(p.get_width(), 6) for p in ax.patches if p.get_width() > 0)
    assert widths == [10.0, 10.0, 30.0, 40.0, 50.0, 60.0]  # ms
    assert "1. [high] communication" in ax.get_title()
    profile["findings"] = findings
    shares = plot_fault_shares({"comm": profile}).axes[0]
    assert [t.get_text() for t in shares.get_yticklabels()] == ["comm -> communication"]
    assert sorted(round(p.get_width()) for p in shares.patches if p.get_width() > 0) == [10, 30, 60]
    events = [_x("dtlib/step", 0, 1000), _x("aten::mm", 100, 400, cat="cpu_op"),
              _x("gloo:all_reduce", 400, 300, tid=2)]
    timeline = plot_step_timeline({0: step_intervals(_trace(events))}).axes[0]
    labels = {t.get_label() for t in timeline.collections}
    assert {"compute", "exposed communication", "collective in flight"} <= labels


def test_strength_levels():
    from dtlib.experiments.profiling import FAULTS, strength_of

    assert strength_of("input", "default") == FAULTS["input"][1]
    assert strength_of("input", "strong") == 2 * FAULTS["input"][1]
    assert strength_of("bubble", "strong") == 1
    with pytest.raises(ValueError, match="level"):
        strength_of("input", "huge")
    with pytest.raises(ValueError, match="strength"):
        run_injected("input", -1)


def _executor_worker(rank, world_size):
    from dtlib.experiments.pipeline import DEMO_CONFIG, demo_batch, demo_model, lm_loss
    from dtlib.parallel.pipeline import PipelineExecutor, partition, rank_chunks
    from dtlib.parallel.schedules import schedule

    cfg = dict(DEMO_CONFIG, hidden=128)
    chunks = rank_chunks(partition(demo_model(cfg), world_size), rank, world_size)
    executor = PipelineExecutor(chunks, schedule("gpipe", world_size, 2), rank, lm_loss)
    x, y = demo_batch(cfg, 16)
    logs = []

    def step():
        with phase("backward"):
            logs.append(executor.step(x, y))

    profile = profile_steps(step, steps=3, warmup=1, peak=1e10)
    waits = [sum(e.wait for e in log.events) for log in logs[-3:]]
    return profile["breakdown"], sum(waits) / len(waits)


def test_bubble_covers_the_pipeline_executors_own_waits():
    """dtlib's PipelineExecutor logs how long each action waited for its receive; the trace's
    bubble holds those waits (and the final waits on its sends, which the log leaves out)."""
    from dtlib.launcher import launch

    for parts, logged in launch(_executor_worker, 4, timeout=90):
        assert 0.9 * logged <= parts["bubble"] <= parts["step"]
        assert parts["bubble"] > 0.3 * parts["step"]  # GPipe p=4, m=2: (p-1)/(m+p-1) = 60% in theory


def test_dtlib_train_profile_writes_traces_and_the_summary(tmp_path, capsys):
    trace_dir = tmp_path / "traces"
    assert main(["train", "--pp", "2", "--schedule", "gpipe", "--microbatches", "1", "--steps", "3",
                 "--profile", str(trace_dir),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["profile"]
    assert sorted(out["breakdown"]) == ["0", "1"]
    assert {"kind", "severity", "evidence", "fix"} <= set(out["findings"][0])
    # GPipe over 2 stages with 1 micro-batch: rank 0 cannot start its backward before rank 1 has run
    # its forward and backward, so the time rank 0 spends neither computing, loading nor stepping
    # holds rank 1's compute (but a few bookkeeping operators), however loaded the machine. Which
    # finding ranks first is not fixed: in a 7-9 ms step the communication took 0.5-3.2 ms and the
    # mean bubble 2.1-2.5 ms (CI once ranked communication first)
    b = out["breakdown"]
    waiting = b["0"]["bubble"] + b["0"]["exposed_comm"] + b["0"]["other"]
    assert waiting >= 0.9 * b["1"]["compute"] > 0 and b["0"]["bubble"] > 0 and b["1"]["bubble"] > 0
    assert 0 < out["mfu"] <= 1
    assert out["hfu"] >= out["mfu"] * (1 - 1e-9)  # lesson 12's profiles come from here
    assert sorted(p.name for p in trace_dir.iterdir()) == ["rank0.json", "rank1.json"]
    assert read_dir(str(trace_dir))["breakdown"][1]["bubble"] == out["breakdown"]["1"]["bubble"]
    assert main(["train", "--steps", "1", "--profile", str(trace_dir)]) == 2
    assert "--profile needs --steps >= 2" in capsys.readouterr().err
