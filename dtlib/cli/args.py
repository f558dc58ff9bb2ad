"""What every ``dtlib`` subcommand shares: the model / layout / precision flags, how a model and a
layout are built from them, and the text and JSON output (the argument types and the parser are in
:mod:`dtlib.cli.argtypes`, re-exported here)."""
from __future__ import annotations

import argparse
import json
import re
from typing import Any, Callable

from dtlib.analytic import validate
from dtlib.analytic.activations import RECOMPUTE_MODULES
from dtlib.analytic.config import ACTIVATIONS, TransformerConfig
from dtlib.analytic.finetune import DEFAULT_LORA_TARGETS, FINETUNE, LORA_TARGETS, FineTuning
from dtlib.analytic.flops import PACKED_FLOPS, check_packed
from dtlib.analytic.pipeline_layout import PipelineLayout
from dtlib.analytic.hardware import ACCELERATORS
from dtlib.analytic.layout import OFFLOAD, RECOMPUTE_OPTIONS, SCHEDULES, Parallelism, broken_rules, check_layout
from dtlib.analytic.memory import GiB, resolve_model
from dtlib.analytic.precision import CONVENTIONS, OPTIMIZERS, get_precision, precision
from dtlib.analytic.presets import ACTIVATION_CONVENTIONS, PRESETS
from dtlib.cli.argtypes import (  # noqa: F401 (re-exported: the subcommands import them from here)
    Parser, bounded_float, checked, expert_count, flag_of, gpu_name, join_negative_values, non_negative_float,
    non_negative_int, parameter_count, parse_count, parse_size, plain, positive_float, positive_int,
    recompute_modules, seconds, system_name)
from dtlib.analytic.stacks import DEFAULT_STACK, STACKS


# TransformerConfig fields set by a model flag whose name differs (errors name the flag).
MODEL_FLAGS = {"moe_experts": "--experts", "moe_top_k": "--top-k", "moe_ffn": "--expert-ffn",
               "moe_shared_experts": "--shared-experts", "moe_dense_layers": "--dense-layers",
               "moe_layer_freq": "--moe-layer-freq", "moe_capacity_factor": "--capacity-factor",
               "kv_heads": "--kv-heads", "head_dim": "--head-dim", "q_lora_rank": "--q-lora-rank",
               "kv_lora_rank": "--kv-lora-rank", "qk_nope_head_dim": "--qk-nope-head-dim",
               "qk_rope_head_dim": "--qk-rope-head-dim", "v_head_dim": "--v-head-dim",
               "sliding_window": "--sliding-window", "global_attention_every": "--global-attention-every",
               "mtp_layers": "--mtp-layers"}
# flags that describe a model's architecture or MoE routing: on a preset they replace its value
_VARIANT_FLAGS = {field: flag for field, flag in MODEL_FLAGS.items() if field != "kv_heads"}


