"""Megatron-Core builds the model of emitted Megatron-LM flags, at full size, on the meta device.

:func:`build_meta_gpt` reads the flags against Megatron-LM's recorded parser
(:mod:`dtlib.frameworks.megatron_args`: names, arity, choices, defaults of tag ``core_v0.16.1``),
applies ``validate_args``' rules, makes Megatron-Core's own ``TransformerConfig`` (or
``MLATransformerConfig``) the way Megatron-LM's ``core_transformer_config_from_args`` does (every
argument named like a config field, then its renames: ``--swiglu``, ``--num-experts``,
``--group-query-attention``; arguments.py l. 1306-1351), and builds ``GPTModel`` as
``gpt_builders.py``'s ``gpt_builder`` does: the decoder block spec for MoE models (dense-first
layers and ``--moe-layer-freq`` included), the layer spec otherwise, the vocabulary padded to a
multiple of ``--make-vocab-size-divisible-by`` x tp, embeddings tied unless
``--untie-embeddings-and-output-weights``. Megatron-Core's ``__post_init__`` checks (MoE, MLA,
recompute modules, head and group divisibility) run on the way.

Only one rank's share is built, for a world of ``world_size`` ranks, without any GPU or network:
``torch.distributed`` is initialised with PyTorch's fake backend (``torch.testing._internal.
distributed.fake_pg.FakeStore``: collectives return at once, groups of any size exist) and
``parallel_state.initialize_model_parallel`` carves the tp/pp/cp/ep/etp groups of that world as
Megatron-LM does, so the layers shard as on the cluster. Parameters are created on ``meta`` (no
memory): a Llama 3 70B stage builds in well under a second.

Settings that change how layers run, never their parameters, are set for CPU: Megatron-Core's
local (non-Transformer-Engine) spec, which has the same parameters as the TE spec (TE fuses the
norm into the next linear layer: same tensors); CPU initialisation without random init;
no fusions.
"""
from __future__ import annotations

import dataclasses
import warnings
from contextlib import contextmanager
from typing import Any, Iterator
from unittest import mock

from dtlib.frameworks.megatron_args import padded_vocab_size, parse_args, validate

__all__ = ["megatron_transformer_config", "build_meta_gpt", "params_per_rank", "dtlib_params_per_stage",
           "model_state_on_rank"]

# run-time settings for a CPU meta build (no parameter changes): field -> value
_CPU = {"use_cpu_initialization": True, "perform_initialization": False, "gradient_accumulation_fusion": False,
        "bias_activation_fusion": False, "bias_dropout_fusion": False, "apply_rope_fusion": False,
        "masked_softmax_fusion": False, "persist_layer_norm": False, "moe_grouped_gemm": False,
        "transformer_impl": "local", "fp8": None, "fp8_recipe": "delayed",
        # the fused MoE permute is a Transformer Engine kernel without parameters: __post_init__
        # imports it when the flag is on (moe_utils.fused_permute, absent without TE)
        "moe_permute_fusion": False}


