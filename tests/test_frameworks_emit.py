"""``dtlib plan --emit``: each framework's config of a planned layout accepted by the framework's own
config class (DeepSpeedConfig, Megatron-Core's TransformerConfig, JAX's shardings, torchtitan's
schema), the command line's --emit/--emit-dir/--json, and --rehearse: the layout shrunk and run
under DeepSpeed, Megatron-Core and JAX, equal to one process."""
import contextlib
import io
import json
import tomllib

import pytest

from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.cli import main
from dtlib.frameworks.configs import check_deepspeed, check_emitted, check_jax, check_megatron, check_torchtitan_toml
from dtlib.experiments.parallel3d import LOSS_TOL, PARAM_TOL
from dtlib.frameworks.rehearse import rehearse, rehearse_all, shrink_for
from dtlib.plan.emit import FILENAMES, FRAMEWORKS, TimedPlan, emit
from dtlib.plan.search import to_layout
from dtlib.plan.steptime import StepOptions

LLAMA = get_preset("llama3-8b")
# TP communication exposed: the top layout is then FSDP over all 64 GPUs, which every framework
# expresses (with the megatron stack's overlapped TP, tp 4 wins instead)
PLAN = ["plan", "--model", "llama3-8b", "--gpus", "64", "--global-batch", "512", "--tp-overlap", "0"]
# a 3D layout pinned on the same cluster: tensor x pipeline x data, SP, ZeRO-1 (1F1B: DeepSpeed's
# pipeline engine has no interleaving; tests/test_plan_emit.py covers it)
PINNED = PLAN + ["--tp", "4", "--pp", "2", "--virtual-stages", "1", "--zero", "1", "--sequence-parallel"]
PINNED_LAYOUT = Parallelism(dp=8, tp=4, pp=2, zero=1, sequence_parallel=True, num_microbatches=64)
# the plan PLAN's flags time: the megatron stack with TP communication exposed
PINNED_PLAN = TimedPlan(PINNED_LAYOUT, LLAMA, 512, StepOptions(tp_overlap=0))
# dtlib.frameworks' Megatron check and runner (check_megatron, megatron_flags.VALUE_FLAGS /
# SWITCH_FLAGS: a hand list of flags) do not take the step-time and model flags the emitter now
# writes (--tp-comm-overlap, --fp8-recipe, --norm-epsilon, --rotary-base, ...; each parsed and
# validated by Megatron-LM's own parse_args/validate_args at core_v0.16.1): strict, so these
# cases pass loudly once that check reads Megatron-LM's generated argument record
def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_torchtitan_config_is_checked_not_rehearsed():
    layout = Parallelism(dp=8, zero=3)
    emitted = {"torchtitan": emit("torchtitan", layout, LLAMA, 8).to_dict()}
    (result,) = rehearse_all(emitted, layout).values()
    assert result["passed"] is None and "not installed" in result["why"]


