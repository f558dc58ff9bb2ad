"""Megatron-Core's tensor-parallel layers, ``GPTModel`` and pipeline schedules, next to one process.

:func:`run_megatron` trains a tiny Megatron-Core ``GPTModel`` (local layer spec: Megatron's own
PyTorch modules, no Transformer Engine) -- or, with ``model="mlp"``, one
``ColumnParallelLinear -> GELU -> RowParallelLinear`` block -- on ``tp x pp x dp`` ranks, the way
Megatron-LM's ``pretrain_gpt.py`` does: ``parallel_state.initialize_model_parallel``, each model
chunk wrapped in Megatron's ``DistributedDataParallel``, the pipeline run by
``get_forward_backward_func()`` (1F1B, or interleaved 1F1B with ``virtual_stages > 1``) with
``finalize_model_grads`` reducing the gradients, and plain SGD (so a gradient off by any factor
shows in the parameters). It returns a :class:`~dtlib.frameworks.common.FrameworkRun` whose
parameters are gathered back to full tensors under the names of the ``tp = pp = dp = 1`` model,
so ``compare(run, run_megatron())`` is the side-by-side test. The reference is
``run_megatron()`` itself: the same code on one rank, where Megatron skips every collective.

On CPU ranks (gloo) the shims of :mod:`dtlib.frameworks.megatron_cpu` are applied inside each
rank and listed in the run's ``notes``; ranks with one GPU each (NCCL) patch nothing.
"""
from __future__ import annotations

from dtlib.extras import require

require("frameworks", "megatron.core", feature=__name__)

import zlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.analytic import validate
from dtlib.frameworks.common import FrameworkRun, token_batches
from dtlib.frameworks.megatron_cpu import cpu_shims, gpt_block_spec, needs_cpu_shims
from dtlib.frameworks.megatron_flags import (check_settings, ddp_config, parse_megatron_flags,
                                             transformer_config)
from dtlib.launcher import MAX_TIMEOUT, launch
from dtlib.measure import CollectiveCounter, optimizer_state_bytes

__all__ = ["run_megatron", "run_megatron_flags", "executed_order", "schedule_order", "LR",
           "DECISIONS"]

# learning rates: large enough that a wrong gradient moves the parameters visibly within 3 steps
LR = {"sgd": 0.5, "adam": 1e-2}


_EMBEDDING = "embedding.word_embeddings.weight"

# what dtlib decides for every run, beyond the CPU shims (FrameworkRun.notes)
DECISIONS = [
    "initial weights drawn per parameter name (the same full weights for every layout)",
    "dropout 0: runs differ only by their arithmetic",
    "Megatron's optimizer as plain SGD/Adam: sgd_momentum 0, weight_decay 0, clip_grad 0 "
    "(OptimizerConfig defaults 0.9, 0.01 and 1.0)",
    "the causal attention mask passed explicitly, as Megatron-LM's data loader does",
]