def model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (one of --model, --params, or --layers/--hidden/--heads)")
    g.add_argument("preset", nargs="?", metavar="MODEL", help="a preset, as --model")
    g.add_argument("--model", help=f"preset name, one of: {', '.join(PRESETS)}")
    g.add_argument("--params", type=parameter_count, help="bare parameter count, e.g. 7e9 or 7B")
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn"):
        g.add_argument(f"--{name}", type=positive_int)
    g.add_argument("--vocab", type=positive_int, default=None,
                   help="vocabulary (default 50257 for a custom shape)")
    g.add_argument("--activation", choices=ACTIVATIONS, help="MLP activation of a custom shape (default gelu)")
    g.add_argument("--seq", type=positive_int, help="sequence length (default: the model's; 2048 for a custom shape)")
    m = p.add_argument_group("mixture of experts and attention variants (docs/models.md; on a preset "
                             "they replace its value)")
    m.add_argument("--experts", dest="moe_experts", type=expert_count, metavar="E",
                   help="routed experts per MoE layer (0: dense; HF n_routed_experts)")
    m.add_argument("--top-k", dest="moe_top_k", type=positive_int, metavar="K", help="experts per token, 1..--experts")
    m.add_argument("--expert-ffn", dest="moe_ffn", type=positive_int, metavar="F",
                   help="FFN width of each expert (HF moe_intermediate_size; default --ffn)")
    m.add_argument("--shared-experts", dest="moe_shared_experts", type=non_negative_int, metavar="S",
                   help="always-active experts, each --expert-ffn wide (DeepSeek n_shared_experts)")
    m.add_argument("--dense-layers", dest="moe_dense_layers", type=non_negative_int, metavar="D",
                   help="first layers with a dense MLP (DeepSeek first_k_dense_replace)")
    m.add_argument("--moe-layer-freq", dest="moe_layer_freq", type=positive_int, metavar="N",
                   help="every N-th of the other layers is MoE (Megatron --moe-layer-freq; default 1)")
    cap = m.add_mutually_exclusive_group()
    cap.add_argument("--capacity-factor", dest="moe_capacity_factor", type=positive_float, metavar="C",
                     help="tokens per expert capped at C x the balanced load (default: dropless)")
    cap.add_argument("--dropless", action="store_true", help="no capacity limit (the default)")
    m.add_argument("--head-dim", dest="head_dim", type=positive_int, metavar="SIZE",
                   help="attention head size (HF head_dim; default hidden/heads)")
    m.add_argument("--kv-lora-rank", dest="kv_lora_rank", type=non_negative_int, metavar="RANK",
                   help="multi-head latent attention: KV latent size (> 0 turns MLA on; DeepSeek-V2/V3)")
    m.add_argument("--q-lora-rank", dest="q_lora_rank", type=non_negative_int, metavar="RANK",
                   help="MLA query latent size (0: no query compression)")
    for name, what in (("qk-nope-head-dim", "query/key head size without rope"),
                       ("qk-rope-head-dim", "query/key rope head size"), ("v-head-dim", "value head size")):
        m.add_argument(f"--{name}", dest=name.replace("-", "_"), type=non_negative_int, metavar="SIZE",
                       help=f"MLA {what}")
    m.add_argument("--sliding-window", dest="sliding_window", type=non_negative_int, metavar="W",
                   help="keys each query attends to (0: the whole sequence)")
    m.add_argument("--global-attention-every", dest="global_attention_every", type=non_negative_int, metavar="K",
                   help="every K-th layer attends to the whole sequence (0: none; GPT-OSS 2)")
    m.add_argument("--mtp-layers", dest="mtp_layers", type=non_negative_int, metavar="D",
                   help="multi-token-prediction modules (DeepSeek-V3 Sec. 2.2: 1; HF num_nextn_predict_layers, "
                        "Megatron --mtp-num-layers; default 0, also on the deepseek-v3 preset as validated)")


def layout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout")
    g.add_argument("--gpus", type=positive_int, help="total GPUs (default dp*tp*pp*cp)")
    g.add_argument("--gpus-per-node", type=positive_int, default=8)
    g.add_argument("--gpu", type=gpu_name, default="h100-sxm", help=f"one of {', '.join(ACCELERATORS)}")
    for name in ("tp", "pp", "cp", "ep"):
        g.add_argument(f"--{name}", type=positive_int, default=1)
    g.add_argument("--etp", type=positive_int, default=1, metavar="T",
                   help="expert tensor parallel size (Megatron --expert-tensor-parallel-size; default 1)")
    g.add_argument("--dp", type=positive_int, help="data parallel size (default gpus/(tp*pp*cp))")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    g.add_argument("--recompute", choices=RECOMPUTE_OPTIONS,
                   help="activation recomputation (Korthikanti et al. 2022): 'selective' drops the "
                        "s^2 attention terms (FlashAttention's footprint already), 'full' keeps each "
                        "layer's input, 'op' is torchtitan's per-op selective checkpointing (default "
                        "none; flops and comm: selective, FlashAttention's backward recomputing the scores)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                   help="pipeline schedule; 'interleaved' needs --pp >= 2, --virtual-stages >= 2 and "
                        "--microbatches a multiple of --pp (Megatron-LM); 'dualpipe' (DeepSeek-V3) an even "
                        "--pp and even --microbatches >= 2 x --pp")
    g.add_argument("--virtual-stages", type=positive_int, default=1,
                   help="model chunks per pipeline rank (interleaved schedule only)")
    g.add_argument("--micro-batch", dest="micro_batch_size", type=positive_int, default=1,
                   help="sequences per micro-batch per replica (Megatron's --micro-batch-size)")
    g.add_argument("--microbatches", dest="num_microbatches", type=positive_int, default=1,
                   help="micro-batches per step per pipeline (Megatron's num_microbatches)")
    g.add_argument("--offload", choices=OFFLOAD, default="none")