def _json(argv):
    """``dtlib ARGV`` (exit status, its JSON): one run shared by a module's tests."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(argv)
    return code, json.loads(buffer.getvalue())


@pytest.fixture(scope="module")
def plans():
    """The JSON of the top layout and of the pinned 3D layout, every framework emitted."""
    return {name: _json(argv + ["--top", "1", "--json", "--emit", ",".join(FRAMEWORKS)])[1]
            for name, argv in (("top", PLAN), ("pinned", PINNED))}


def test_the_top_layout_is_accepted_by_every_frameworks_own_config_class(plans):
    d = plans["top"]
    layout = to_layout(d["configs"][0])
    assert layout.dp == 64 and layout.zero >= 2  # sharded data parallelism over all 64 GPUs
    for framework in FRAMEWORKS:
        e = emit(framework, layout, LLAMA, 512)
        assert d["emitted"][framework]["text"] == e.text and not e.unsupported
        if framework != "megatron":  # next test
            assert check_emitted(e, layout)  # raises if the framework refuses it


def test_the_top_layout_is_accepted_by_megatrons_own_config_class(plans):
    layout = to_layout(plans["top"]["configs"][0])
    assert check_emitted(emit("megatron", layout, LLAMA, 512), layout)


def test_the_pinned_3d_layout_where_it_is_expressible(plans):
    d = plans["pinned"]
    layout = to_layout(d["configs"][0])
    assert layout == PINNED_LAYOUT
    e = d["emitted"]
    assert "ZeRO-1" in e["torchtitan"]["unsupported"][0] and "pp=2" in e["jax"]["unsupported"][0]
    megatron = emit("megatron", PINNED_PLAN)
    assert megatron.text == e["megatron"]["text"] and "--tp-comm-overlap" not in megatron.data  # as timed
    # DeepSpeed's JSON is Megatron-DeepSpeed's: DeepSpeed's data-parallel size is world / (tp x pp)
    deepspeed = emit("deepspeed", layout, LLAMA, 512)
    assert "on 8 data-parallel ranks" in check_emitted(deepspeed, layout)


def test_the_pinned_3d_layout_is_accepted_by_megatrons_own_config_class():
    # Megatron-Core's TransformerConfig built from the flags: the 3D layout as Megatron reads it
    assert check_emitted(emit("megatron", PINNED_PLAN), PINNED_LAYOUT)


@pytest.mark.parametrize("framework, layout, model, precision", [
    ("deepspeed", Parallelism(dp=8, tp=2, zero=1, recompute="full", num_microbatches=4), LLAMA, "bf16"),
    ("deepspeed", Parallelism(dp=8, zero=3, offload="params", micro_batch_size=2, num_microbatches=4), LLAMA, "fp16"),
    ("deepspeed", Parallelism(dp=8, zero=2, offload="optimizer"), LLAMA, "bf16"),
    pytest.param("megatron", Parallelism(dp=4, tp=4, pp=4, zero=1, schedule="interleaved", virtual_stages=2,
                                         sequence_parallel=True, num_microbatches=8, recompute="selective"), LLAMA,
                 "fp8"),
    pytest.param("megatron", Parallelism(dp=8, tp=2, cp=2, zero=1, micro_batch_size=2, num_microbatches=4,
                                         recompute="full"), LLAMA, "bf16"),
    pytest.param("megatron", Parallelism(dp=8, tp=8, pp=8, num_microbatches=16), get_preset("gpt3-175b"), "fp16"),
    ("jax", Parallelism(dp=16, tp=4, zero=3, shard_size=8), LLAMA, "bf16"),
])
def test_variants_accepted_by_the_frameworks_own_checks(framework, layout, model, precision):
    e = emit(framework, layout, model, layout.global_batch, precision)
    assert not e.unsupported and check_emitted(e, layout)


def test_the_frameworks_checks_refuse_a_broken_config():
    layout = Parallelism(dp=8, zero=3, num_microbatches=2)
    ds = emit("deepspeed", layout, LLAMA, 16).data
    with pytest.raises(ValueError, match="train_batch_size"):
        check_deepspeed({**ds, "train_batch_size": 17}, 8)
    mesh = emit("jax", layout, LLAMA, 16).data
    with pytest.raises(ValueError, match=r"specs\['mlp.up'\]"):
        check_jax({**mesh, "shapes": {**mesh["shapes"], "mlp.up": [4100, 14336]}})  # 4100 rows over 8
    with pytest.raises(ValueError, match="data_parallel_shard_size is not a torchtitan key"):
        check_torchtitan_toml(emit("torchtitan", layout, LLAMA, 16).text.replace("shard_degree", "shard_size"))
    with pytest.raises(ValueError, match="nothing to check"):
        check_emitted(emit("jax", Parallelism(pp=2, num_microbatches=2), LLAMA, 2), Parallelism(pp=2, num_microbatches=2))


def test_megatrons_check_refuses_flags_that_do_not_fit():
    flags = emit("megatron", Parallelism(dp=2, tp=4), LLAMA, 2).data
    with pytest.raises(ValueError, match="must divide the world size 6"):
        check_megatron(flags, 6)  # Megatron-LM's launch rule: 6 ranks are not a multiple of tp 4
    groups = flags.index("--num-query-groups") + 1
    with pytest.raises(ValueError, match=r"Megatron-Core refuses the flags: num_query_groups \(6\)"):
        check_megatron(flags[:groups] + ["6"] + flags[groups + 1:], 8)  # TransformerConfig's own rule
    with pytest.raises(ValueError, match="unknown Megatron-LM flag '--tensor-parallel-size'"):
        check_megatron(["--tensor-parallel-size", "2"], 2)
    with pytest.raises(ValueError, match="--ffn-hidden-size must be an integer, got 'x'"):
        check_megatron(["--ffn-hidden-size", "x"], 1)
    with pytest.raises(ValueError, match="--num-query-groups needs a value"):
        check_megatron(["--num-query-groups"], 1)


def test_cli_prints_the_configs_after_the_plan_and_writes_them(capsys, tmp_path):
    code, out, _ = run(capsys, *PINNED, "--top", "1", "--emit", "megatron", "--emit", "deepspeed,jax",
                       "--emit-dir", str(tmp_path / "configs"))
    assert code == 0
    table = out.index("breakdown of the step")
    assert table < out.index("megatron (megatron_flags.txt) of layout #1") < out.index("--tensor-model-parallel-size 4")
    assert "jax: cannot express layout #1:\n  - pp=2" in out
    written = sorted(p.name for p in (tmp_path / "configs").iterdir())
    assert written == sorted([FILENAMES["megatron"], FILENAMES["deepspeed"]])  # nothing for jax
    assert (tmp_path / "configs" / "megatron_flags.txt").read_text() == emit("megatron", PINNED_PLAN).text
    assert json.loads((tmp_path / "configs" / "ds_config.json").read_text())["train_batch_size"] == 512
    assert f"written to {tmp_path / 'configs' / 'ds_config.json'}" in out


def test_cli_json_has_the_configs(plans):
    e = plans["top"]["emitted"]
    assert list(e) == list(FRAMEWORKS)
    assert tomllib.loads(e["torchtitan"]["text"])["parallelism"]["data_parallel_shard_degree"] == 64
    assert e["jax"]["data"]["mesh"] == {"data": 1, "fsdp": 64, "model": 1}
    assert "--use-megatron-fsdp" in e["megatron"]["data"]


@pytest.mark.parametrize("argv, message", [
    (["--emit-dir", "x"], "--emit-dir needs --emit"),
    (["--rehearse"], "--rehearse needs --emit"),
    (["--emit", "megatron,mxnet"], "argument --emit: unknown framework 'mxnet'"),
])
def test_cli_bad_emit_flags(capsys, argv, message):
    code, out, err = run(capsys, *PLAN, *argv)
    assert code == 2 and message in err and out == ""


def test_cli_emit_dir_that_is_a_file(capsys, tmp_path):
    (tmp_path / "f").write_text("")
    code, _, err = run(capsys, *PLAN, "--emit", "jax", "--emit-dir", str(tmp_path / "f"))
    assert code == 2 and "--emit-dir" in err and "is a file" in err


# ---- --rehearse: one CLI run for DeepSpeed and JAX, Megatron-Core on its own ---------------------------
@pytest.fixture(scope="module")
def rehearsed():
    return _json(PINNED + ["--top", "1", "--emit", "deepspeed,jax,torchtitan", "--rehearse", "--json"])


def test_cli_rehearse_under_deepspeed_equals_one_process(rehearsed):
    code, d = rehearsed
    r = d["rehearsals"]
    assert code == 0 and r["deepspeed"]["passed"]
    for framework in ("jax", "torchtitan"):  # a mesh cannot express pp, torchtitan ZeRO-1
        assert r[framework]["passed"] is None and "nothing emitted" in r[framework]["why"]
    ds = r["deepspeed"]
    assert (ds["layout"]["dp"], ds["layout"]["tp"], ds["layout"]["pp"], ds["layout"]["zero"]) == (2, 1, 1, 1)
    assert ds["config"]["zero_optimization"]["stage"] == 1 and ds["config"]["gradient_clipping"] == 0.0
    assert "Megatron-DeepSpeed" in ds["changes"][0]
    assert ds["tolerance"] == {"max_loss_diff": LOSS_TOL, "max_param_diff": PARAM_TOL}
    assert ds["max_loss_diff"] <= LOSS_TOL and ds["max_param_diff"] <= PARAM_TOL
    assert ds["losses"][0] != ds["losses"][-1]  # it trained
    # a partial verdict exits 0 (the run matched one process) but never passes tp, pp or sp
    assert (ds["verdict"], ds["rehearsed"], ds["not_rehearsed"]) == ("partial", ["dp", "zero"], ["tp", "pp", "sp"])
    assert ds["verdict_text"] == "PASS for dp x zero; tp, pp, sp not rehearsed"


def test_rehearse_under_jax_equals_one_process():
    layout = Parallelism(dp=8, tp=4, zero=3, num_microbatches=4)
    result = rehearse("jax", layout)
    assert result["passed"], result
    assert result["config"]["mesh"] == {"data": 1, "fsdp": 2, "model": 2}
    assert result["config"]["specs"]["mlp.up"] == ["fsdp", "model"]
    assert result["losses"][0] != result["losses"][-1]


def test_rehearse_under_megatron_equals_one_process():
    layout = Parallelism(dp=4, tp=4, pp=4, zero=1, schedule="interleaved", virtual_stages=2, sequence_parallel=True,
                         num_microbatches=8)
    result = rehearse("megatron", layout)
    assert result["passed"], result
    flags = result["config"]
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == "2"
    assert "--num-layers-per-virtual-pipeline-stage" in flags and "--sequence-parallel" in flags
    assert "--bf16" not in flags and "--grad-reduce-in-bf16" not in flags  # the run compares in float32


def test_shrink_for_each_framework_keeps_what_its_runner_runs():
    layout = Parallelism(dp=8, tp=4, pp=2, cp=2, zero=3, num_microbatches=8)
    ds, _, lines = shrink_for("deepspeed", layout)
    assert (ds.dp, ds.tp, ds.pp, ds.cp, ds.zero) == (2, 1, 1, 1, 3) and "tp 4 -> 1, pp 2 -> 1, cp 2 -> 1" in lines[0]
    jax, model, _ = shrink_for("jax", layout)
    assert (jax.dp, jax.tp, jax.pp, jax.cp, jax.global_batch) == (2, 2, 1, 1, 8) and model.ffn == 128
    with pytest.raises(ValueError, match="torchtitan.*cannot be rehearsed"):
        shrink_for("torchtitan", layout)


def test_a_failed_rehearsal_says_fail_and_exits_1(capsys, monkeypatch):
    """The verdict and the exit status, without running a framework: a rehearsal whose parameters
    are off by more than the tolerance."""
    failed = {"framework": "deepspeed", "layout": {**PINNED_LAYOUT.__dict__, "tp": 1, "pp": 1, "dp": 2}, "ranks": 2,
              "changes": ["tp 4 -> 1"], "model": "tiny", "steps": 3, "max_loss_diff": 0.0, "max_param_diff": 1e-3,
              "tolerance": {"max_loss_diff": LOSS_TOL, "max_param_diff": PARAM_TOL}, "passed": False,
              "rehearsed": ["dp", "zero"], "why_not": {"tp": "DeepSpeed alone", "pp": "DeepSpeed alone"},
              "verdict_text": "FAIL for dp x zero"}
    monkeypatch.setattr("dtlib.cli.plan.rehearse_all", lambda *args, **kwargs: {"deepspeed": failed})
    code, out, _ = run(capsys, *PINNED, "--top", "1", "--emit", "deepspeed", "--rehearse")
    assert code == 1
    assert "max param diff 1.00e-03 (tolerances 1e-05, 1e-06)" in out and "verdict: FAIL for dp x zero" in out


def test_cli_plans_with_the_emitted_frameworks_stack_or_refuses_another(capsys):
    code, out, err = run(capsys, *PLAN, "--emit", "torchtitan", "--stack", "megatron")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--stack megatron contradicts --emit torchtitan" in err
    _, d = _json(PLAN + ["--top", "1", "--json", "--emit", "torchtitan"])
    assert d["assumed"]["stack"] == "torchtitan" and not d["emitted"]["torchtitan"]["retimed"]


def test_cli_prints_the_emitted_run_retimed_where_the_config_runs_otherwise():
    """tp 4 without sequence parallelism: Megatron-LM's --tp-comm-overlap needs it, so the config runs
    TP communication exposed and the printed #1 is that run, re-timed (slower than timed)."""
    _, d = _json(["plan", "--model", "llama3-8b", "--gpus", "64", "--global-batch", "512", "--tp", "4", "--pp", "1",
                  "--zero", "1", "--no-sequence-parallel", "--top", "1", "--json", "--emit", "megatron"])
    best, e = d["configs"][0], d["emitted"]["megatron"]
    assert "--tp-comm-overlap" not in e["data"] and e["retimed"][0].startswith("tp_overlap:")
    assert best["retimed"]["framework"] == "megatron" and best["step_time_s"] == e["timing"]["step_time_s"]
    assert best["step_time_s"] > best["retimed"]["timed"]["step_time_s"] and best["breakdown"]["tp_comm"] > 0
    band = best["band"]["step_time_s"]  # the error band is the re-timed step's
    assert band["covered"] and band["low"] <= best["step_time_s"] <= band["high"]