def _init_full(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The initial full value of parameter ``name``: drawn from a generator seeded by ``seed`` and
    the name, so every layout starts from the same weights (Megatron's own initialisation draws
    from one stream whose order depends on which layers a pipeline stage builds)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    value = 0.02 * torch.randn(shape, generator=g)  # Megatron's init_method_std default (0.02)
    return value + 1.0 if name.endswith("norm.weight") else value  # norms start near the identity


def _global_name(name: str, layer_numbers: dict[int, int]) -> str:
    """``name`` of a stage's parameter in the ``pp = 1`` model: DDP's ``module.`` prefix dropped and
    the stage-local layer index replaced by the global one (``layer_number`` - 1)."""
    name = name.removeprefix("module.")
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(layer_numbers[int(parts[2])])
    return ".".join(parts)


def _layer_numbers(chunk: torch.nn.Module) -> dict[int, int]:
    decoder = getattr(chunk.module, "decoder", None)
    return {} if decoder is None else {i: layer.layer_number - 1 for i, layer in enumerate(decoder.layers)}


def _tp_slice(full: torch.Tensor, p: torch.nn.Parameter, tp: int, tp_rank: int) -> torch.Tensor:
    """This rank's slab of ``full`` along Megatron's ``partition_dim`` (replicated: all of it)."""
    if not getattr(p, "tensor_model_parallel", False):
        return full
    return full.chunk(tp, dim=p.partition_dim)[tp_rank]


def _full_shape(p: torch.nn.Parameter, tp: int) -> tuple[int, ...]:
    shape = list(p.shape)
    if getattr(p, "tensor_model_parallel", False):
        shape[p.partition_dim] *= tp
    return tuple(shape)


def _gather_tp(p: torch.Tensor, group: Any, tp: int) -> torch.Tensor:
    """The full parameter: the ``tp`` slabs all-gathered and concatenated along ``partition_dim``."""
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return p.detach().clone()
    slabs = [torch.empty_like(p) for _ in range(tp)]
    dist.all_gather(slabs, p.detach().contiguous(), group=group)
    return torch.cat(slabs, dim=p.partition_dim)


class _MLPBlock(torch.nn.Module):
    """Embedding (fixed) -> ColumnParallelLinear -> GELU -> RowParallelLinear -> cross-entropy over
    the vocabulary: the tensor-parallel pair of Shoeybi et al. 2019, Sec. 3, in Megatron's layers."""

    def __init__(self, config: Any, vocab_size: int, seed: int):
        from megatron.core import tensor_parallel

        super().__init__()
        self.config = config
        h = config.hidden_size
        init = torch.nn.init.zeros_  # overwritten by _init_full, as every parameter is
        # a fixed input embedding, scaled from std 0.02 to 1: unit-size inputs to the block
        self.register_buffer("table", _init_full("table", (vocab_size, h), seed) * 50.0)
        self.linear_fc1 = tensor_parallel.ColumnParallelLinear(
            h, 4 * h, config=config, init_method=init, bias=True, gather_output=False)
        self.linear_fc2 = tensor_parallel.RowParallelLinear(
            4 * h, vocab_size, config=config, init_method=init, bias=True, input_is_parallel=True,
            skip_bias_add=False)

    def set_input_tensor(self, tensor: Any) -> None:  # the schedules call it; one stage only
        pass

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state, tensor_parallel

        x = self.table[tokens].transpose(0, 1).contiguous()  # Megatron's [s, b, h]
        if self.config.sequence_parallel:  # this rank's sequence shard
            tp, rank = self.config.tensor_model_parallel_size, parallel_state.get_tensor_model_parallel_rank()
            x = x.chunk(tp, dim=0)[rank]
        y, _ = self.linear_fc1(x)
        logits, _ = self.linear_fc2(F.gelu(y))
        if self.config.sequence_parallel:  # as GPTModel's output layer: gather, split the grad back
            logits = tensor_parallel.gather_from_sequence_parallel_region(
                logits, tensor_parallel_output_grad=False)
        losses = F.cross_entropy(logits.flatten(0, 1), labels.transpose(0, 1).flatten(), reduction="none")
        return losses.view(labels.shape[1], labels.shape[0]).transpose(0, 1)  # [b, s] as GPTModel


def _build_chunks(s: dict[str, Any], config: Any) -> list[torch.nn.Module]:
    """This rank's model chunks (``virtual_stages`` of them), each in Megatron's DDP wrapper."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel

    chunks = []
    for vp in range(s["virtual_stages"]):
        if s["model"] == "mlp":
            module = _MLPBlock(config, s["vocab_size"], s["seed"])
            module.table = module.table.to(module.linear_fc1.weight.device)
        else:
            vp_stage = vp if s["virtual_stages"] > 1 else None
            module = GPTModel(
                config=config, transformer_layer_spec=gpt_block_spec(config, vp_stage),
                vocab_size=s["vocab_size"], max_sequence_length=s["seq_length"],
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=not s["untie_embeddings_and_output_weights"],
                vp_stage=vp_stage)
        module.model_type = ModelType.encoder_or_decoder
        if torch.cuda.is_available() and not needs_cpu_shims():
            # on a GPU: the layers Megatron builds with plain torch.nn (position embeddings, norms)
            # start on the CPU; Megatron-LM's get_model moves each chunk before wrapping it in DDP
            module.cuda(torch.cuda.current_device())
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config(s), module=module)
        ddp.chunk_id = vp
        chunks.append(ddp)
    return chunks


def _load_initial(chunks: list[torch.nn.Module], s: dict[str, Any], tp_rank: int) -> None:
    with torch.no_grad():
        for chunk in chunks:
            numbers = _layer_numbers(chunk)
            for name, p in chunk.named_parameters():
                # a tied output layer on the last stage is Megatron's copy of the word embeddings
                name = _EMBEDDING if getattr(p, "shared_embedding", False) else _global_name(name, numbers)
                full = _init_full(name, _full_shape(p, s["tp"]), s["seed"])
                p.copy_(_tp_slice(full, p, s["tp"], tp_rank))


def _microbatches(data: torch.Tensor, step: int, s: dict[str, Any], dp_rank: int):
    """This data-parallel rank's micro-batches of one step, as Megatron-LM's
    ``MegatronPretrainingSampler`` deals them: micro-batch ``k`` of rank ``r`` is rows
    ``[(k dp + r) mbs, (k dp + r + 1) mbs)`` of the global batch."""
    mbs, dp = s["micro_batch_size"], s["dp"]
    for k in range(s["num_microbatches"]):
        start = (k * dp + dp_rank) * mbs
        rows = data[step, start:start + mbs]
        yield k, rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _worker(rank: int, world_size: int, s: dict[str, Any], data: np.ndarray) -> dict[str, Any]:
    with cpu_shims() as notes:
        device = torch.device("cpu") if notes else torch.device("cuda", torch.cuda.current_device())
        return _train(s, torch.from_numpy(data).to(device), notes)


def _train(s: dict[str, Any], data: torch.Tensor, notes: list[str]) -> dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=s["tp"], pipeline_model_parallel_size=s["pp"],
        virtual_pipeline_model_parallel_size=s["virtual_stages"] if s["virtual_stages"] > 1 else None)
    if not notes:  # on a GPU: the CUDA RNG states Megatron forks while initialising weights, as
        # Megatron-LM's initialize.py (_set_random_seed) registers them (the CPU shims stub them)
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(s["seed"])
    try:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        dp_rank = parallel_state.get_data_parallel_rank()
        config = transformer_config(s)
        chunks = _build_chunks(s, config)
        _load_initial(chunks, s, tp_rank)
        config.finalize_model_grads_func = finalize_model_grads  # as Megatron-LM's training.py
        optimizer = _optimizer(chunks, s)
        order: list[str] = []
        positions = torch.arange(s["seq_length"], device=data.device).unsqueeze(0)
        # the causal mask, True where attention is masked out, passed as Megatron-LM's data loader
        # does (get_ltor_masks_and_position_ids); without it Megatron builds one on "cuda"
        # (transformer/utils.py get_default_causal_mask), also while recomputing in backward,
        # where the device shim is not active
        mask = torch.ones(s["seq_length"], s["seq_length"], device=data.device).triu(1).bool()[None, None]

        def forward_step(iterator: Any, chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            k, tokens, labels = next(iterator)
            order.append(f"F{k}" + (f".{chunk.chunk_id}" if chunk.chunk_id else ""))
            if s["model"] == "mlp":
                out = chunk(tokens, labels)
            else:
                out = chunk(tokens, positions.expand_as(tokens), mask, labels=labels)
            tag = f"B{k}" + (f".{chunk.chunk_id}" if chunk.chunk_id else "")
            out.register_hook(lambda grad: order.append(tag) or grad)
            return out, _loss

        losses, counts = [], {}
        for step in range(s["steps"]):
            for chunk in chunks:
                chunk.zero_grad_buffer()
            order.clear()
            iterators = [_microbatches(data, step, s, dp_rank) for _ in chunks]
            optimizer.zero_grad()
            with CollectiveCounter() as counter:
                reduced = get_forward_backward_func()(
                    forward_step_func=forward_step,
                    data_iterator=iterators if len(chunks) > 1 else iterators[0],
                    model=chunks if len(chunks) > 1 else chunks[0],
                    num_microbatches=s["num_microbatches"], seq_length=s["seq_length"],
                    micro_batch_size=s["micro_batch_size"], forward_only=False)
                optimizer.step()
            counts = dict(counter.counts)
            losses.append([float(r["lm loss"]) for r in reduced])
        full = _gather_full(chunks, s)  # every TP rank takes part in the all-gather
        keep = dp_rank == 0 and tp_rank == 0  # one copy of each stage's parameters comes back
        return {"losses": losses, "params": full if keep else {}, "memory": _memory(chunks, optimizer),
                "collectives": counts, "order": list(order), "notes": notes,
                "last_stage": parallel_state.is_pipeline_last_stage(ignore_virtual=True),
                "tp_rank": tp_rank, "dp_rank": dp_rank,
                "pp_rank": parallel_state.get_pipeline_model_parallel_rank()}
    finally:
        parallel_state.destroy_model_parallel()


def _optimizer(chunks: list[torch.nn.Module], s: dict[str, Any]) -> Any:
    """Megatron's own optimizer, as plain SGD (or Adam): its defaults (SGD momentum 0.9, weight
    decay 0.01, gradient clipping at norm 1.0) would each change the numbers a gradient check
    compares, so all three are turned off."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(optimizer=s["optimizer"], lr=LR[s["optimizer"]], sgd_momentum=0.0,
                             weight_decay=0.0, clip_grad=0.0,
                             use_distributed_optimizer=s["use_distributed_optimizer"])
    return get_megatron_optimizer(config, chunks)