def finetune_args(p: argparse.ArgumentParser) -> None:
    """``--finetune``, ``--lora-rank`` and ``--lora-targets`` (:mod:`dtlib.analytic.finetune`), in their own group."""
    g = p.add_argument_group("fine-tuning (docs/finetune.md)")
    g.add_argument("--finetune", choices=FINETUNE, default=None,
                   help="full: every weight trained (as pre-training, the default); lora: adapters on frozen "
                        "weights (Hu et al. 2021)")
    g.add_argument("--lora-rank", type=positive_int, default=None, metavar="R", help="LoRA rank r (>= 1; with --finetune lora)")
    g.add_argument("--lora-targets", type=_targets, default=None, metavar="NAME[,NAME...]",
                   help=f"matrices given adapters, HF PEFT target_modules names: {', '.join(LORA_TARGETS)} "
                        f"(default {','.join(DEFAULT_LORA_TARGETS)}, PEFT's for Llama)")


def _targets(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    wrong = [t for t in names if t not in LORA_TARGETS]
    if not names or wrong:
        raise argparse.ArgumentTypeError(f"must be names from {', '.join(LORA_TARGETS)}, got {text!r}")
    return names


def finetune_from_args(args: argparse.Namespace) -> FineTuning:
    """The :class:`~dtlib.analytic.finetune.FineTuning` of the flags (``--lora-*`` only with ``--finetune lora``)."""
    method = args.finetune or "full"
    if method != "lora":
        given = [flag for flag, value in (("--lora-rank", args.lora_rank), ("--lora-targets", args.lora_targets))
                 if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} given without --finetune lora; valid: --finetune lora "
                             f"--lora-rank R [--lora-targets ...], or neither")
        return FineTuning(method)
    if args.lora_rank is None:
        raise ValueError("--finetune lora needs --lora-rank R (an integer >= 1; 8 or 16 are common)")
    return FineTuning("lora", rank=args.lora_rank, targets=args.lora_targets)


def packing_args(p: argparse.ArgumentParser, flops: bool = True) -> None:
    """``--packed-doc-length`` (and, where model FLOPs are counted, ``--packed-flops``): sequences packed
    from documents, attention within each (docs/plan.md, "Packed sequences")."""
    g = p.add_argument_group("packed sequences (docs/plan.md)")
    g.add_argument("--packed-doc-length", type=_integer_or_text, default=None, metavar="TOKENS",
                   help="each sequence packed from documents of TOKENS tokens (1..seq, their mean E[l^2]/E[l] "
                        "when lengths vary), attention within each (NeMo packed_sequence_specs, Megatron-Core "
                        "THD, FlashAttention varlen, TRL packing, torchtitan document masking)")
    if flops:
        g.add_argument("--packed-flops", choices=PACKED_FLOPS, default="sequence",
                       help="what model FLOPs and MFU count of packed attention: the whole sequence (default, "
                            "as Megatron-LM and torchtitan log MFU) or the documents")


def _integer_or_text(text: str) -> Any:
    """An integer, or the text as given for :func:`packed_from_args` to refuse with the valid range."""
    try:
        return int(text.strip())
    except ValueError:
        return text


def packed_from_args(args: argparse.Namespace, model: "TransformerConfig | float") -> int | None:
    """``--packed-doc-length`` checked against the sequence length (1..seq; a model shape only)."""
    if args.packed_doc_length is None:
        if getattr(args, "packed_flops", "sequence") != "sequence":  # a convention for packed attention only
            raise validate.InvalidArgument("packed_flops", "'sequence' (the default) unless --packed-doc-length "
                                           "is given: nothing is packed", args.packed_flops)
        return None
    if not isinstance(model, TransformerConfig):
        raise validate.InvalidArgument("packed_doc_length", "unset with a bare parameter count (no attention "
                                       "to pack; give a model shape)", args.packed_doc_length)
    seq = getattr(args, "seq", None)
    return check_packed(args.packed_doc_length, model.seq if seq is None else seq)


