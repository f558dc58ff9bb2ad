"""Lesson 13's graded checks: answers written here by hand pass (the runs equal one process), the
unfilled stub fails every check with its hint first, each classic mistake gets its own one-line
hint, and no hint gives away a solution value."""
import copy
import re

import pytest

from dtlib.grading.checks import frameworks as checks


def _fails(check, answer, pattern: str) -> str:
    """``check(answer)`` fails, and the first line of what it raised matches ``pattern``."""
    with pytest.raises(AssertionError) as info:
        check(answer)
    first = str(info.value).splitlines()[0]
    assert re.search(pattern, first), first
    return first


# ---- q1: DeepSpeed ------------------------------------------------------------------------------
DS = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
      "zero_optimization": {"stage": 1}, "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
      "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}


def _ds(**changes):
    cfg = copy.deepcopy(DS)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    return lambda: cfg


def test_deepspeed_answer_passes_and_trains_equal_to_one_process():
    checks.check_deepspeed_batch(_ds())
    checks.check_deepspeed_memory(_ds())
    checks.check_deepspeed_run(_ds())  # 2 DeepSpeed ranks, 3 steps, against one process


DS_MISTAKES = [
    (dict(gradient_accumulation_steps=2), "batch", r"do not multiply out"),
    (dict(train_batch_size=4, train_micro_batch_size_per_gpu=2), "batch", r"trains 4 sequences per optimizer step"),
    (dict(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=4), "batch", r"one forward pass of one rank runs 1"),
    (dict(gradient_accumulation_steps=None), "batch", r"gradient_accumulation_steps missing"),
    (dict(train_batch_size=0), "batch", r"train_batch_size must be a positive integer"),
    (dict(zero_optimization=None), "memory", r"zero_optimization is missing"),
    (dict(zero_optimization={"stage": 2}), "memory", r"stage 2 also shards the gradients"),
    (dict(zero_optimization={"stage": 3}), "memory", r"stage 3 also shards the gradients and the parameters"),
    (dict(zero_optimization={"stage": 0}), "memory", r"stage 0 shards nothing"),
    (dict(zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}), "memory", r"offload_optimizer moves"),
    (dict(gradient_clipping=None), "run", r"gradient_clipping is 1.0 \(DeepSpeed default\)"),
    (dict(gradient_clipping=1.0), "run", r"gradient_clipping is 1.0: DeepSpeed rescales"),
    (dict(optimizer=None), "run", r"optimizer is missing"),
    (dict(gradient_clipping=None, gradient_cliping=0.0), "run", r"DeepSpeed would reject.*gradient_cliping"),
]


@pytest.mark.parametrize("changes, check, hint", DS_MISTAKES)
def test_deepspeed_mistakes_have_their_own_hint(changes, check, hint):
    _fails(getattr(checks, f"check_deepspeed_{check}"), _ds(**changes), hint)


# ---- q2: Megatron-LM flags --------------------------------------------------------------------------
MEGATRON = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--optimizer", "sgd"]


def _meg(*drop: str, add: tuple = ()):
    """The flags without the flags in ``drop`` (and their values), plus ``add``."""
    out, skip = [], False
    for i, token in enumerate(MEGATRON):
        if skip:
            skip = False
            continue
        if token in drop:
            skip = i + 1 < len(MEGATRON) and not MEGATRON[i + 1].startswith("--")
            continue
        out.append(token)
    flags = out + list(add)
    return lambda: flags


def test_megatron_answer_passes_and_trains_equal_to_one_process():
    checks.check_megatron_layout(_meg())
    checks.check_megatron_batch(_meg())
    checks.check_megatron_run(_meg())  # 4 Megatron-Core ranks (tp 2 x pp 2, SP), 3 steps, against one process
    checks.check_megatron_layout(lambda: " ".join(MEGATRON))  # one string, as on a command line


MEGATRON_MISTAKES = [
    (_meg("--tensor-model-parallel-size", add=("--tensor-model-parallel-size", "4")), "layout",
     r"refuse.*must divide the world size"),
    (_meg("--pipeline-model-parallel-size"), "layout", r"--pipeline-model-parallel-size is 1"),
    (_meg("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
          add=("--pipeline-model-parallel-size", "4")), "layout", r"without tensor parallelism is ignored"),
    (_meg("--sequence-parallel"), "layout", r"sequence parallelism is off"),
    (_meg(add=("--num-layers-per-virtual-pipeline-stage", "1")), "layout", r"interleaved schedule"),
    (_meg("--micro-batch-size", add=("--micro-batch-size", "2")), "batch", r"--micro-batch-size is 2"),
    (_meg("--global-batch-size"), "batch", r"no --global-batch-size"),
    (_meg("--global-batch-size", add=("--global-batch-size", "8")), "batch", r"--global-batch-size is 8"),
    (_meg("--global-batch-size", "--micro-batch-size", add=("--micro-batch-size", "4", "--global-batch-size", "6")),
     "batch", r"refuse.*must be a multiple of --micro-batch-size"),
    (_meg("--optimizer"), "run", r"default optimizer, adam"),
    (_meg(add=("--tensor-parallel", "2")), "run", r"unknown or unsupported Megatron-LM flag '--tensor-parallel'"),
    (lambda: {"tp": 2}, "layout", r"must return a list of strings"),
]


