"""Lesson 13's JAX axis-type demo: under jax.make_mesh's default (Explicit) axes JAX refuses the
sharded embedding lookup; under Auto axes XLA inserts the collectives and the gradient equals one
device's."""
import pytest

pytest.importorskip("jax")

from dtlib.experiments.jax_axis_types import axis_types_demo  # noqa: E402


def test_explicit_default_refuses_and_auto_equals_one_device():
    got = axis_types_demo()
    assert got["default"]["axis_types"] == ["Explicit", "Explicit"]
    assert got["default"]["error"].startswith("ShardingTypeError")  # the lookup needs an out_sharding
    assert got["auto"]["axis_types"] == ["Auto", "Auto"]
    # float32 gradients summed in another order: rounding, far below a wrong reduction's 1e-2
    assert got["auto"]["max_grad_diff"] < 1e-6
    assert got["auto"]["collectives"].get("all_reduce", 0) > 0  # XLA's, not ours
