"""The JAX side of :mod:`dtlib.frameworks.jax_gspmd`: the model, the sharded SGD step, and the
``shard_map`` pitfall, run as ``python -m dtlib.frameworks.jax_worker RESULT.pkl`` with a JSON
request on stdin. It imports jax, so it only ever runs in a process started with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (:func:`jax_gspmd._subprocess`).
"""
from __future__ import annotations

import json
import math
import os
import pickle
import sys
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec


def init_params(model: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Parameters keyed ``embed``, ``layers.{i}.attn.norm``, ``layers.{i}.attn.qkv``, ...,
    ``norm``, ``head``, drawn with NumPy from ``seed`` so every run starts from the same values.
    Linear weights N(0, 0.02) as GPT-2; norm weights 1."""
    rng = np.random.default_rng(seed)
    h, f, v = model["hidden"], model["ffn"], model["vocab"]
    shapes = {"embed": (v, h)}
    for i in range(model["layers"]):
        shapes.update({f"layers.{i}.attn.norm": (h,), f"layers.{i}.attn.qkv": (h, 3 * h),
                       f"layers.{i}.attn.out": (h, h), f"layers.{i}.mlp.norm": (h,),
                       f"layers.{i}.mlp.up": (h, f), f"layers.{i}.mlp.down": (f, h)})
    shapes.update({"norm": (h,), "head": (h, v)})
    return {name: (np.ones(s) if len(s) == 1 else rng.normal(0.0, 0.02, s)).astype(np.float32)
            for name, s in shapes.items()}


def role(name: str) -> str:
    """``layers.1.mlp.up`` -> ``mlp.up``; every norm -> ``norm``."""
    parts = name.split(".")
    if parts[0] == "layers":
        parts = parts[2:]
    return "norm" if parts[-1] == "norm" else ".".join(parts)


def _rmsnorm(x, weight):
    # Zhang & Sennrich 2019, eq. 4, eps inside the root as Llama
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * weight


def loss_fn(params: dict[str, Any], tokens, model: dict[str, Any]):
    """Mean next-token cross-entropy of a pre-norm decoder over ``tokens`` (batch, seq + 1)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, s = inputs.shape
    heads = model["heads"]
    hd = model["hidden"] // heads
    x = params["embed"][inputs]
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    for i in range(model["layers"]):
        p = {r: params[f"layers.{i}.{r}"] for r in ("attn.norm", "attn.qkv", "attn.out",
                                                    "mlp.norm", "mlp.up", "mlp.down")}
        # qkv columns are grouped per head, (heads, 3, head_dim) as Megatron's fused QKV, so a
        # column split over tensor-parallel ranks gives each rank whole heads
        qkv = (_rmsnorm(x, p["attn.norm"]) @ p["attn.qkv"]).reshape(b, s, heads, 3, hd)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, heads * hd)
        x = x + attn @ p["attn.out"]
        x = x + jax.nn.gelu(_rmsnorm(x, p["mlp.norm"]) @ p["mlp.up"], approximate=False) @ p["mlp.down"]
    logits = _rmsnorm(x, params["norm"]) @ params["head"]
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))


def _spec(entries: list | None) -> PartitionSpec:
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in entries or []])


def _devices(n: int) -> list:
    """The default backend's devices if it has ``n`` (GPUs), else ``n`` host CPU devices."""
    devices = jax.devices()
    return devices[:n] if len(devices) >= n else jax.devices("cpu")[:n]