@pytest.mark.parametrize("answer, check, hint", MEGATRON_MISTAKES)
def test_megatron_mistakes_have_their_own_hint(answer, check, hint):
    _fails(getattr(checks, f"check_megatron_{check}"), answer, hint)


# ---- q3: JAX PartitionSpecs ------------------------------------------------------------------------
# FSDP over "fsdp" on a dim tensor parallelism leaves whole; Megatron's split over "model"
SPECS = {"embed": ["fsdp", None], "attn.qkv": ["fsdp", "model"], "attn.out": ["model", "fsdp"],
         "mlp.up": ["fsdp", "model"], "mlp.down": ["model", "fsdp"], "norm": ["fsdp"], "head": ["fsdp", None]}
BATCH = ["fsdp", None]


def _jax(batch=BATCH, **changes):
    specs = {**copy.deepcopy(SPECS), **{k.replace("_", "."): v for k, v in changes.items()}}
    specs = {k: v for k, v in specs.items() if v != "drop"}
    return lambda: (specs, batch)


@pytest.fixture(scope="module")
def jax_answer_run():
    """The answer's GSPMD run, as the run check made it (8 host devices, against one device)."""
    return checks.check_jax_run(_jax())


def test_jax_answer_passes_and_trains_equal_to_the_unsharded_run(jax_answer_run):
    checks.check_jax_tensor_parallel(_jax())
    checks.check_jax_fsdp(_jax())
    assert jax_answer_run.settings["mesh"] == checks.JAX_TASK["mesh"]


def test_jax_other_valid_answers_pass_the_pure_checks():
    alternative = _jax(embed=[None, "fsdp"], head=[None, "fsdp"], attn_qkv=[("fsdp",), "model"])
    checks.check_jax_tensor_parallel(alternative)
    checks.check_jax_fsdp(alternative)


JAX_MISTAKES = [
    (dict(attn_qkv=["model", "fsdp"]), "tensor_parallel",
     r"attn.qkv splits its hidden dimension over 'model', the wrong dimension for a column-parallel"),
    (dict(mlp_down=["fsdp", "model"]), "tensor_parallel",
     r"mlp.down splits its hidden dimension over 'model', the wrong dimension for a row-parallel"),
    (dict(mlp_up=["fsdp", None]), "tensor_parallel", r"mlp.up is not split over 'model'"),
    (dict(head=["fsdp", "model"]), "tensor_parallel", r"head is split over 'model'"),
    (dict(norm=[None]), "fsdp", r"norm is not sharded over 'fsdp'"),
    (dict(batch=[None, None]), "fsdp", r"sequences are not split over 'fsdp'"),
    (dict(batch=[["fsdp", "model"], None]), "fsdp", r"the batch is split over .model."),
    (dict(embed="drop"), "fsdp", r"no spec for embed"),
    (dict(embed=["data", None]), "tensor_parallel", r"unknown axis 'data'"),
    (dict(attn_qkv=["fsdp"]), "run", r"one entry per dim"),
]


def _jax_case(changes: dict):
    changes = dict(changes)
    return _jax(batch=changes.pop("batch", BATCH), **changes)


@pytest.mark.parametrize("changes, check, hint", JAX_MISTAKES)
def test_jax_mistakes_have_their_own_hint(changes, check, hint):
    _fails(getattr(checks, f"check_jax_{check}"), _jax_case(changes), hint)


def test_jax_wrong_dimension_is_correct_but_costs_collectives(jax_answer_run):
    """What the wrong-dimension hint says, measured: XLA keeps the numbers (so only the pure check
    can catch it) and inserts more collectives than Megatron's split."""
    from dtlib.frameworks.common import compare
    from dtlib.frameworks.jax_gspmd import run_jax

    wrong = dict(copy.deepcopy(SPECS), **{"attn.qkv": ["model", "fsdp"]})
    run = run_jax(dict(checks.JAX_TASK["mesh"]), wrong, BATCH, checks.STEPS)
    assert compare(run, jax_answer_run)["max_param_diff"] < checks.TOLERANCE
    assert sum(run.collectives[0].values()) > sum(jax_answer_run.collectives[0].values())