def _loss(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean loss of a micro-batch; the logged copy is a clone because the schedule divides the
    returned loss by ``num_microbatches`` in place (schedules.py, forward_step_calc_loss)."""
    loss = per_token.float().mean()
    return loss, {"lm loss": loss.detach().clone()}


def _memory(chunks: list[torch.nn.Module], optimizer: Any) -> dict[str, int]:
    """Bytes this rank holds: its parameter slabs, its gradient buffer (Megatron's DDP keeps
    gradients in one contiguous ``main_grad`` buffer per chunk) and the state of the torch
    optimizer(s) Megatron's optimizer wraps (none for plain SGD; Adam's two moments)."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    wrapped = getattr(optimizer, "chained_optimizers", [optimizer])
    return {"parameters": sum(p.numel() * p.element_size() for p in params),
            "gradients": sum(p.main_grad.numel() * p.main_grad.element_size() for p in params),
            "optimizer": sum(optimizer_state_bytes(o.optimizer)["optimizer"] for o in wrapped)}


def _gather_full(chunks: list[torch.nn.Module], s: dict[str, Any]) -> dict[str, np.ndarray]:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for chunk in chunks:
        numbers = _layer_numbers(chunk)
        for name, p in chunk.named_parameters():
            name = _global_name(name, numbers)
            if name != _EMBEDDING and getattr(p, "shared_embedding", False):
                continue  # the last stage's copy of the tied word embeddings: the first stage has it
            out[name] = _gather_tp(p, group, s["tp"]).cpu().numpy()
    return out