def packed_note(packed_doc_length: int | None, packed_flops: str | None = None) -> list[str]:
    """The ``assumed`` words for packed sequences (none when not packed)."""
    if packed_doc_length is None:
        return []
    counted = "" if packed_flops is None else (
        "; model FLOPs and MFU count attention over " + ("the whole sequence (--packed-flops sequence, as "
        "Megatron-LM and torchtitan log MFU)" if packed_flops == "sequence" else "the documents (--packed-flops "
        "documents), as the kernels run it"))
    return [f"packed sequences: documents of {packed_doc_length:,} tokens each (equal lengths assumed; varying "
            f"lengths need --packed-doc-length E[l^2]/E[l]), causal attention within each{counted}"]


# One precision vocabulary for every subcommand (memory, comm, plan): the training precision,
# mixed for 16 bits (16-bit weights and activations, fp32 master weights), as PyTorch Lightning's
# "bf16-mixed" means. The long spellings memory used to take stay accepted.
PRECISION_NAMES = ("bf16", "fp16", "fp32", "fp8", "nvfp4")
PRECISION_ALIASES = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}
PRECISION_HELP = "bf16 and fp16 are mixed precision with fp32 master weights; bf16-mixed, fp16-mixed: old spellings"


def precision_choice(valid: tuple[str, ...]) -> Callable[[str], str]:
    """``--precision``'s argparse type: one of ``valid`` (a subset of :data:`PRECISION_NAMES`), or
    an old spelling of one (:data:`PRECISION_ALIASES`)."""
    def parse(text: str) -> str:
        name = PRECISION_ALIASES.get(text, text)
        if name not in valid:
            old = [alias for alias, new in PRECISION_ALIASES.items() if new in valid]
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(valid)}"
                                             + (f" (or the old spelling {', '.join(old)})" if old else "")
                                             + f", got {text!r}")
        return name
    parse.__name__ = "precision"
    return parse


def precision_args(p: argparse.ArgumentParser, activations: bool = False) -> None:
    """Precision flags; ``activations`` (``dtlib memory``) adds :func:`convention_args`, else a
    ``--convention`` of precision conventions only."""
    g = p.add_argument_group("precision")
    if activations:
        convention_args(g)
    else:
        g.add_argument("--convention", choices=tuple(CONVENTIONS), action="append", metavar="NAME",
                       help=f"a precision convention (overrides the above): {', '.join(CONVENTIONS)}")
    names = ("bf16", "fp16", "fp32", "fp8", "nvfp4") if activations else ("bf16", "fp16", "fp32")
    g.add_argument("--precision", type=precision_choice(names), default=None, metavar="{" + ",".join(names) + "}",
                   help=PRECISION_HELP + ("; fp8 / nvfp4: bf16 mixed precision with FP8 / NVFP4 matmuls (what "
                                          "the stack then stores; nvfp4 needs a Blackwell --gpu); default: the "
                                          "--stack's precision convention"
                                          if activations else "; default bf16"))
    g.add_argument("--grad-dtype", choices=("bf16", "fp16", "fp32"))
    g.add_argument("--optimizer", choices=OPTIMIZERS)
    g.add_argument("--fp32-grad-copy", action="store_true", help="Megatron fp16: +4 bytes/param")


def _variant(args: argparse.Namespace) -> dict[str, Any]:
    """The MoE/attention flags given, as TransformerConfig fields; ``--top-k`` checked against
    ``--experts`` here, before any model is built."""
    given = {field: getattr(args, field, None) for field in _VARIANT_FLAGS}
    given = {field: value for field, value in given.items() if value is not None}
    if getattr(args, "dropless", False) and args.params is None:  # a preset's capacity factor goes
        given["moe_capacity_factor"] = None
    experts, top_k = given.get("moe_experts"), given.get("moe_top_k")
    if experts and top_k is not None and top_k > experts:
        raise ValueError(f"--top-k must be an integer from 1 to {experts} (the --experts), got {top_k}")
    if experts and top_k is None and args.model is None:
        raise ValueError(f"--experts {experts} needs --top-k (experts per token, 1 to {experts})")
    return given


def _flags_in(text: str) -> str:
    """``text`` with every TransformerConfig field of :data:`MODEL_FLAGS` written as its flag."""
    for field in sorted(MODEL_FLAGS, key=len, reverse=True):
        text = re.sub(rf"\b{field}\b", MODEL_FLAGS[field], text)
    return text


