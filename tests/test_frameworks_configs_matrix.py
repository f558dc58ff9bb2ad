"""Every preset x framework x layout: the emitter refuses by name, or the framework's own code
accepts the config and builds the preset's model (issue 35, part 4).

Judges: Megatron-LM's argument list recorded at core_v0.16.1 + ``validate_args``' rules +
Megatron-Core's configs, and ``GPTModel`` built on the meta device for the first and the last
rank, its count equal to dtlib's ``stage_parameters`` with the vocabulary padded as Megatron-LM
pads it (to a multiple of ``--make-vocab-size-divisible-by`` 128 x tp); DeepSpeed's
``DeepSpeedConfig``; torchtitan 0.2.2's ``ConfigManager``, its flavor's model built on meta (count
equal to the preset's), its pipeline split and converter registry; JAX's ``NamedSharding`` on an
``AbstractMesh``, each weight role's shape the preset's.

Known emitter bugs (issue 35 parts 1-2) are ``xfail(strict=True)`` with the judge's finding, so
each one fails loudly once fixed and its mark is removed.
"""
import pytest

from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import PRESETS
from dtlib.frameworks.configs import check_deepspeed, check_jax, check_megatron
from dtlib.frameworks.megatron_args import parse_args
from dtlib.frameworks.megatron_meta import dtlib_params_per_stage
from dtlib.plan.emit import FRAMEWORKS, emit

MATRIX_TIMEOUT = 600  # the first megatron and torchtitan imports take ~30 s on a loaded 2-core machine
# Measured 2026-11-29: the whole matrix takes 40 s of CPU (user) time; on the shared 2-core machine
# under seven helpers' load, 4.4 minutes of wall time. The largest meta builds (GPT-3 175B at dp 8,
# Qwen3-235B tp 4 x pp 2) take about 5 s of CPU each.


def _layouts(model):
    """name -> framework -> layout: data-parallel over 8 (with ep for MoE models: a rank then holds
    1/ep of the experts, as every MoE recipe runs) and a tp x pp one. ZeRO is each framework's
    natural choice (torchtitan and JAX shard with FSDP; DeepSpeed's pipeline engine refuses
    ZeRO-2/3; Megatron's ZeRO-1 is its distributed optimizer)."""
    fsdp = {f: 3 for f in ("torchtitan", "jax")}
    tp = 4 if model.heads % 4 == 0 and model.kv_heads % 4 == 0 else 2
    ep = (8 if model.moe_experts % 8 == 0 else 2) if model.moe_experts else 1
    # JAX's mesh has no expert axis: its data-parallel layout of a MoE model is ep 1
    return {"dp8": {f: Parallelism(dp=8, ep=1 if f == "jax" else ep, zero=fsdp.get(f, 3 if ep == 1 else 1))
                    for f in FRAMEWORKS},
            "tp_pp": {f: Parallelism(dp=2, tp=tp, pp=2, zero=fsdp.get(f, 1), num_microbatches=4,
                                     sequence_parallel=True) for f in FRAMEWORKS}}


CASES = [(name, kind, framework) for name, model in PRESETS.items() for kind in _layouts(model)
         for framework in FRAMEWORKS]

def _params(case):
    name, kind, framework = case
    return pytest.param(*case, id=f"{name}-{kind}-{framework}")


def _jax_roles(model):
    """The weight-role shapes of the preset (its attention and one MLP)."""
    qkv = (model.heads + 2 * model.kv_heads) * model.head_dim
    return {"embed": [model.vocab, model.hidden], "attn.qkv": [model.hidden, qkv],
            "attn.out": [model.heads * model.head_dim, model.hidden], "mlp.up": [model.hidden, model.ffn],
            "mlp.down": [model.ffn, model.hidden], "norm": [model.hidden], "head": [model.hidden, model.vocab]}


@pytest.mark.timeout(MATRIX_TIMEOUT)
@pytest.mark.parametrize("name, kind, framework", [_params(c) for c in CASES])
def test_emitted_config_is_refused_by_name_or_accepted_and_builds_the_model(name, kind, framework):
    _judge(name, kind, framework)


def _judge(name, kind, framework):
    """Refused by name, or accepted and the same model; raises what the judge found."""
    model = PRESETS[name]
    layout = _layouts(model)[kind][framework]
    try:
        e = emit(framework, layout, model, layout.global_batch)
    except ValueError as exc:  # the layout itself is invalid for this model: refused, naming why
        assert str(exc).strip()
        return
    if e.unsupported:
        assert all(line.strip() for line in e.unsupported)
        return
    if framework == "megatron":
        from dtlib.frameworks.megatron_meta import params_per_rank

        check_megatron(e.data, layout.gpus)
        args = parse_args(e.data)
        stages = dtlib_params_per_stage(model, layout, args["make_vocab_size_divisible_by"])
        want = [stages["first"], stages["last"]]
        got = [params_per_rank(e.data, layout.gpus, rank) for rank in (0, layout.gpus - 1)]
        assert got == want, f"Megatron-Core's first/last rank {got} != dtlib's {want}"
    elif framework == "deepspeed":
        check_deepspeed(e.data, layout.dp)
    elif framework == "torchtitan":
        from dtlib.frameworks.torchtitan_check import check_torchtitan_job, import_torchtitan

        try:
            import_torchtitan()
        except ImportError as exc:
            pytest.skip(str(exc))

        built = check_torchtitan_job(e.text)
        assert built["parameters"] == model.num_parameters(), \
            f"torchtitan builds {built['parameters']:,} parameters, the preset has {model.num_parameters():,}"
    else:
        check_jax(e.data)
        assert e.data["shapes"] == _jax_roles(model) and not model.moe_experts, \
            f"jax roles {e.data['shapes']} are not the preset's {_jax_roles(model)}"


_POSITIONS = {"rope": "rope", "learned": "learned_absolute"}  # Megatron-LM's --position-embedding-type
@pytest.mark.parametrize("name", list(PRESETS))
def test_megatron_runs_the_presets_fields_not_megatrons_defaults(name):
    """Fields that change the run but not the parameter count, as Megatron-LM reads the flags:
    dropout (dtlib plans none) and the position embedding (ALiBi has no Megatron-LM flag: refuse)."""
    model = PRESETS[name]
    layout = Parallelism(dp=8, ep=8 if model.moe_experts % 8 == 0 and model.moe_experts else 1, zero=1)
    e = emit("megatron", layout, model, layout.global_batch)
    if e.unsupported:
        return
    args = parse_args(e.data)
    assert args["hidden_dropout"] == 0 and args["attention_dropout"] == 0, \
        f"dropout {args['hidden_dropout']}/{args['attention_dropout']}"
    assert args["position_embedding_type"] == _POSITIONS.get(model.position), \
        f"position {model.position!r} emitted as {args['position_embedding_type']!r}"