# ---- q4: the flags a config silently drops -------------------------------------------------------
SILENT = {"--rotary-base": 500000, "--hidden-dropout": 0, "--attention-dropout": 0.0}


def _silent(**changes):
    answer = {k: v for k, v in (SILENT | changes).items() if v is not None}
    return lambda: answer


def test_silent_answer_passes_and_the_broken_config_is_accepted_by_megatron():
    """The answer passes; the broken flags are what Megatron-LM accepts (its own argument record and
    Megatron-Core's configs), and filling the answer back in gives the emitter's values."""
    from dtlib.frameworks.configs import check_megatron
    from dtlib.frameworks.megatron_args import parse_args

    checks.check_silent_flags(_silent())
    checks.check_silent_values(_silent())
    broken = checks.broken_megatron_flags()
    t = checks.SILENT_TASK
    check_megatron(broken, t["dp"] * t["tp"])
    read = parse_args(broken)  # Megatron-LM's defaults fill the gaps: another model
    assert (read["rotary_base"], read["hidden_dropout"], read["attention_dropout"]) == (10000, 0.1, 0.1)
    fixed = parse_args(broken + [str(x) for kv in SILENT.items() for x in kv])
    assert (fixed["rotary_base"], fixed["hidden_dropout"], fixed["attention_dropout"]) == (500000, 0.0, 0.0)


SILENT_MISTAKES = [
    (dict(**{"--attention-dropout": None}), "flags", r"2 of the 3 flags"),
    (dict(**{"--rope-base": 500000}), "flags", r"--rope-base is not a Megatron-LM flag"),
    (dict(**{"--swiglu": True}), "flags", r"--swiglu is in the config already"),
    (dict(**{"--init-method-std": 0.02}), "flags", r"--init-method-std is absent, but its default does not change"),
    (dict(**{"--rotary-base": 10000}), "values", r"--rotary-base 10000 is not what the plan needs: read the preset"),
    (dict(**{"--hidden-dropout": 0.1}), "values", r"--hidden-dropout 0.1 is not what the plan needs: read what"),
    (dict(**{"--hidden-dropout": "none"}), "values", r"'none' is not a number"),
]


@pytest.mark.parametrize("changes, check, hint", SILENT_MISTAKES)
def test_silent_mistakes_have_their_own_hint_that_never_gives_the_value(changes, check, hint):
    first = _fails(getattr(checks, f"check_silent_{check}"), _silent(**changes), hint)
    assert "500000" not in first and "500,000" not in first


def test_silent_answer_that_is_not_a_dict_is_reported():
    _fails(checks.check_silent_flags, lambda: ["--rotary-base"], r"must return a dict")


# ---- every question -----------------------------------------------------------------------------------
ALL_CHECKS = [name for name in checks.__all__ if name.startswith("check_")]


@pytest.mark.parametrize("name", ALL_CHECKS)
@pytest.mark.parametrize("stub", [lambda: None, lambda: ...], ids=["None", "Ellipsis"])
def test_the_unfilled_stub_fails_each_check_with_its_hint_first(name, stub):
    _fails(getattr(checks, name), stub, r"\(\) returned (None|Ellipsis): replace the \.\.\. with your answer")


def test_an_answer_that_raises_is_reported():
    def broken():
        raise KeyError("oops")
    _fails(checks.check_deepspeed_batch, broken, r"deepspeed_config\(\) raised KeyError")


# What the solutions write; a hint that contains one gives the answer away.
GIVEAWAYS = ["--sequence-parallel'", "--global-batch-size 4", "--optimizer sgd", "'stage': 1", '"stage": 1', "stage 1", "gradient_accumulation_steps: 1", "= 4 x 1 x 2",
             "'gradient_clipping': 0", "gradient_clipping to 0", "None, 'model'", "'model', None",
             "qkv': ['fsdp', 'model']", "up': ['fsdp', 'model']", "out': ['model', 'fsdp']",
             "down': ['model', 'fsdp']", "('fsdp', 'model')", "dim 1", "dim 0"]


def test_each_mistake_has_its_own_hint_and_none_gives_the_answer_away():
    hints = [_fails(getattr(checks, f"check_deepspeed_{check}"), _ds(**changes), pattern)
             for changes, check, pattern in DS_MISTAKES]
    hints += [_fails(getattr(checks, f"check_megatron_{check}"), answer, pattern)
              for answer, check, pattern in MEGATRON_MISTAKES]
    hints += [_fails(getattr(checks, f"check_jax_{check}"), _jax_case(changes), pattern)
              for changes, check, pattern in JAX_MISTAKES]
    for hint in hints:
        assert not [g for g in GIVEAWAYS if g in hint], hint
    # two different mistakes never read the same (the learner could not tell them apart)
    same = {h for h in hints if hints.count(h) > 1}
    assert not same, same