def _built(build: Callable[[], Any]) -> Any:
    """Build a model; a bad field is reported with its flag (``moe_top_k`` -> ``--top-k``)."""
    try:
        return build()
    except validate.InvalidArgument as exc:
        raise validate.InvalidArgument(MODEL_FLAGS.get(exc.name, flag_of(exc.name)),
                                       _flags_in(exc.requirement), exc.value) from None
    except ValueError as exc:
        raise ValueError(_flags_in(str(exc))) from None


def model_from_args(args: argparse.Namespace) -> "TransformerConfig | float":
    if getattr(args, "preset", None) is not None:
        if args.model is not None and args.model != args.preset:
            raise ValueError(f"two models given: {args.preset!r} and --model {args.model!r}; give one")
        args.model = args.preset
    shape = [args.layers, args.hidden, args.heads]
    given = sum(x is not None for x in (args.model, args.params)) + any(v is not None for v in shape)
    if given != 1:
        raise ValueError("give exactly one of --model PRESET, --params N, or --layers/--hidden/--heads")
    custom_only = {"--kv-heads": args.kv_heads, "--ffn": args.ffn, "--vocab": args.vocab,
                   "--activation": args.activation}
    if args.model is not None or args.params is not None:
        ignored = [flag for flag, value in custom_only.items() if value is not None]
        if ignored:
            raise ValueError(f"{', '.join(ignored)} only describe a custom shape (--layers/--hidden/"
                             f"--heads); a preset or a bare parameter count has its own")
    variant = _variant(args)
    if args.params is not None and variant:
        flags = ", ".join(_VARIANT_FLAGS[f] for f in variant)
        raise ValueError(f"{flags} describe a model shape; a bare parameter count (--params) has none")
    if args.model is not None:
        preset = resolve_model(args.model)
        return _built(lambda: preset.with_(**variant)) if variant else preset
    if args.params is not None:
        return resolve_model(args.params)
    if None in shape:
        raise ValueError("a custom shape needs all of --layers, --hidden and --heads")
    return _built(lambda: TransformerConfig(
        layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn,
        vocab=50257 if args.vocab is None else args.vocab, seq=2048 if args.seq is None else args.seq,
        activation=args.activation or "gelu", **variant))


def layout_from_args(args: argparse.Namespace, shape: dict[str, Any] | None = None) -> Parallelism:
    """The layout of the flags; ``dp`` defaults to ``--gpus`` / (tp*pp*cp). When ``--gpus`` does
    not divide, the suggestion is the smallest larger count that satisfies every rule of
    :data:`~dtlib.analytic.layout.RULES` for this model (``shape``), not only divisibility."""
    for name in ("tp", "pp", "cp", "ep"):
        validate.integer(name, getattr(args, name))
    etp = getattr(args, "etp", 1)
    explicit = getattr(args, "pipeline_layout", False)
    if isinstance(explicit, str):  # the layout string fixes the chunks per rank, and so the schedule
        v = PipelineLayout(explicit).virtual_stages(args.pp)
        if args.virtual_stages == 1 and v > 1:
            args.virtual_stages = v
            args.schedule = "interleaved" if args.schedule == "1f1b" else args.schedule
    model_parallel = args.tp * args.pp * args.cp
    dp = args.dp
    if dp is None:
        gpus = model_parallel if args.gpus is None else validate.integer("gpus", args.gpus)
        if gpus % model_parallel:
            raise ValueError(f"--gpus {gpus} is not divisible by tp*pp*cp = {model_parallel}; "
                             + _suggest_gpus(args, shape or {}, gpus, model_parallel))
        dp = gpus // model_parallel
    return Parallelism(dp=dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, etp=etp, zero=args.zero,
                       sequence_parallel=args.sequence_parallel, schedule=args.schedule,
                       virtual_stages=args.virtual_stages, micro_batch_size=args.micro_batch_size,
                       num_microbatches=args.num_microbatches, recompute=args.recompute or "none",
                       offload=args.offload, recompute_layers=getattr(args, "recompute_layers", None),
                       account_for_embedding_and_loss=getattr(args, "account_for_embedding_and_loss", False),
                       activation_offload_layers=getattr(args, "activation_offload_layers", None),
                       recompute_modules=getattr(args, "recompute_modules", None) or (),
                       first_stage_layers=getattr(args, "first_stage_layers", None),
                       last_stage_layers=getattr(args, "last_stage_layers", None),
                       pipeline_layout=getattr(args, "pipeline_layout", False))


