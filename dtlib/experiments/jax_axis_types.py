"""JAX's mesh axis types, shown by a run: the same sharded gradient under ``jax.make_mesh``'s default
(``AxisType.Explicit`` since JAX 0.7) and under ``AxisType.Auto`` (classic GSPMD).

With Auto axes XLA's sharding propagation decides every intermediate sharding and inserts the
collectives (Xu et al. 2021, "GSPMD"). With Explicit axes the sharding is part of each array's
type and JAX refuses an operation whose output sharding it cannot infer without communicating --
here the embedding lookup of a batch split over ``data`` -- asking for ``out_sharding`` instead
(JAX's "Explicit sharding" guide). :func:`axis_types_demo` runs both in a subprocess with 8 host
devices (``XLA_FLAGS`` is read when jax is imported) and returns what each did; run as
``python -m dtlib.experiments.jax_axis_types`` it is that subprocess.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

__all__ = ["axis_types_demo"]

_DEVICES = 8


def axis_types_demo(timeout: float = 120.0) -> dict[str, dict[str, Any]]:
    """``{"default": ..., "auto": ...}``: each either ``{"axis_types", "max_grad_diff",
    "collectives"}`` (the largest difference from the unsharded gradient, and the collectives of
    the compiled HLO) or ``{"axis_types", "error"}`` (the first line of what JAX raised)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_DEVICES}".strip()
    try:
        done = subprocess.run([sys.executable, "-m", "dtlib.experiments.jax_axis_types"], capture_output=True,
                              text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the JAX axis-type demo did not finish within timeout={timeout} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"the JAX axis-type demo failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from dtlib.frameworks.jax_gspmd import hlo_collectives

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, size=(8, 17))
    params = {"embed": 0.1 * rng.normal(size=(64, 32)).astype(np.float32),
              "mlp.up": 0.1 * rng.normal(size=(32, 128)).astype(np.float32),
              "mlp.down": 0.1 * rng.normal(size=(128, 32)).astype(np.float32)}
    specs = {"embed": P(), "mlp.up": P(None, "model"), "mlp.down": P("model", None)}

    def loss(p, tok):  # embedding, one MLP block with a residual, tied head, cross-entropy
        h = p["embed"][tok[:, :-1]]
        h = h + jax.nn.gelu(h @ p["mlp.up"]) @ p["mlp.down"]
        logp = jax.nn.log_softmax(h @ p["embed"].T)
        return -jnp.mean(jnp.take_along_axis(logp, tok[:, 1:, None], -1))

    reference = jax.grad(loss)(params, tokens)
    out: dict[str, dict[str, Any]] = {}
    for name, kwargs in (("default", {}), ("auto", {"axis_types": (AxisType.Auto, AxisType.Auto)})):
        mesh = jax.make_mesh((4, 2), ("data", "model"), **kwargs)
        result: dict[str, Any] = {"axis_types": [str(t).split(".")[-1] for t in mesh.axis_types]}
        try:
            with jax.set_mesh(mesh):
                sharded = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
                batch = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
                step = jax.jit(jax.grad(loss))
                grads = step(sharded, batch)
                hlo = step.lower(sharded, batch).compile().as_text()
            result["max_grad_diff"] = max(float(np.abs(np.asarray(grads[k]) - np.asarray(reference[k])).max())
                                          for k in grads)
            result["collectives"] = hlo_collectives(hlo)
        except Exception as e:  # noqa: BLE001 - what JAX refuses is the result
            result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        out[name] = result
    print(json.dumps(out))


if __name__ == "__main__":
    _main()