def _import_megatron() -> None:
    """Import Megatron-Core in the launching process (~4 s), so the forked ranks inherit it
    instead of each importing it again."""
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401


def run_megatron(*, tp: int = 1, pp: int = 1, dp: int = 1, sequence_parallel: bool = False,
                 virtual_stages: int = 1, micro_batch_size: int = 1, num_microbatches: int = 1,
                 steps: int = 3, batch_p2p_comm: bool = False, model: str = "gpt", seed: int = 0,
                 num_layers: int = 4, hidden_size: int = 32, num_attention_heads: int = 4,
                 seq_length: int = 16, vocab_size: int = 64, optimizer: str = "sgd",
                 context_parallel_size: int = 1, use_distributed_optimizer: bool = False,
                 overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                 recompute_granularity: str | None = None, recompute_method: str | None = None,
                 recompute_num_layers: int | None = None,
                 untie_embeddings_and_output_weights: bool = True,
                 timeout: float = 120.0) -> FrameworkRun:
    """Train Megatron-Core's ``GPTModel`` (or ``model="mlp"``: its column/row-parallel pair) for
    ``steps`` steps on ``tp x pp x dp`` CPU ranks (NCCL with one GPU per rank where there are
    enough GPUs) and return the :class:`FrameworkRun`.

    The global batch is ``dp x micro_batch_size x num_microbatches`` sequences of
    :func:`~dtlib.frameworks.common.token_batches` (Megatron's rule); ``losses`` are the global mean
    loss of each step, ``params`` the full final parameters under the ``tp = pp = 1`` model's
    names, ``memory``/``collectives`` per rank (the collectives of the last step, optimizer step
    included), ``notes`` the shims applied and, one line per rank, the order of forward (``F``)
    and backward (``B``) micro-batch passes the schedule ran in the last step (``F3.1``:
    micro-batch 3 on model chunk 1), read back by :func:`executed_order`. ``batch_p2p_comm``
    defaults to False, unlike Megatron-Core's ``ModelParallelConfig``: with True, interleaved
    pp = 2 is silently wrong on gloo (see the module docstring of
    :mod:`dtlib.frameworks.megatron_flags`). Invalid settings raise ``ValueError`` naming the
    argument before any process starts. The reference run is ``run_megatron()`` with the same
    batch: the same code on one rank.
    """
    s = dict(tp=tp, pp=pp, dp=dp, sequence_parallel=sequence_parallel, virtual_stages=virtual_stages,
             micro_batch_size=micro_batch_size, num_microbatches=num_microbatches, steps=steps,
             batch_p2p_comm=batch_p2p_comm, model=model, seed=seed, num_layers=num_layers,
             hidden_size=hidden_size, num_attention_heads=num_attention_heads,
             seq_length=seq_length, vocab_size=vocab_size, optimizer=optimizer,
             context_parallel_size=context_parallel_size,
             use_distributed_optimizer=use_distributed_optimizer,
             overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
             recompute_granularity=recompute_granularity, recompute_method=recompute_method,
             recompute_num_layers=recompute_num_layers,
             untie_embeddings_and_output_weights=untie_embeddings_and_output_weights)
    check_settings(s)
    validate.number("timeout", timeout, maximum=MAX_TIMEOUT)
    data = token_batches(steps, dp * micro_batch_size * num_microbatches, seq_length, vocab_size, seed)
    _import_megatron()
    results = launch(_worker, tp * pp * dp, args=(s, data), timeout=timeout, output="none")
    params: dict[str, np.ndarray] = {}
    for r in results:
        params.update(r["params"])
    last = [r["losses"] for r in results if r["last_stage"] and r["tp_rank"] == 0]
    losses = [float(np.mean([np.mean(rank[step]) for rank in last])) for step in range(steps)]
    order = [f"pipeline rank {r['pp_rank']} ran: {' '.join(r['order'])}" for r in results
             if r["tp_rank"] == 0 and r["dp_rank"] == 0]
    layout = f"tp{tp} pp{pp} dp{dp}" + (" sp" if sequence_parallel else "") + \
             (f" vp{virtual_stages}" if virtual_stages > 1 else "")
    return FrameworkRun(framework="megatron-core", layout=layout, losses=losses, params=params,
                        memory=[r["memory"] for r in results],
                        collectives=[r["collectives"] for r in results], settings=s,
                        notes=[*results[0]["notes"], *DECISIONS, *order])