def train(run: dict[str, Any], model: dict[str, Any], tokens: np.ndarray, seed: int) -> dict[str, Any]:
    """One layout (``run["mesh"]`` None: unsharded on one device): losses, full parameters,
    each device's parameter bytes, the compiled step's HLO text, notes."""
    params = init_params(model, seed)
    lr = model["lr"]

    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, model)
        return {n: params[n] - lr * grads[n] for n in params}, loss

    notes = []
    if run["mesh"] is None:
        device = _devices(1)[0]
        placed = jax.device_put(params, device)
        batches = [jax.device_put(t, device) for t in tokens]
        jitted = jax.jit(step)
    else:
        axes, sizes = tuple(run["mesh"]), tuple(run["mesh"].values())
        # jax.make_mesh defaults to Explicit axes (JAX 0.10); Auto is classic GSPMD, where XLA's
        # sharding propagation inserts the collectives (Explicit needs out_sharding annotations)
        mesh = jax.make_mesh(sizes, axes, axis_types=(AxisType.Auto,) * len(axes),
                             devices=_devices(math.prod(sizes)))
        shardings = {n: NamedSharding(mesh, _spec(run["specs"].get(role(n)))) for n in params}
        batch_sharding = NamedSharding(mesh, _spec(run["batch"]))
        placed = {n: jax.device_put(a, shardings[n]) for n, a in params.items()}
        batches = [jax.device_put(t, batch_sharding) for t in tokens]
        # out_shardings keeps each updated parameter in its layout (else XLA may choose another)
        jitted = jax.jit(step, out_shardings=(shardings, NamedSharding(mesh, PartitionSpec())))
        notes.append(f"mesh {dict(zip(axes, sizes))} with AxisType.Auto on {mesh.devices.size} "
                     f"{mesh.devices.flat[0].platform} devices")
    compiled = jitted.lower(placed, batches[0]).compile()  # compiled once: run and read
    losses = []
    for batch in batches:
        placed, loss = compiled(placed, batch)
        losses.append(float(loss))
    memory: dict[int, int] = {}
    for array in placed.values():
        for shard in array.addressable_shards:
            memory[shard.device.id] = memory.get(shard.device.id, 0) + shard.data.nbytes
    return {"losses": losses, "params": {n: np.asarray(a) for n, a in placed.items()},
            "memory": [{"parameters": memory[d], "optimizer": 0} for d in sorted(memory)],
            "hlo": compiled.as_text(), "mesh": run["mesh"], "specs": run["specs"], "batch": run["batch"],
            "notes": notes + [f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}", "plain SGD: no optimizer state"]}


def pitfall(devices: int, seed: int) -> dict[str, Any]:
    """``jax.grad`` then ``lax.pmean`` in ``shard_map`` vs the unsharded gradient, and the fixes."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(4 * devices, 4)).astype(np.float32)
    y = rng.normal(size=(4 * devices,)).astype(np.float32)
    w = rng.normal(size=(4,)).astype(np.float32)
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,), devices=_devices(devices))
    P = PartitionSpec

    def loss(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    def data_parallel(grad_of, check_vma=True):
        mapped = jax.shard_map(grad_of, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                               out_specs=P(), check_vma=check_vma)
        return np.asarray(jax.jit(mapped)(w, x, y))

    def naive(w, x, y):  # what a new user writes
        return jax.lax.pmean(jax.grad(loss)(w, x, y), "data")

    def divided(w, x, y):  # the gradient is already a psum: divide it by N
        return jax.grad(loss)(w, x, y) / jax.lax.axis_size("data")

    def varying(w, x, y):  # make w per-device first: no automatic psum, the pmean does the mean
        return jax.lax.pmean(jax.grad(loss)(jax.lax.pcast(w, "data", to="varying"), x, y), "data")

    reference = np.asarray(jax.grad(loss)(w, x, y))
    bad = data_parallel(naive)
    return {"devices": devices, "reference": reference, "naive": bad,
            "ratio": float(np.mean(bad / reference)),
            "fixes": {"check_vma=False, then pmean": data_parallel(naive, check_vma=False),
                      "check_vma=True, divide by axis_size": data_parallel(divided),
                      "pcast(w, to='varying'), then pmean": data_parallel(varying)}}


def main() -> None:
    request = json.loads(sys.stdin.read())
    if request["kind"] == "train":
        tokens = np.asarray(request["tokens"], dtype=np.int32)
        result: Any = [train(run, request["model"], tokens, request["seed"]) for run in request["runs"]]
    else:
        result = pitfall(request["devices"], request["seed"])
    with open(sys.argv[1], "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main()
