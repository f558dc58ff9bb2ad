"""Memory per GPU during training, on the most loaded GPU.

``memory_per_gpu(model, layout)`` breaks the bytes down into parameters, gradients, optimizer
states, activations, and (separately labelled) temporary buffers and framework overhead:

* model states follow a :class:`~dtlib.analytic.precision.Precision` convention (ZeRO paper 16 B/param by
  default); ZeRO stage 1/2/3 shard optimizer / +gradients / +parameters over the *data-parallel*
  group (Rajbhandari et al. 2020, Sec. 5, eq. for Pos, Pos+g, Pos+g+p), never the whole GPU count;
* tensor parallelism splits weight matrices and the vocabulary, replicating norms and row-parallel
  biases (Megatron-LM, Shoeybi et al. 2019, Sec. 3); pipeline stages hold their layers, the first
  the embedding and the last the LM head (Narayanan et al. 2021); experts are split over ``ep``;
* activations follow :mod:`dtlib.analytic.activations` (Korthikanti et al. 2022) with the micro-batches
  in flight of the pipeline schedule.

Every pipeline rank that can be the most loaded is evaluated (:func:`dtlib.analytic.stages.candidate_ranks`:
the first, the last, and the middle ranks where the mix of dense and MoE layers changes; each with
its own layers and micro-batches in flight) and the heaviest is reported, with its ``stage``. Every formula
accepts numpy arrays: :mod:`dtlib.analytic.vectorised` calls :func:`per_gpu_bytes` on arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dtlib.analytic import validate
from dtlib.analytic.units import GB, GiB
from dtlib.analytic.activations import activation_breakdown
from dtlib.analytic.hardware import Accelerator, get_gpu
from dtlib.analytic.config import TransformerConfig, attention_params, mlp_params, norm_params
from dtlib.analytic.finetune import FineTuning, adapter_layer_params, check_targets, resolve_finetune
from dtlib.analytic.presets import Training, activation_convention, get_preset
from dtlib.analytic.layout import Parallelism, check_layout, chunks_per_rank
from dtlib.analytic.stages import candidate_ranks, holds_ends, on_structures, rank_layers, stored_on_rank
from dtlib.analytic.precision import NVFP4_BYTES, OPERAND_BYTES, Precision, get_precision
from dtlib.analytic.stacks import Stack, get_stack

# the model keys activation_breakdown averages its layers over (TransformerConfig.numbers)
_MODEL_KINDS = ("layers", "moe_layers", "sliding_layers", "sliding_window", "moe_ffn", "shared_experts",
                "capacity_factor", "etp", "head_dim", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim")

__all__ = ["memory_per_gpu", "MemoryBreakdown", "per_gpu_bytes", "stage_parameters", "rank_parameters",
           "model_state_bytes", "model_numbers", "memory_options", "stack_storage", "GiB", "GB"]



def model_numbers(cfg: TransformerConfig, seq: int | None = None) -> dict[str, Any]:
    """The numbers the formulas read from a config (:meth:`TransformerConfig.numbers`)."""
    return cfg.numbers(seq)


def _layer_blocks(*, hidden, heads, kv_heads, ffn, vocab, seq, mlp_matrices, bias, norm_has_bias, experts,
                  learned_positions, embedding_norm, tied, layers, tp=1, pp=1, ep=1, etp=1, moe_ffn=None,
                  shared_experts=0, moe_layers=0, head_dim=None, q_lora_rank=0, kv_lora_rank=0,
                  qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0, qk_norm=0, sinks=0, router_bias=0,
                  **_unused) -> dict[str, Any]:
    """Parameters on one GPU of one dense layer, of an MoE layer's non-expert part and of its
    experts, of the embedding and of the LM head, and the largest block (:func:`stage_parameters`).
    The q/k norms and a router bias are replicated over TP, the sinks split with the heads
    (Megatron-Core: ``q_layernorm``/``k_layernorm`` of the head size, ``softmax_offset`` per local head)."""
    moe_ffn = ffn if moe_ffn is None else moe_ffn
    norm = norm_params(hidden, norm_has_bias)
    attention = dict(head_dim=head_dim, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                     qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
                     v_head_dim=v_head_dim, qk_norm=qk_norm, sinks=sinks)
    attn = attention_params(hidden, heads, kv_heads, bias, norm_has_bias=norm_has_bias, **attention)
    qk_norms = (kv_lora_rank == 0) * qk_norm * norm_params(2 * head_dim, norm_has_bias)
    mla_down = (kv_lora_rank > 0) * (
        (q_lora_rank > 0) * (hidden * q_lora_rank + norm_params(q_lora_rank, norm_has_bias) + bias * q_lora_rank)
        + hidden * (kv_lora_rank + qk_rope_head_dim) + norm_params(kv_lora_rank, norm_has_bias)
        + bias * (kv_lora_rank + qk_rope_head_dim))
    # replicated across TP: both norms, the q/k norms, MLA's down-projections, the attention-out bias
    replicated = 2 * norm + qk_norms + mla_down + bias * hidden
    dense_mlp = mlp_params(hidden, ffn, mlp_matrices, bias)
    shared_mlp = shared_experts * mlp_params(hidden, moe_ffn, mlp_matrices, bias)
    # MLP down biases and the h x E router are replicated as well
    dense_layer = (attn + dense_mlp - bias * hidden + 2 * norm - replicated) / tp + replicated + bias * hidden
    moe_dense = ((attn + shared_mlp - shared_experts * bias * hidden + 2 * norm - replicated) / tp
                 + replicated + shared_experts * bias * hidden + (hidden + router_bias) * experts)
    expert_mlp = mlp_params(hidden, moe_ffn, mlp_matrices, bias)
    expert_layer = experts * ((expert_mlp - bias * hidden) / etp + bias * hidden) / ep
    vocab_rows = -(-vocab // tp)  # vocab-parallel embedding, padded to a multiple of tp
    embedding = vocab_rows * hidden + learned_positions * seq * hidden + embedding_norm * norm
    # the last stage holds the LM head; a tied head is a second copy when pp > 1 (Megatron-LM)
    head = norm + ((1 - tied) + tied * (pp > 1)) * vocab_rows * hidden
    largest = np.where(moe_layers > 0, np.maximum(moe_dense + expert_layer, (moe_layers < layers) * dense_layer),
                       dense_layer)
    # an MTP module (DeepSeek-V3 Sec. 2.2): its block, the h x 2h projection (column-parallel in
    # Megatron-Core) and three replicated norms; away from rank 0 its rank holds a copy of the embedding
    mtp_extra = 2 * hidden * hidden / tp + 3 * norm
    return {"dense_layer": dense_layer, "moe_dense": moe_dense, "expert_layer": expert_layer,
            "embedding": embedding, "head": head, "mtp_extra": mtp_extra, "vocab_table": vocab_rows * hidden,
            "unit": np.maximum(np.maximum(largest, embedding), head)}


def rank_parameters(n: dict[str, Any], rank: Any, balanced: Any = False,
                    blocks: dict[str, Any] | None = None, held: dict[str, Any] | None = None,
                    schedule: str = "1f1b") -> dict[str, Any]:
    """Parameters on one GPU of pipeline rank ``rank`` (:func:`stage_parameters`); ``n``: layout and
    model numbers; ``blocks`` (:func:`_layer_blocks` of ``n``) and ``held``
    (:func:`~dtlib.analytic.stages.rank_layers`), when already at hand. DualPipe: the rank's two
    stages (:func:`~dtlib.analytic.stages.dualpipe_stages`), so ranks 0 and pp-1 both hold the
    embedding and the LM head; DualPipeV: rank 0 holds both (:func:`~dtlib.analytic.stages.holds_ends`)."""
    blocks = _layer_blocks(**n) if blocks is None else blocks
    held = rank_layers(n, rank, balanced, schedule) if held is None else held
    dense_layers, moe = held["layers"] - held["moe_layers"], held["moe_layers"]
    embeds, heads = holds_ends(rank, n["pp"], schedule)
    ends = embeds * blocks["embedding"] + heads * blocks["head"]
    mtp, mtp_moe = held.get("mtp", 0), n.get("mtp_moe", 0)
    mtp_dense = mtp * (blocks["mtp_extra"] + np.where(mtp_moe, blocks["moe_dense"], blocks["dense_layer"]))
    ends = ends + mtp_dense + (mtp > 0) * (1 - embeds) * blocks["vocab_table"]
    # LoRA adapters of the rank's layers (dtlib.analytic.finetune; none without lora_rank)
    split = dict(tp=n.get("tp", 1), ep=n.get("ep", 1), etp=n.get("etp", 1))
    none = {"dense": 0, "expert": 0}
    lora = np.any(np.asarray(n.get("lora_rank", 0)) > 0)  # the search's pre-training rows skip the arithmetic
    dense_adapters, moe_adapters = ((adapter_layer_params(n, False, **split), adapter_layer_params(n, True, **split))
                                    if lora else (none, none))
    return {"dense": ends + dense_layers * blocks["dense_layer"] + moe * blocks["moe_dense"],
            "expert": (moe + mtp * mtp_moe) * blocks["expert_layer"], "unit": blocks["unit"] + 0 * ends,
            "adapter": dense_layers * dense_adapters["dense"] + moe * moe_adapters["dense"],
            "expert_adapter": moe * moe_adapters["expert"]}


def stage_parameters(balanced: Any = False, schedule: str = "1f1b", **n: Any) -> dict[str, dict[str, Any]]:
    """Parameters on one GPU of the first and of the last pipeline stage: ``dense`` (sharded by
    ZeRO over dp), ``expert`` (sharded over the expert-data-parallel group,
    :func:`model_state_bytes`) and ``unit`` (largest block gathered at once by
    ZeRO-3/FSDP with per-block wrapping); :func:`rank_parameters` for any rank.

    Megatron-Core's placement: attention and dense MLPs are split over ``tp`` (Shoeybi et al. 2019),
    norms, row-parallel biases and the router replicated; MLA's down-projections ``q_a``/``kv_a``
    and their norms are replicated too (``MLASelfAttention`` builds them with
    ``parallel_mode='duplicated'``), its up-projections and O split over ``tp``. Routed experts are
    split over ``ep`` (whole experts) and each over ``etp`` (``--expert-tensor-parallel-size``);
    shared experts are dense MLPs over ``tp`` (``SharedExpertMLP`` uses the TP group). A rank
    holds its chunks' layers, dense and MoE as Megatron-LM places them
    (:func:`dtlib.analytic.stages.rank_layers`), the first the embedding, the last the LM head.
    """
    n = {"pp": 1, "virtual_stages": 1, **n}
    return {"first": rank_parameters(n, 0 * n["pp"], balanced, schedule=schedule),
            "last": rank_parameters(n, n["pp"] - 1, balanced, schedule=schedule)}


def model_state_bytes(dense, expert, unit, prec: Precision, *, zero, shard_size, ep=1, tp=1, etp=1,
                      offload: str = "none", adapter: Any = 0, expert_adapter: Any = 0,
                      frozen: Any = False) -> dict[str, Any]:
    """GPU and CPU bytes of parameters, gradients and optimizer for ZeRO ``zero`` (0-3).

    Stage >= 1 divides the optimizer, >= 2 also the gradients, 3 also the parameters, by the
    sharding group (Rajbhandari et al. 2020, Sec. 5.1-5.3): ``shard_size`` ranks for the ``dense``
    parameters. The ``expert`` ones (already split over ``ep`` and ``etp``) are sharded over the
    ranks holding the same expert shard, Megatron-Core's expert-data-parallel group: with MoE
    parallel folding a stage's ``tp x cp x dp`` ranks are also ``etp x ep x edp``, so
    ``edp = tp x cp x dp / (etp x ep)`` (``parallel_state.initialize_model_parallel``,
    ``expert_data_parallel_size``; :func:`dtlib.plan.moe.expert_grid`), and the distributed
    optimizer shards the expert parameter group over it (``get_megatron_optimizer``:
    ``data_parallel_group=intra_expt_dp_group``, Megatron-Core 0.16). A smaller ``shard_size``
    (``num_distributed_optimizer_instances`` partial shards) shrinks both groups by the same
    factor: ``edp x shard_size / (dp x cp) = tp x shard_size / (etp x ep)``, at least 1.
    ZeRO-3 gathers one unit (parameters + their gradients, in the working dtype) at a time: the
    ``temporary`` term, DeepSpeed's ``4 * largest_layer_params`` for 2-byte weights
    (``estimate_zero3_model_states_mem_needs``). Offloading (Ren et al. 2021, ZeRO-Offload) moves the
    optimizer and the gradient shards to CPU; ``params`` also the parameter shards (ZeRO-Infinity).

    ``frozen`` (LoRA, :mod:`dtlib.analytic.finetune`; Hu et al. 2021, Sec. 4.2): the ``dense`` and
    ``expert`` weights are frozen, held once in the working dtype (``prec.param``: no gradient, no
    optimizer state, no master copy; ZeRO-3 still shards them and gathers a unit without its
    gradients); the ``adapter`` and ``expert_adapter`` parameters are trained with every byte of ``prec``.
    """
    expert_shard = np.maximum(shard_size * tp // (etp * ep), 1)

    def count(min_stage, dense=dense, expert=expert):
        on = zero >= min_stage
        return dense / np.where(on, shard_size, 1) + expert / np.where(on, expert_shard, 1)

    def trained(min_stage):
        return np.where(frozen, count(min_stage, adapter, expert_adapter), count(min_stage))

    params = prec.param * (count(3) + np.where(frozen, count(3, adapter, expert_adapter), 0))
    grads, optim = prec.grad * trained(2), prec.optimizer * trained(1)
    temporary = np.where(zero == 3, np.where(frozen, 1, 2) * prec.param * unit, 0)
    cpu = 0 * params
    if offload in ("optimizer", "params"):
        cpu = optim + prec.grad * trained(1)
        optim, grads = 0 * optim, 0 * grads
    if offload == "params":
        cpu, params = cpu + params, 0 * params
    return {"parameters": params, "gradients": grads, "optimizer": optim, "temporary": temporary,
            "cpu": cpu}


def per_gpu_bytes(n: dict[str, Any], prec: Precision, *, recompute: str = "none",
                  schedule: str = "1f1b", offload: str = "none", dropout: bool = False,
                  flash_attention: bool = True, fused_swiglu: bool = False, fp8_inputs: Any = False,
                  recompute_layers: int | None = None, account_for_embedding_and_loss: bool = False,
                  activation_offload_layers: int | None = None, recompute_modules: tuple[str, ...] = (),
                  mask_bytes: float = 1, logits_bytes: float = 4, norm_saved: float = 1,
                  overhead_bytes: Any = 0.0, ranks: list[int] | None = None,
                  weight_copy_bytes: Any = 0.0) -> dict[str, Any]:
    """The shared core (scalars or arrays): bytes on the most loaded GPU, by component, and its
    pipeline ``stage``; ``ranks``: the pipeline ranks to evaluate (default: those that can be the
    most loaded, :func:`dtlib.analytic.stages.candidate_ranks`).

    ``n`` holds layout numbers (``dp tp pp cp ep zero sequence_parallel virtual_stages micro_batch_size
    num_microbatches shard_size``) and either the model shape (:func:`model_numbers`) or ``params``
    (a bare parameter count: no activations) with optional ``largest_layer``. The categorical
    options (``recompute``, ``schedule``, ``offload``, ``recompute_layers``,
    ``account_for_embedding_and_loss``, ``activation_offload_layers``, ``recompute_modules``) are
    :class:`~dtlib.analytic.layout.Parallelism`'s; the
    activation conventions (``dropout``, ``flash_attention``, ``fused_swiglu``, ``fp8_inputs``)
    are :func:`dtlib.analytic.activations.stored_layer_bytes`'s. ``weight_copy_bytes``: bytes per
    transformer-layer parameter of the quantized weight copies the linear layers keep through the step
    (:func:`memory_options`), counted in ``temporary``.
    """
    shaped = n.get("hidden") is not None
    balanced = account_for_embedding_and_loss
    if shaped:
        n = dict(n, first_stage_layers=n.get("first_stage_layers", 0), last_stage_layers=n.get("last_stage_layers", 0))
        def ranks_of(s: dict[str, Any]) -> list[dict[str, Any]]:
            # full recompute is recompute_layers = every layer of every chunk (Megatron's block method)
            partial = s["layers"] if recompute == "full" else recompute_layers
            return [dict(stored_on_rank(schedule, s, r, balanced, partial), rank=r,
                         **{"held." + k: v for k, v in rank_layers(s, r, balanced, schedule).items()})
                    for r in (candidate_ranks(s, balanced, schedule) if ranks is None
                              else [r + 0 * s["pp"] for r in ranks])]
        table = on_structures(ranks_of, n)
        ranks = [t["rank"] for t in table]
        per_chunk = n["layers"] / (n["pp"] * chunks_per_rank(schedule, n["virtual_stages"]))
        offloaded = np.minimum(activation_offload_layers or 0, per_chunk) / per_chunk
        act = activation_breakdown(
            seq=n["seq"], micro_batch_size=n["micro_batch_size"], hidden=n["hidden"], heads=n["heads"],
            kv_heads=n["kv_heads"], ffn=n["ffn"], vocab=n["vocab"],
            stored=table, tp=n["tp"], cp=n["cp"],
            sequence_parallel=n["sequence_parallel"], recompute=recompute, swiglu=n["swiglu"],
            dropout=dropout, flash_attention=flash_attention, fused_swiglu=fused_swiglu,
            fp8_inputs=fp8_inputs, offloaded=offloaded, act_bytes=prec.activation, mask_bytes=mask_bytes,
            logits_bytes=logits_bytes, norm_saved=norm_saved, experts=n["experts"], top_k=n["top_k"],
            recompute_modules=recompute_modules, **{k: n[k] for k in _MODEL_KINDS if k in n})
        blocks = _layer_blocks(**n)
        params = [rank_parameters(n, t["rank"], balanced, blocks, {"layers": t["held.layers"],
                                                                  "moe_layers": t["held.moe_layers"],
                                                                  "mtp": t["held.mtp"]}, schedule)
                  for t in table]
        for p, t in zip(params, table):  # the transformer layers' weights: what NVFP4 keeps quantized copies of
            p["layers"] = ((t["held.layers"] - t["held.moe_layers"]) * blocks["dense_layer"]
                           + t["held.moe_layers"] * (blocks["moe_dense"] + blocks["expert_layer"]))
    else:
        ranks = [0 * n["pp"]]
        dense = n["params"] / (n["tp"] * n["pp"])
        params = [{"dense": dense, "expert": 0 * dense, "unit": 0 * dense, "layers": dense}]
    if n.get("largest_layer") is not None:  # a whole layer; each TP rank gathers its 1/tp of it
        for p in params:
            p["unit"] = n["largest_layer"] / n["tp"] + 0 * p["dense"]
    picked: dict[str, Any] = {}
    for i, (rank, p) in enumerate(zip(ranks, params)):
        st = model_state_bytes(p["dense"], p["expert"], p["unit"], prec, zero=n["zero"], shard_size=n["shard_size"],
                               ep=n["ep"], tp=n["tp"], etp=n.get("etp", 1), offload=offload,
                               adapter=p.get("adapter", 0), expert_adapter=p.get("expert_adapter", 0),
                               frozen=np.asarray(n.get("lora_rank", 0)) > 0)
        st["activations"] = act[i]["total"] if shaped else None
        # quantized weight copies kept through the step: of the rank's layers, of one gathered unit with ZeRO-3
        st["temporary"] = st["temporary"] + weight_copy_bytes * np.where(n["zero"] == 3, p["unit"], p["layers"])
        if shaped:
            st["cpu"] = st["cpu"] + act[i].pop("cpu")
        st["overhead"] = overhead_bytes + 0 * st["parameters"]
        st["total"] = (st["parameters"] + st["gradients"] + st["optimizer"] + st["temporary"]
                       + st["overhead"] + (st["activations"] if shaped else 0))
        if shaped:
            st.update({f"activations.{k}": v for k, v in act[i].items() if k != "total"})
        st["stage"] = rank + 0 * st["total"]
        # the heaviest rank so far (the first of equals: ties keep the earlier rank)
        heavier = st["total"] > picked["total"] if picked else True
        picked = {k: (None if v is None else np.where(heavier, v, picked[k]) if picked else v) for k, v in st.items()}
    picked["stage"] = np.where(n["pp"] == 1, 0, picked["stage"]).astype(int)
    return picked


@dataclass
class MemoryBreakdown:
    """Bytes on the most loaded GPU (``stage``: its pipeline stage index)."""
    parameters: float
    gradients: float
    optimizer: float
    activations: float | None
    temporary: float
    overhead: float
    total: float
    cpu: float
    stage: int
    activation_detail: dict[str, float] = field(default_factory=dict)
    gpu: Accelerator | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def fits(self) -> bool | None:
        return None if self.gpu is None else self.total <= self.gpu.memory_bytes

    def to_dict(self) -> dict[str, Any]:
        keys = ("parameters", "gradients", "optimizer", "activations", "temporary", "overhead", "total")
        d = {"per_gpu": {k: getattr(self, k) for k in keys}, "cpu_per_gpu": self.cpu,
             "stage": self.stage, "activation_detail": self.activation_detail, "notes": self.notes}
        if self.gpu is not None:
            d["gpu"] = {"name": self.gpu.name, "memory": self.gpu.memory_bytes, "fits": self.fits}
        return d


def resolve_model(model: "TransformerConfig | str | float | int") -> TransformerConfig | float:
    """A config (or preset name) or a bare parameter count."""
    if isinstance(model, TransformerConfig):
        return model
    if isinstance(model, str):
        return get_preset(model)
    if isinstance(model, bool) or not isinstance(model, (int, float, np.integer, np.floating)):
        raise validate.InvalidArgument("model", "a TransformerConfig, a preset name or a parameter "
                                                "count", model)
    return validate.number("params", model)


def memory_per_gpu(model: "TransformerConfig | str | float", layout: Parallelism | None = None, *,
                   precision: "Precision | str" = "zero", gpu: "str | Accelerator | None" = None,
                   gpus: int | None = None, seq: int | None = None, dropout: bool | None = None,
                   flash_attention: bool | None = None, convention: str | None = None,
                   stack: "Stack | str | None" = None, dtype: str = "bf16",
                   mask_bytes: float = 1, logits_bytes: float = 4, norm_saved: float = 1,
                   largest_layer_params: float | None = None,
                   overhead_bytes: float = 0.0, finetune: FineTuning | None = None) -> MemoryBreakdown:
    """Bytes per GPU on the most loaded GPU of ``layout`` training ``model``.

    ``model``: a :class:`TransformerConfig`, a preset name, or a parameter count (then activations
    are None and tensor/pipeline parallelism divide the count evenly). ``precision``: a
    :class:`Precision` or convention name (default ``"zero"``: 2+2+12 bytes/param, 16-bit
    activations). ``gpus``: if given, must equal dp*tp*pp*cp.

    Activations are counted as ``convention`` says (:data:`~dtlib.analytic.presets.ACTIVATION_CONVENTIONS`:
    default ``today``, FlashAttention-style attention and no dropout, for every model;
    ``korthikanti-2022`` the paper's GPT counting), with ``flash_attention`` / ``dropout``
    overriding it where given; ``stack`` (:mod:`dtlib.analytic.stacks`, default
    :data:`~dtlib.analytic.stacks.DEFAULT_STACK`) says what its kernels store (fused SwiGLU; with
    ``dtype="fp8"``, FP8 copies of the GEMM inputs), exactly as ``dtlib plan`` counts them.
    ``mask_bytes``/``logits_bytes``/``norm_saved``: see :mod:`dtlib.analytic.activations`.
    ``overhead_bytes``: framework overhead (CUDA context, NCCL buffers, fragmentation; default 0,
    typically 1-3 GiB on a GPU). ``largest_layer_params`` overrides the ZeRO-3 gather unit: the
    parameters of the largest layer before tensor parallelism, which splits it over ``tp`` ranks
    as it splits the layers of a shaped model. ``finetune``: a :class:`~dtlib.analytic.finetune.FineTuning`
    (default: every weight trained); LoRA freezes the base weights and trains adapters
    (:func:`model_state_bytes`), and needs a model shape.
    """
    layout = layout or Parallelism()

    prec = get_precision(precision)
    cfg = resolve_model(model)
    finetune = resolve_finetune(finetune, isinstance(cfg, TransformerConfig))
    chosen_stack = get_stack(stack)
    validate.one_of("dtype", dtype, tuple(OPERAND_BYTES))
    counted, assumed = activation_convention(convention, flash_attention, dropout)
    if seq is not None:
        validate.integer("seq", seq)
    if gpus is not None:
        validate.integer("gpus", gpus)
    if largest_layer_params is not None:
        validate.number("largest_layer_params", largest_layer_params, minimum=0, exclusive=False)
    validate.number("overhead_bytes", overhead_bytes, minimum=0, exclusive=False)
    for name, value in (("mask_bytes", mask_bytes), ("logits_bytes", logits_bytes),
                        ("norm_saved", norm_saved)):
        validate.number(name, value, minimum=0, exclusive=False)
    acc = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if isinstance(cfg, TransformerConfig):
        layout.check_model(cfg)
        n = layout.numbers(**model_numbers(cfg, seq), **finetune.numbers(), gpus=gpus,
                           largest_layer=largest_layer_params)
        check_targets(finetune, n)
    else:
        if layout.ep > 1:
            raise ValueError("expert parallelism needs a model shape with moe_experts; "
                             "a bare parameter count cannot be split into experts")
        n = layout.numbers(params=cfg, gpus=gpus, largest_layer=largest_layer_params)
    check_layout(n, layout.schedule, layout.offload, layout.account_for_embedding_and_loss)
    r = per_gpu_bytes(n, prec, recompute=layout.recompute, schedule=layout.schedule,
                      offload=layout.offload, **memory_options(counted, chosen_stack, dtype),
                      recompute_layers=layout.recompute_layers,
                      account_for_embedding_and_loss=layout.account_for_embedding_and_loss,
                      activation_offload_layers=layout.activation_offload_layers,
                      recompute_modules=layout.recompute_modules, mask_bytes=mask_bytes, logits_bytes=logits_bytes,
                      norm_saved=norm_saved,
                      overhead_bytes=overhead_bytes)
    detail = {k.split(".", 1)[1]: float(v) for k, v in r.items() if k.startswith("activations.")}
    notes = [f"precision: {prec.name} ({prec.total:g} bytes/param before sharding)"]
    if finetune.lora:
        notes.append(f"fine-tuning: {finetune.describe()}: frozen weights at {prec.param:g} bytes/param, "
                     f"adapters at {prec.total:g}")
    if r["activations"] is None:
        notes.append("activations: not computed (bare parameter count; give a model shape)")
    else:
        notes += assumed + [f"stack: {chosen_stack.name} ({stack_storage(chosen_stack, dtype)})"]
    return MemoryBreakdown(
        parameters=float(r["parameters"]), gradients=float(r["gradients"]),
        optimizer=float(r["optimizer"]),
        activations=None if r["activations"] is None else float(r["activations"]),
        temporary=float(r["temporary"]), overhead=float(r["overhead"]), total=float(r["total"]),
        cpu=float(r["cpu"]), stage=int(r["stage"]), activation_detail=detail, gpu=acc, notes=notes)


def memory_options(counted: Training, stack: "Stack", dtype: str = "bf16") -> dict[str, Any]:
    """:func:`per_gpu_bytes`'s activation conventions for an activation convention, a stack and
    the matmul dtype (what ``dtlib memory`` and ``dtlib plan`` both pass).

    NVFP4 (Transformer Engine, the stacks that save quantized inputs): the linear layers cache their
    inputs as column-wise NVFP4 (:data:`~dtlib.analytic.precision.NVFP4_BYTES` per element) and their
    weights quantized once per step for every micro-batch, row-wise and column-wise (2 x 9/16 byte per
    parameter, 2D 16 x 16 blocks; NVIDIA 2025, arXiv:2509.25149, Sec. 4.3), beside the BF16 working
    weights. All transformer layers are counted, also ones kept in BF16 (``bf16_layers``: an upper
    bound). FP8's weight copies are not counted (its model predates this one)."""
    nvfp4 = dtype == "nvfp4" and stack.fp8_saves_inputs
    cached = NVFP4_BYTES if nvfp4 else dtype == "fp8" and stack.fp8_saves_inputs
    return {"dropout": counted.dropout, "flash_attention": counted.flash_attention,
            "fused_swiglu": stack.fused_swiglu, "fp8_inputs": cached,
            "weight_copy_bytes": 2 * NVFP4_BYTES if nvfp4 else 0.0}


def stack_storage(stack: "Stack", dtype: str = "bf16") -> str:
    """One phrase: what ``stack`` stores differently from eager PyTorch (for the output notes)."""
    kept = ["fused SwiGLU keeps its input only" if stack.fused_swiglu else "SwiGLU tensors as eager PyTorch"]
    if dtype == "fp8":
        kept.append("FP8 copies of GEMM inputs" if stack.fp8_saves_inputs else "BF16 GEMM inputs under FP8")
    if dtype == "nvfp4":
        kept.append("NVFP4 copies of GEMM inputs and of the layers' weights (2 x 9/16 byte/param, in temporary)"
                    if stack.fp8_saves_inputs else "BF16 GEMM inputs under NVFP4")
    return ", ".join(kept)
