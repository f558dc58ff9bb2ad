"""The DeepSpeed JSON of a planned layout.

Source: DeepSpeed 0.19 ``deepspeed/runtime/config.py`` and ``constants.py`` (the installed version).
"""
from __future__ import annotations

from typing import Any

from dtlib.analytic import validate
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism
from dtlib.plan.emit.common import ADAMW, GRADIENT_CLIPPING, model_code_note, refuse
from dtlib.plan.emit.timed import TimedPlan, as_plan, dp_overlap, precision_bytes, run_options, without
from dtlib.plan.steptime import StepOptions


def unsupported_here(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    out = []
    if p.cp > 1:
        out.append(f"cp={p.cp}: DeepSpeed has no ring context parallelism (DeepSpeed-Ulysses splits the "
                   f"sequence with all-to-all over heads: another algorithm)")
    if p.schedule != "1f1b" and p.pp > 1:
        out.append(f"schedule {p.schedule}: DeepSpeed's PipelineEngine runs its 1F1B TrainSchedule only")
    if p.pp > 1 and p.zero >= 2:
        out.append(f"ZeRO-{p.zero} with pp={p.pp}: DeepSpeed refuses it (pipe/engine.py: \"ZeRO-2 and ZeRO-3 "
                   f"are incompatible with pipeline parallelism\")")
    if precision in ("fp8", "nvfp4"):
        out.append(f"precision {precision}: DeepSpeed's config has bf16 and fp16 only; {precision.upper()} matmuls "
                   f"come from Transformer Engine layers in the model's code")
    if p.shard_size is not None:
        out.append(f"shard_size {p.shard_size}: hybrid sharding (DeepSpeed MiCS) is not emitted")
    return out

def realize(plan: TimedPlan, o: StepOptions) -> dict[str, tuple[Any, str]]:
    """The timed options DeepSpeed's JSON cannot run as they are (the model's own code, not the
    JSON, decides its kernels: the deepspeed stack's eager ones are what is timed)."""
    p = plan.layout
    out = without(o, p, {"tp_overlap": "DeepSpeed has no TP communication overlap",
                         "ep_overlap": "DeepSpeed-MoE has no all-to-all overlap key"},
                  fused="the JSON has no fusion key (the model's code decides; dtlib's deepspeed stack is eager)",
                  flash="the JSON has no attention key: dtlib's deepspeed stack runs the model's SDPA (Hugging "
                        "Face's default)")
    if p.zero == 0 and p.dp > 1 and dp_overlap(o, p):
        out["dp_overlap"] = (0.0, "ZeRO-0: DeepSpeed's engine all-reduces the gradients after backward "
                                  "(overlap_comm is a ZeRO key): re-timed with it exposed")
    if precision_bytes(o.precision) != precision_bytes("zero"):
        out["precision"] = ("zero", "DeepSpeed's bf16/fp16 ZeRO keeps 16-bit gradients and fp32 master weights "
                                    "and Adam states (2 + 2 + 12 bytes): re-timed with those bytes")
    if p.ep > 1 and o.moe_dispatcher == "alltoall":
        out["moe_dispatcher"] = ("flex", "DeepSpeed-MoE applies combine_weights on the token's own rank "
                                             "(moe/sharded_moe.py): "
                                             "no probabilities all-to-all; re-timed without it")
    return out


def deepspeed_config(plan: TimedPlan | Parallelism, model: TransformerConfig | None = None,
                     global_batch: int | None = None, precision: str = "bf16",
                     *, gradient_clipping: float = GRADIENT_CLIPPING) -> dict[str, Any]:
    """The DeepSpeed JSON of the timed plan (or of a bare layout, on the deepspeed stack): batch
    sizes (DeepSpeed checks train_batch_size = micro x accumulation x its data-parallel size),
    ZeRO stage, overlap and offload, precision, clipping and an AdamW block."""
    plan = as_plan(plan, model, global_batch, precision, "deepspeed")
    refuse("deepspeed", unsupported_here, plan.layout, plan.model, plan.global_batch, plan.precision)
    validate.number("gradient_clipping", gradient_clipping, minimum=0, exclusive=False)
    o, _ = run_options("deepspeed", plan, realize)
    p, precision, global_batch = plan.layout, plan.precision, plan.global_batch
    zero: dict[str, Any] = {"stage": p.zero}
    if p.zero >= 1:  # overlap the reduce with backward as timed, gradients in one buffer (DeepSpeed docs)
        zero.update(overlap_comm=bool(dp_overlap(o, p)), contiguous_gradients=True)
    if p.offload in ("optimizer", "params"):  # ZeRO-Offload (Ren et al. 2021): optimizer and its gradients
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if p.offload == "params":  # ZeRO-Infinity: the parameter shards too (stage 3)
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": p.micro_batch_size,
        "gradient_accumulation_steps": p.num_microbatches,
        "zero_optimization": zero,
        "gradient_clipping": float(gradient_clipping),
        "optimizer": {"type": "AdamW", "params": dict(ADAMW)},
    }
    if precision in ("bf16", "fp16"):
        config[precision] = {"enabled": True}
    if p.recompute == "full":  # DeepSpeed's checkpointing settings; the model calls deepspeed.checkpointing.checkpoint
        config["activation_checkpointing"] = {"partition_activations": p.tp > 1, "contiguous_memory_optimization": False}
    return config


def notes(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    notes = [f"gradient_clipping {GRADIENT_CLIPPING} written out: DeepSpeed 0.19 clips at 1.0 when the key is "
             f"absent; set 0.0 to train without clipping"]
    if p.tp * p.pp > 1:
        notes.append(f"DeepSpeed alone runs DP x ZeRO: its data-parallel size is world / (tp x pp), so tp={p.tp}, "
                     f"pp={p.pp} need Megatron-DeepSpeed (its flags carry them; this JSON is its --deepspeed_config)")
    if p.ep > 1:
        notes.append(f"ep={p.ep}: DeepSpeed-MoE takes ep_size in the model's deepspeed.moe.layer.MoE(...), not the JSON")
    if p.sequence_parallel:
        notes.append("sequence parallelism is Megatron-DeepSpeed's --sequence-parallel, not a JSON key")
    if p.recompute != "none":
        notes.append(f"recompute {p.recompute}: the model's code decides what to recompute "
                     f"(deepspeed.checkpointing.checkpoint per block for full)")
    notes.append(model_code_note(m, "the training script's (a Hugging Face config.json or Megatron-DeepSpeed's flags)"))
    return notes