def megatron_transformer_config(args: dict[str, Any]) -> Any:
    """Megatron-Core's ``TransformerConfig``/``MLATransformerConfig`` of parsed Megatron-LM
    arguments, as ``core_transformer_config_from_args`` maps them, with the CPU settings above.
    Megatron-Core's refusal (``__post_init__``) becomes a ``ValueError`` of one line."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    cls = MLATransformerConfig if args["multi_latent_attention"] else TransformerConfig
    kw = {f.name: args[f.name] for f in dataclasses.fields(cls) if f.name in args and f.init}
    dtype = torch.bfloat16 if args["bf16"] else torch.float16 if args["fp16"] else torch.float32
    kw.update(params_dtype=dtype, pipeline_dtype=dtype, batch_p2p_comm=not args["overlap_p2p_comm"],
              num_moe_experts=args["num_experts"], num_layers_in_first_pipeline_stage=args[
                  "decoder_first_pipeline_num_layers"],
              num_layers_in_last_pipeline_stage=args["decoder_last_pipeline_num_layers"],
              num_query_groups=args["num_query_groups"] if args["group_query_attention"] else None)
    if args["swiglu"]:
        kw.update(activation_func=F.silu, gated_linear_unit=True)
    per_chunk = args["num_layers_per_virtual_pipeline_stage"]
    if per_chunk is not None:  # validate_args l. 543-552 derives the virtual size
        layers = (args["num_layers"] + bool(args["account_for_embedding_in_pipeline_split"])
                  + bool(args["account_for_loss_in_pipeline_split"]))
        virtual = layers // args["pipeline_model_parallel_size"] // per_chunk
        kw["virtual_pipeline_model_parallel_size"] = virtual if virtual > 1 else None
    elif args["num_virtual_stages_per_pipeline_rank"] is not None:  # l. 550-551: given as chunks per rank
        virtual = args["num_virtual_stages_per_pipeline_rank"]
        kw["virtual_pipeline_model_parallel_size"] = virtual if virtual > 1 else None
    elif args["pipeline_model_parallel_layout"] is not None:  # l. 516-525: the layout's chunks over pp
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        chunks = PipelineParallelLayerLayout.get_num_stages_from_str(args["pipeline_model_parallel_layout"])
        virtual = chunks // args["pipeline_model_parallel_size"]
        kw["virtual_pipeline_model_parallel_size"] = virtual if virtual > 1 else None
    if isinstance(kw.get("cp_comm_type"), list) and len(kw["cp_comm_type"]) == 1:  # l. 1361-1362
        kw["cp_comm_type"] = kw["cp_comm_type"][0]
    if args["rope_type"] is None:  # l. 1353-1355: the config class's own default
        kw.pop("rope_type", None)
    if args["tensor_model_parallel_size"] == 1:  # validate_args l. 905-910 turns it off
        kw["sequence_parallel"] = False
    kw.update(_CPU)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cls(**kw)
    except (AssertionError, ValueError) as exc:
        raise ValueError(f"Megatron-Core refuses the flags: {str(exc).splitlines()[0]} ({cls.__name__})") from None


@contextmanager
def _fake_world(args: dict[str, Any], world_size: int, rank: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks as ``rank``, with Megatron's model-parallel
    groups; torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialised in this process; "
                           "build_meta_gpt needs its own fake one")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args["tensor_model_parallel_size"],
            pipeline_model_parallel_size=args["pipeline_model_parallel_size"],
            context_parallel_size=args["context_parallel_size"],
            expert_model_parallel_size=args["expert_model_parallel_size"],
            expert_tensor_parallel_size=args["expert_tensor_parallel_size"],
            create_gloo_process_groups=False)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _mla_local_attention(spec: Any) -> None:
    """Megatron-Core 0.16.1's local spec gives MLA the local ``DotProductAttention``, which
    ``MLASelfAttention`` calls with ``k_channels``/``v_channels`` it does not take (MLA runs with
    Transformer Engine's attention). Core attention has no parameters in either, so the local one
    is given a constructor that drops the two widths; every parameterised module stays Megatron's."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)

    def walk(node: Any) -> None:
        if isinstance(node, (list, tuple)):
            for item in node:
                walk(item)
        elif dataclasses.is_dataclass(node):
            for f in dataclasses.fields(node):
                value = getattr(node, f.name)
                if value is DotProductAttention:
                    setattr(node, f.name, MLADotProductAttention)
                else:
                    walk(value)

    walk(spec)


def build_meta_gpt(flags: list[str], world_size: int, rank: int = 0) -> Any:
    """Megatron-Core's ``GPTModel`` of ``flags`` as rank ``rank`` of ``world_size`` holds it, on the
    meta device: one ``GPTModel``, or a ``torch.nn.ModuleList`` of the rank's model chunks with the
    interleaved schedule. Raises ``ValueError`` naming the flag or Megatron's refusal."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_layer_local_spec,
                                                          get_gpt_mtp_block_spec)
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
    args = parse_args(list(flags))
    validate(args, world_size)
    # sequence and context parallelism split activations, never parameters, and the local spec's
    # torch norm and attention refuse them (TE's run them): the config is checked with them, the
    # model built without them, on the same process groups
    # the token dispatcher holds no parameters, and the alltoall one makes a CUDA stream in its
    # constructor (token_dispatcher.py): the model is built with the allgather one, same count
    config = dataclasses.replace(megatron_transformer_config(args), sequence_parallel=False,
                                 context_parallel_size=1, moe_token_dispatcher_type="allgather")
    tp = args["tensor_model_parallel_size"]
    vocab = padded_vocab_size(args["vocab_size"], tp, args["make_vocab_size_divisible_by"])
    chunks = []
    # a few modules (YaRN/learned-position buffers) ask torch.cuda for their device: answer "meta"
    # and the tied-embedding copy on the last stage is moved with .cuda() (language_module.py): a no-op
    cuda_device = mock.patch.object(torch.cuda, "current_device", lambda: torch.device("meta"))
    cuda_move = mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self)
    # without Transformer Engine, Megatron-Core 0.16.1 leaves a MagicMock as TELinear but HAVE_TE
    # True in multi_latent_attention.py, so MLASelfAttention's isinstance check (an FP8 option of
    # TE's output projection, no parameters) raises: the flag is set to what is true here
    no_te = mock.patch.object(multi_latent_attention, "HAVE_TE", False)
    with (_fake_world(args, world_size, rank), torch.device("meta"), cuda_device, cuda_move, no_te,
          warnings.catch_warnings()):
        warnings.simplefilter("ignore")
        for vp_stage in range(config.virtual_pipeline_model_parallel_size or 1):
            vp = vp_stage if config.virtual_pipeline_model_parallel_size else None
            if args["num_experts"]:  # gpt_builders.py: the block spec places MoE and dense layers
                spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                  normalization=args["normalization"], vp_stage=vp)
            else:
                spec = get_gpt_layer_local_spec(qk_layernorm=args["qk_layernorm"],
                                                multi_latent_attention=args["multi_latent_attention"],
                                                normalization=args["normalization"])
            if args["multi_latent_attention"]:
                _mla_local_attention(spec)
            # multi-token prediction (--mtp-num-layers): gpt_builders.py's MTP block spec, of the decoder's spec
            mtp = (get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp)
                   if args.get("mtp_num_layers") else None)
            try:
                chunks.append(GPTModel(
                    config, spec, vocab_size=vocab, max_sequence_length=args["max_position_embeddings"],
                    pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                    post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                    share_embeddings_and_output_weights=not args["untie_embeddings_and_output_weights"],
                    position_embedding_type=args["position_embedding_type"], rotary_percent=args["rotary_percent"],
                    rotary_base=args["rotary_base"], rope_scaling=args["use_rope_scaling"], vp_stage=vp,
                    mtp_block_spec=mtp))
            except (AssertionError, ValueError) as exc:
                raise ValueError(f"Megatron-Core's GPTModel refuses the flags: {str(exc).splitlines()[0]}") from None
    return chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)


def params_per_rank(flags: list[str], world_size: int, rank: int = 0) -> int:
    """The parameters rank ``rank`` holds (all its model chunks), as Megatron-Core builds them."""
    return sum(p.numel() for p in build_meta_gpt(flags, world_size, rank).parameters())


def dtlib_params_per_stage(model: Any, layout: Any, make_vocab_size_divisible_by: int = 128) -> dict[str, int]:
    """dtlib's parameters on one rank of the first and of the last pipeline stage
    (:func:`dtlib.analytic.memory.stage_parameters`, dense + expert) with the vocabulary padded as
    Megatron-LM pads it (:func:`~dtlib.frameworks.megatron_args.padded_vocab_size`; dtlib's own
    convention pads to a multiple of tp only): what :func:`params_per_rank` gives for the first
    rank and the last."""
    from dtlib.analytic.memory import stage_parameters

    padded = model.with_(vocab=padded_vocab_size(model.vocab, layout.tp, make_vocab_size_divisible_by))
    stages = stage_parameters(**layout.numbers(**padded.numbers()))
    return {stage: int(stages[stage]["dense"] + stages[stage]["expert"]) for stage in ("first", "last")}


def model_state_on_rank(flags: list[str], model: Any, layout: Any, precision: str = "megatron-bf16") -> dict[str, Any]:
    """Megatron-Core's own count for ``--rehearse``: the GPTModel of the emitted ``flags`` built on
    the meta device for rank 0, its parameters beside dtlib's (:func:`dtlib_params_per_stage`), and
    the bytes of weights, gradients and optimizer state that count takes under ``precision``
    (:mod:`dtlib.analytic.precision`; Megatron-Core's distributed optimizer, ZeRO-1, shards the
    optimizer state over the data-parallel x context-parallel group, ``DistributedOptimizer``).
    Expert parameters shard over the expert-data-parallel group instead: an MoE model's optimizer
    bytes are left to ``dtlib memory`` (None here)."""
    from dtlib.analytic.precision import get_precision

    args = parse_args(list(flags))
    megatron = params_per_rank(flags, layout.gpus, 0)
    dtlib = dtlib_params_per_stage(model, layout, args["make_vocab_size_divisible_by"])["first"]
    prec = get_precision(precision)
    shard = layout.dp * layout.cp if args["use_distributed_optimizer"] else 1
    optimizer = None if model.moe_experts else megatron * prec.optimizer / shard
    return {"rank": 0, "parameters_megatron": megatron, "parameters_dtlib": dtlib, "precision": precision,
            "bytes": {"parameters": megatron * prec.param, "gradients": megatron * prec.grad, "optimizer": optimizer}}