def _suggest_gpus(args: argparse.Namespace, shape: dict[str, Any], gpus: int, model_parallel: int,
                  tries: int = 4096) -> str:
    """The smallest multiple of tp*pp*cp above ``gpus`` whose layout breaks no rule, or, when none
    does, the rule that no GPU count can fix (e.g. tp=3 and 32 heads)."""
    def first_broken(dp: int) -> str | None:
        n = dict(shape, dp=dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                 etp=getattr(args, "etp", 1), zero=args.zero,
                 sequence_parallel=bool(args.sequence_parallel), virtual_stages=args.virtual_stages,
                 micro_batch_size=args.micro_batch_size, num_microbatches=args.num_microbatches,
                 shard_size=dp * args.cp)
        return next((message(**{f: n[f] for f in fields})
                     for valid, message, fields in broken_rules(n, args.schedule, args.offload,
                                                                bool(getattr(args, "account_for_embedding_and_loss", False)))
                     if not bool(valid)), None)

    first = -(-gpus // model_parallel)
    for dp in range(first, first + tries):
        if first_broken(dp) is None:
            return f"the next valid count is --gpus {dp * model_parallel}"
    return f"no GPU count fixes this layout: {first_broken(first)}"


def checked_layout(args: argparse.Namespace, model: "TransformerConfig | float") -> Parallelism:
    """The layout, checked against the model shape and the GPU count (as memory_per_gpu does)."""
    shape = model.numbers(args.seq) if isinstance(model, TransformerConfig) else {}
    layout = layout_from_args(args, shape)
    check_layout(layout.numbers(**shape, gpus=args.gpus), layout.schedule, layout.offload,
                 layout.account_for_embedding_and_loss)
    return layout


def training_defaults(args: argparse.Namespace, model: "TransformerConfig | float") -> list[str]:
    """``flops`` and ``comm``: ``--recompute`` left unset is today's convention
    (:data:`dtlib.analytic.presets.TODAY`): FlashAttention's backward recomputes the attention
    scores (Dao et al. 2022, Sec. 3.1), which is selective recompute's work. Returns the note."""
    if args.recompute is not None:
        return []
    if not isinstance(model, TransformerConfig):  # a bare count has no attention to recompute
        args.recompute = "none"
        return []
    args.recompute = "selective"
    return ["assuming FlashAttention-style attention, whose backward recomputes the attention scores "
            "(counted as --recompute selective; give --recompute none for explicit attention)"]


def recompute_detail_args(g: Any) -> None:
    """``--recompute-layers``, ``--account-for-embedding-and-loss`` and ``--activation-offload-layers``
    (memory and plan: what the layout keeps; flops and comm do not count them)."""
    g.add_argument("--recompute-layers", type=non_negative_int, default=None, metavar="N",
                   help="Megatron --recompute-method block --recompute-num-layers N: the first N layers "
                        "of each model chunk fully recomputed, the others as --recompute says")
    g.add_argument("--account-for-embedding-and-loss", action="store_true",
                   help="Megatron --account-for-embedding-in-pipeline-split --account-for-loss-in-"
                        "pipeline-split: the first and last chunk hold one layer fewer (Llama 3, Sec. 3.3.2)")
    g.add_argument("--first-stage-layers", type=positive_int, default=None, metavar="N",
                   help="Megatron --decoder-first-pipeline-num-layers N: an uneven split, N layers on the first "
                        "pipeline rank, the middle ranks sharing the rest evenly")
    g.add_argument("--last-stage-layers", type=positive_int, default=None, metavar="N",
                   help="Megatron --decoder-last-pipeline-num-layers N: N layers on the last pipeline rank")
    g.add_argument("--pipeline-layout", nargs="?", const=True, default=False, metavar="LAYOUT",
                   help="Megatron --pipeline-model-parallel-layout: alone, the layers spread as evenly as the pp x "
                        "virtual-stages chunks allow; with a string, that layout (e.g. 'Et*3|(tt|)*29m|L': E "
                        "embedding, t layer, m MTP layer, L loss, | between chunks; needs --pp, virtual stages = "
                        "chunks / pp)")
    g.add_argument("--activation-offload-layers", type=non_negative_int, default=None, metavar="N",
                   help="Megatron --cpu-offloading-num-layers N / DeepSpeed cpu_checkpointing: the activations "
                        "of N layers of each chunk kept in CPU memory")
    g.add_argument("--recompute-modules", type=recompute_modules, default=None, metavar="M[,M...]",
                   help="Megatron-Core --recompute-granularity selective --recompute-modules: the submodules "
                        f"whose tensors are recomputed in backward, of {', '.join(RECOMPUTE_MODULES)} "
                        "(with --recompute none or selective)")


def convention_args(g: Any, precision: bool = True) -> None:
    """``--convention`` (repeatable: one activation convention and, with ``precision``, one
    precision convention), ``--stack``, ``--dropout`` and ``--flash-attention``."""
    names = tuple(ACTIVATION_CONVENTIONS) + (tuple(CONVENTIONS) if precision else ())
    g.add_argument("--convention", choices=names, action="append", metavar="NAME",
                   help="how activations are counted: 'today' (default: FlashAttention-style attention, "
                        "no dropout) or 'korthikanti-2022' (the paper's GPT counting: explicit attention "
                        "and dropout masks)" + ("; or a precision convention (bytes per parameter): "
                        + ", ".join(CONVENTIONS) if precision else "") + "; repeatable, one of each")
    g.add_argument("--stack", choices=tuple(STACKS), default=DEFAULT_STACK,
                   help="software stack: what it overlaps, fuses and stores (dtlib.analytic.stacks; "
                        f"default {DEFAULT_STACK})")
    g.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=None,
                   help="1-byte dropout masks as Korthikanti et al. count them (default: the convention's, "
                        "none today)")
    g.add_argument("--flash-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="attention never stores the s x s scores (default: the convention's, yes today)")


def conventions_from_args(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``--convention`` split into (activation convention, precision convention), at most one of each."""
    given = args.convention or []
    activation = [c for c in given if c in ACTIVATION_CONVENTIONS]
    prec = [c for c in given if c not in ACTIVATION_CONVENTIONS]
    for kind, names in (("activation", activation), ("precision", prec)):
        if len(names) > 1:
            raise ValueError(f"--convention given two {kind} conventions ({', '.join(names)}); give one")
    return (activation or [None])[0], (prec or [None])[0]


def precision_from_args(args: argparse.Namespace):
    """The precision convention of ``--convention``, or of ``--precision``/``--grad-dtype``/
    ``--optimizer``/``--fp32-grad-copy``; bf16 (or fp8, nvfp4) and none of the others: the ``--stack``'s
    (as ``dtlib plan``; ``dtlib comm`` has no stack: bf16 mixed precision with bf16 gradients)."""
    named = conventions_from_args(args)[1]
    if named:
        return get_precision(named)
    # bf16 (or fp8 matmuls) on this stack: the stack's convention, as dtlib plan counts it
    if args.precision in (None, "bf16", "fp8", "nvfp4") and args.grad_dtype is None and args.optimizer is None \
            and not args.fp32_grad_copy:
        # dtlib memory has --stack; dtlib comm keeps bf16 mixed precision
        return get_precision(STACKS[args.stack].precision if hasattr(args, "stack") else "bf16-mixed")
    # fp8 / nvfp4 matmuls: bf16 mixed weights
    dtype = "bf16" if args.precision in (None, "fp8", "nvfp4") else args.precision
    recipe = {"bf16": "bf16-mixed", "fp16": "fp16-mixed", "fp32": "fp32"}[dtype]  # PRECISIONS' spelling
    return precision(recipe, args.grad_dtype, args.optimizer or "adam", args.fp32_grad_copy)


# ---- output ------------------------------------------------------------------------------------
def table(rows: list[tuple[str, str]], title: str) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join([title, "-" * len(title)] + [f"{k:<{width}}  {v}" for k, v in rows])


def format_bytes_exact(x: float) -> str:
    """Whole bytes while a float holds them exactly (< 2^53), else 4 significant digits: never
    the noise digits of a huge float."""
    return f"{x:,.0f}" if abs(x) < 2 ** 53 else f"{x:.4g}"


def format_gib(x: float | None) -> str:
    if x is None:
        return "n/a (no model shape)"
    gib = f"{x / GiB:10.2f}" if x < 1e6 * GiB else f"{x / GiB:10.4g}"
    return f"{gib} GiB  ({format_bytes_exact(x)} B)"


def emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> int:
    # allow_nan=False: JSON has no NaN or Infinity, and the inputs are checked so none can arise
    print(json.dumps(data, indent=2, default=str, allow_nan=False) if args.json else text)
    return 0

