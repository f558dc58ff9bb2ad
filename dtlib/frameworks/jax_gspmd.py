"""JAX/XLA automatic sharding (GSPMD) of a small transformer over a device mesh, next to dtlib.

A layout is a mesh (``{"data": 4, "model": 2}``) and one ``PartitionSpec`` per parameter *role*
(``embed``, ``attn.qkv``, ``attn.out``, ``mlp.up``, ``mlp.down``, ``norm``, ``head``): the
parameters are placed with ``NamedSharding``, the SGD step is ``jax.jit``-compiled, and XLA's
sharding propagation inserts the collectives (Xu et al. 2021, "GSPMD"). Nothing else is written by
hand, so the collectives read back from the compiled HLO are what XLA decided.

* :data:`LAYOUTS` - data parallel, FSDP, data x tensor (Megatron) and FSDP x tensor on 8 devices;
* :func:`run_jax` / :func:`run_layouts` / :func:`reference_run` - train a few steps in a
  subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (the flag is read when
  jax is imported, so a process that already imported jax cannot get more devices);
* :func:`hlo_collectives` - count the collectives in compiled HLO text;
* :func:`shard_map_pitfall` - "grad, then pmean" inside ``jax.shard_map`` gives N x the mean.

The model, the step and the subprocess's side live in :mod:`dtlib.frameworks.jax_worker`.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
from typing import Any

from dtlib.analytic import validate
from dtlib.extras import require
from dtlib.frameworks.common import FrameworkRun, token_batches

__all__ = ["MODEL", "ROLE_SHAPES", "AXES", "MAX_DEVICES", "LAYOUTS", "run_jax", "run_layouts",
           "reference_run", "hlo_collectives", "hlo_collective_calls", "validate_layout",
           "shard_map_pitfall"]

# The model: 2 pre-norm blocks (RMSNorm, causal attention, GELU MLP), no biases, no position
# embedding (the causal mask alone orders tokens: Haviv et al. 2022, "NoPE"), float32, SGD.
MODEL = {"layers": 2, "hidden": 32, "heads": 4, "ffn": 128, "seq": 16, "vocab": 64,
         "global_batch": 8, "lr": 0.1}
_H, _F, _V = MODEL["hidden"], MODEL["ffn"], MODEL["vocab"]
# Each role's shape, with its dims' names for error messages.
ROLE_SHAPES: dict[str, tuple[tuple[str, int], ...]] = {
    "embed": (("vocab", _V), ("hidden", _H)),
    "attn.qkv": (("hidden", _H), ("3*hidden", 3 * _H)),
    "attn.out": (("hidden", _H), ("hidden", _H)),
    "mlp.up": (("hidden", _H), ("ffn", _F)),
    "mlp.down": (("ffn", _F), ("hidden", _H)),
    "norm": (("hidden", _H),),
    "head": (("hidden", _H), ("vocab", _V)),
}
BATCH_SHAPE = (("global_batch", MODEL["global_batch"]), ("seq+1", MODEL["seq"] + 1))
# data: batch split, parameters replicated; fsdp: batch split and parameters sharded (ZeRO-3);
# model: tensor parallel (Megatron: column-split qkv/up, row-split out/down).
AXES = ("data", "fsdp", "model")
MAX_DEVICES = 8

Spec = list  # one entry per dim: None, an axis name, or a list of axis names


def _replicated() -> dict[str, Spec]:
    return {role: [None] * len(dims) for role, dims in ROLE_SHAPES.items()}


# Megatron's layout (Shoeybi et al. 2019, Sec. 3): qkv and up split by output columns, out and
# down by input rows, so each block needs one all-reduce after attention and one after the MLP.
_MEGATRON = {"attn.qkv": [None, "model"], "attn.out": ["model", None],
             "mlp.up": [None, "model"], "mlp.down": ["model", None]}
# FSDP (ZeRO-3) splits every parameter on its first dim; with TP, on the dim Megatron leaves whole.
_FSDP = {"embed": ["fsdp", None], "attn.qkv": ["fsdp", None], "attn.out": ["fsdp", None],
         "mlp.up": ["fsdp", None], "mlp.down": ["fsdp", None], "norm": ["fsdp"], "head": ["fsdp", None]}
_FSDP_TP = {"embed": ["fsdp", None], "attn.qkv": ["fsdp", "model"], "attn.out": ["model", "fsdp"],
            "mlp.up": ["fsdp", "model"], "mlp.down": ["model", "fsdp"], "norm": ["fsdp"],
            "head": ["fsdp", None]}
# data 4 x model 2, not 2 x 4: tensor parallelism stays small and innermost, as Megatron keeps it
# inside a node, each rank keeps 2 whole heads of 4, and TP 2 is the size lesson 05 measures.
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp": {"mesh": {"data": 8}, "specs": _replicated(), "batch": ["data", None]},
    "fsdp": {"mesh": {"fsdp": 8}, "specs": _FSDP, "batch": ["fsdp", None]},
    "dp_tp": {"mesh": {"data": 4, "model": 2}, "specs": {**_replicated(), **_MEGATRON},
              "batch": ["data", None]},
    "fsdp_tp": {"mesh": {"fsdp": 4, "model": 2}, "specs": _FSDP_TP, "batch": ["fsdp", None]},
}


def _axes_of(entry: Any) -> list:
    return [] if entry is None else [entry] if isinstance(entry, str) else list(entry)


def _check_spec(where: str, spec: Any, dims: tuple[tuple[str, int], ...], mesh: dict[str, int]) -> None:
    if not isinstance(spec, (list, tuple)) or len(spec) != len(dims):
        names = ", ".join(name for name, _ in dims)
        raise ValueError(f"{where} must be a list with one entry per dim ({names}), got {spec!r}")
    used: set[str] = set()
    for (dim, size), entry in zip(dims, spec):
        if not (entry is None or isinstance(entry, str)
                or isinstance(entry, (list, tuple)) and all(isinstance(a, str) for a in entry)):
            raise ValueError(f"{where}: dim {dim} must be None, an axis name or a list of axis "
                             f"names, got {entry!r}")
        for axis in _axes_of(entry):
            if axis not in mesh:
                raise ValueError(f"{where}: unknown axis {axis!r} on dim {dim}; the mesh has "
                                 f"{sorted(mesh)}")
            if axis in used:
                raise ValueError(f"{where}: axis {axis!r} is used twice in one spec")
            used.add(axis)
        ways = math.prod(mesh[a] for a in _axes_of(entry))
        if size % ways:
            raise ValueError(f"{where}: dim {dim} of size {size} is not divisible by {ways} "
                             f"(axes {_axes_of(entry)})")


def validate_layout(mesh: dict[str, int], specs: dict[str, Spec], batch_spec: Spec | None = None) -> Spec:
    """Check a layout before any process starts; return the batch spec (default: the batch split
    over every ``data`` and ``fsdp`` axis of the mesh). Each error names the role, axis or dim."""
    if not isinstance(mesh, dict) or not mesh:
        raise ValueError(f"mesh must be a non-empty dict of axis sizes, e.g. {{'data': 8}}, got {mesh!r}")
    for axis, size in mesh.items():
        if axis not in AXES:
            raise ValueError(f"mesh: unknown axis {axis!r}; valid axes: {', '.join(AXES)}")
        validate.integer(f"mesh[{axis!r}]", size)
    devices = math.prod(mesh.values())
    if devices > MAX_DEVICES:
        raise ValueError(f"mesh {mesh} needs {devices} devices; at most {MAX_DEVICES} host devices")
    if not isinstance(specs, dict):
        raise ValueError(f"specs must be a dict of role -> spec, got {type(specs).__name__}")
    for role, spec in specs.items():
        if role not in ROLE_SHAPES:
            raise ValueError(f"specs: unknown role {role!r}; valid roles: {', '.join(ROLE_SHAPES)}")
        _check_spec(f"specs[{role!r}]", spec, ROLE_SHAPES[role], mesh)
    if batch_spec is None:
        split = [a for a in mesh if a != "model"]
        batch_spec = [split[0] if len(split) == 1 else split or None, None]
    _check_spec("batch_spec", batch_spec, BATCH_SHAPE, mesh)
    return [list(e) if isinstance(e, (list, tuple)) else e for e in batch_spec]


# HLO op name -> torch.distributed's spelling. A collective-permute sends one buffer to one peer
# and receives one (send + recv); it is counted as one "send".
_HLO_OPS = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
            "all-to-all": "all_to_all", "collective-permute": "send"}
# `%name = shape op(` or `op-start(`: the async `-done` half is not a second call.
_CALL = re.compile(r"=\s*(.*?)\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                   r"(?:-start)?\(")
# replica_groups in the three spellings XLA prints: explicit {{0,1},{2,3}}; iota [groups,size]<=[...];
# mesh['axis_0'=4,'axis_1'=2] {'axis_0'} (the group spans the axes in braces)
_EXPLICIT = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]<=")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
# JAX's metadata names autodiff's backward ops transpose(jvp(...))
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_ARRAY = re.compile(r"\b(f64|f32|bf16|f16|s64|s32|u32|s8|u8|pred)\[([\d,]*)\]")
_BYTES = {"f64": 8, "s64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}


def hlo_collective_calls(hlo_text: str) -> list[dict[str, Any]]:
    """Every collective in HLO text, in order: ``op`` (torch spelling), ``group_size`` (devices in
    each replica group; None when the line does not say, as for a collective-permute),
    ``bytes`` of its result (a combined collective's tuple summed; an async ``-start``'s tuple
    also holds its input) and ``backward`` (JAX's ``op_name`` metadata names a ``transpose``,
    autodiff's backward pass; False without metadata)."""
    calls = []
    for line in hlo_text.splitlines():
        found = _CALL.search(line)
        if not found:
            continue
        shape, op = found.groups()
        op_name = _OP_NAME.search(line)
        calls.append({"op": _HLO_OPS[op], "group_size": _group_size(line), "bytes": _bytes(shape),
                      "backward": bool(op_name and "transpose(" in op_name.group(1))})
    return calls


def _group_size(line: str) -> int | None:
    if found := _EXPLICIT.search(line):
        return found.group(1).count(",") + 1
    if found := _IOTA.search(line):
        return int(found.group(1))
    if found := _MESH.search(line):
        sizes = {name: int(size) for name, size in re.findall(r"'(\w+)'=(\d+)", found.group(1))}
        return math.prod(sizes[name] for name in re.findall(r"'(\w+)'", found.group(2)))
    return None  # replica_groups={} (all devices) or not printed


def _bytes(shape: str) -> int:
    """Bytes of an HLO result shape, e.g. ``f32[2,16,32]{2,1,0}`` or a tuple of them."""
    return sum(_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in _ARRAY.findall(shape))


def hlo_collectives(hlo_text: str) -> dict[str, int]:
    """How many times each collective appears in compiled HLO text (``all_reduce``, ``all_gather``,
    ``reduce_scatter``, ``all_to_all``, ``send``); an async ``-start``/``-done`` pair counts once."""
    counts: dict[str, int] = {}
    for call in hlo_collective_calls(hlo_text):
        counts[call["op"]] = counts.get(call["op"], 0) + 1
    return counts


def _check_run_args(steps: Any, seed: Any, timeout: Any) -> None:
    validate.integer("steps", steps)
    validate.integer("seed", seed, minimum=0)
    validate.number("timeout", timeout)


def _subprocess(request: dict[str, Any], devices: int, timeout: float) -> Any:
    """Run :mod:`dtlib.frameworks.jax_worker` with ``devices`` host devices; return its result."""
    require("frameworks", "jax", feature="dtlib.frameworks.jax_gspmd")  # said here, not in the worker's traceback
    env = dict(os.environ)
    # read by XLA when jax is imported: N CPU devices in one process (ignored by a GPU backend).
    # Backend optimization level 0 (default 3) skips LLVM's optimization of the generated code,
    # half the CPU time of a run this small; the HLO passes that insert, combine and place the
    # collectives (SPMD partitioner, all-reduce combiner) run as before.
    flags = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    with tempfile.TemporaryDirectory(prefix="dtlib-jax-") as tmp:
        out = os.path.join(tmp, "result.pkl")
        try:
            done = subprocess.run([sys.executable, "-m", "dtlib.frameworks.jax_worker", out],
                                  input=json.dumps(request), capture_output=True, text=True,
                                  env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the JAX run did not finish within timeout={timeout} s") from None
        if done.returncode != 0:
            raise RuntimeError(f"the JAX run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        with open(out, "rb") as f:
            return pickle.load(f)  # written by our own child process just now


def _to_run(name: str, result: dict[str, Any]) -> FrameworkRun:
    counts = [hlo_collectives(result["hlo"])] * len(result["memory"])  # SPMD: one program per device
    settings = {"mesh": result["mesh"], "specs": result["specs"], "batch": result["batch"],
                "model": dict(MODEL), "steps": len(result["losses"]),
                "hlo_collectives": hlo_collective_calls(result["hlo"])}
    return FrameworkRun("jax", name, result["losses"], result["params"], result["memory"], counts,
                        settings, result["notes"])


def _request(name: str, mesh: dict[str, int] | None, specs: dict[str, Spec] | None,
             batch_spec: Spec | None) -> dict[str, Any]:
    return {"name": name, "mesh": mesh, "specs": specs, "batch": batch_spec}


def _layout_name(mesh: dict[str, int]) -> str:
    return "x".join(f"{axis}{size}" for axis, size in mesh.items())


def _train(requests: list[dict[str, Any]], steps: int, seed: int, timeout: float) -> dict[str, FrameworkRun]:
    devices = max(math.prod((r["mesh"] or {}).values()) for r in requests)
    data = token_batches(steps, MODEL["global_batch"], MODEL["seq"], MODEL["vocab"], seed)
    results = _subprocess({"kind": "train", "runs": requests, "seed": seed, "model": MODEL,
                           "tokens": data.tolist()}, devices, timeout)
    return {r["name"]: _to_run(r["name"], res) for r, res in zip(requests, results)}


def run_jax(mesh: dict[str, int], specs: dict[str, Spec], batch_spec: Spec | None = None,
            steps: int = 3, *, seed: int = 0, timeout: float = 120.0) -> FrameworkRun:
    """Train :data:`MODEL` for ``steps`` SGD steps with each role's parameters placed per
    ``specs`` (a missing role is replicated) on a mesh of ``prod(mesh)`` host devices, in a
    subprocess. Returns losses, full parameters, each device's parameter bytes and the
    collectives of one compiled step (also listed with group sizes in
    ``settings["hlo_collectives"]``)."""
    batch_spec = validate_layout(mesh, specs, batch_spec)
    _check_run_args(steps, seed, timeout)
    name = _layout_name(mesh)
    return _train([_request(name, mesh, specs, batch_spec)], steps, seed, timeout)[name]


def run_layouts(names: tuple[str, ...] = tuple(LAYOUTS), steps: int = 3, *, seed: int = 0,
                timeout: float = 120.0) -> dict[str, FrameworkRun]:
    """Several of :data:`LAYOUTS` and the unsharded reference (key ``"reference"``, on device 0
    alone) in one subprocess: jax is imported once."""
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layout(s) {unknown}; valid layouts: {', '.join(LAYOUTS)}")
    _check_run_args(steps, seed, timeout)
    requests = [_request("reference", None, None, None)]
    for n in names:
        layout = LAYOUTS[n]
        batch = validate_layout(layout["mesh"], layout["specs"], layout["batch"])
        requests.append(_request(n, layout["mesh"], layout["specs"], batch))
    return _train(requests, steps, seed, timeout)


def reference_run(steps: int = 3, seed: int = 0, *, timeout: float = 120.0) -> FrameworkRun:
    """The unsharded run: the same initialisation and data, one device, no mesh."""
    _check_run_args(steps, seed, timeout)
    return _train([_request("reference", None, None, None)], steps, seed, timeout)["reference"]


def shard_map_pitfall(devices: int = 8, seed: int = 0, *, timeout: float = 60.0) -> dict[str, Any]:
    """The data-parallel gradient of a least-squares loss written with ``jax.shard_map`` as a new
    user writes it -- ``jax.grad`` on the local batch, then ``lax.pmean`` -- next to the
    unsharded gradient and three fixes. With the default ``check_vma=True`` the gradient of a
    replicated parameter is already summed over devices (the transpose of its implicit
    broadcast is a ``psum``), so the extra ``pmean`` leaves ``devices`` x the mean.

    Returns ``reference`` and ``naive`` gradients, ``ratio`` (naive / reference, elementwise
    mean) and ``fixes``: name -> gradient."""
    validate.integer("devices", devices, minimum=2, maximum=MAX_DEVICES)
    _check_run_args(1, seed, timeout)
    return _subprocess({"kind": "pitfall", "devices": devices, "seed": seed}, devices, timeout)