def executed_order(run: FrameworkRun) -> list[list[str]]:
    """Per pipeline rank, the forward/backward passes ``run``'s last step ran, in order, spelled
    as :class:`dtlib.parallel.schedules.Action` prints (``F0``, ``B1``, ``F2.1``)."""
    prefix = "pipeline rank "
    lines = sorted((int(n.split()[2]), n.split(": ", 1)[1]) for n in run.notes if n.startswith(prefix))
    return [text.split() for _, text in lines]


def schedule_order(pp: int, num_microbatches: int, virtual_stages: int = 1) -> list[list[str]]:
    """The order of forward/backward micro-batch passes Megatron's schedule
    (``get_forward_backward_func``) runs on each of ``pp`` pipeline ranks, recorded in the
    ``forward_step_func`` and by a gradient hook on each stage's output (one training step of a
    GPTModel with one layer per model chunk)."""
    run = run_megatron(pp=pp, virtual_stages=virtual_stages, num_microbatches=num_microbatches,
                       num_layers=pp * virtual_stages, steps=1)
    return executed_order(run)


def run_megatron_flags(flags: str | list[str], world_size: int, steps: int = 3) -> FrameworkRun:
    """Megatron-LM ``flags`` on ``world_size`` ranks, parsed and checked by
    :func:`~dtlib.frameworks.megatron_flags.parse_megatron_flags`, run by :func:`run_megatron`;
    ``settings["flags"]`` keeps the flags as given."""
    run = run_megatron(**parse_megatron_flags(flags, world_size), steps=steps)
    run.settings["flags"] = flags if isinstance(flags, str) else " ".join(flags)
    return run
