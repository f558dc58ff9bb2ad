"""Parallelism, written from scratch and checked against PyTorch's own.

One concept per module:

* :mod:`~dtlib.parallel.collectives` - ring reduce-scatter / all-gather / all-reduce from
  point-to-point messages, and the two-level hierarchical all-reduce;
* :mod:`~dtlib.parallel.ddp` - :class:`NaiveDDP` and :class:`BucketedDDP` (buckets, overlap,
  ``no_sync``, unused parameters, a recorded timeline);
* :mod:`~dtlib.parallel.compression` - communication hooks: fp16/bf16, top-k, PowerSGD;
* :mod:`~dtlib.parallel.zero` - :class:`ShardedOptimizer` (ZeRO stages 1 and 2);
* :mod:`~dtlib.parallel.fsdp` - :class:`FSDP`, a toy ZeRO-3;
* :mod:`~dtlib.parallel.clip` - :func:`clip_grad_norm_`: the global gradient norm, clipped, right for
  every layout (``torch.nn.utils.clip_grad_norm_`` is not, on sharded or split parameters);
* :mod:`~dtlib.parallel.buckets` - the flat-buffer and bucket bookkeeping they share;
* :mod:`~dtlib.parallel.tensor_regions` - the f/g operators of tensor and sequence parallelism;
* :mod:`~dtlib.parallel.tensor` - Megatron-LM's column- and row-parallel layers, vocabulary-parallel
  embedding and loss, :func:`tensor_parallel` to split a TinyGPT;
* :mod:`~dtlib.parallel.dtensor` - PyTorch's own TP on a TinyGPT, the reference for the above;
* :mod:`~dtlib.parallel.schedules` - pipeline schedules as data (GPipe, 1F1B, interleaved, ZB-H1),
  their validator and simulator;
* :mod:`~dtlib.parallel.pipeline` - TinyGPT cut into stages and the executor that runs a schedule
  on real ranks;
* :mod:`~dtlib.parallel.mesh` - the rank grid (Megatron-LM's order) and its process groups;
* :mod:`~dtlib.parallel.context` - context parallelism: causal ring attention, zig-zag split;
* :mod:`~dtlib.parallel.expert` - expert parallelism: MoE all-to-all dispatch and combine;
* :mod:`~dtlib.parallel.local_sgd` - :class:`LocalSGD` and :class:`DiLoCo`: synchronise every H steps;
* :mod:`~dtlib.parallel.parameter_server` - asynchronous SGD with a parameter server, SSP's bound;
* :mod:`~dtlib.parallel.heterogeneous` - slower ranks injected; throughput-proportional batches,
  the sample-weighted gradient average, time-balanced pipeline stages.
"""

from dtlib.extras import require

require("course", "torch", feature=__name__)
from dtlib.parallel.buckets import FlatLayout, assign_buckets, shard_bounds
from dtlib.parallel.clip import clip_grad_norm_, grad_norm
from dtlib.parallel.collectives import (hierarchical_all_reduce, ring_all_gather, ring_all_reduce,
                                        ring_reduce_scatter, ring_schedule)
from dtlib.parallel.compression import (PowerSGDState, TopKState, allreduce_hook,
                                        bf16_compress_hook, fp16_compress_hook, powersgd_hook,
                                        powersgd_plan, topk_hook)
from dtlib.parallel.context import context_parallel, ring_attention, shard_sequence
from dtlib.parallel.ddp import BucketedDDP, GradBucket, NaiveDDP, SyncRecord
from dtlib.parallel.expert import ExpertParallelMoE, all_to_all, expert_parallel
from dtlib.parallel.fsdp import FSDP
from dtlib.parallel.heterogeneous import (proportional_batch_sizes, slowed, time_balanced_counts,
                                          weighted_average_gradients)
from dtlib.parallel.local_sgd import DiLoCo, LocalSGD, outer_nesterov_step
from dtlib.parallel.mesh import ParallelLayout, build_groups
from dtlib.parallel.parameter_server import async_sgd, staleness_bound
from dtlib.parallel.pipeline import (GPTStage, PipelineExecutor, StepLog, partition, rank_chunks,
                                     timeline_of)
from dtlib.parallel.schedules import Action, Event, Timeline, fit_costs, schedule, simulate, validate
from dtlib.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                   full_state_dict, tensor_parallel, vocab_parallel_cross_entropy)
from dtlib.parallel.zero import ShardedOptimizer

__all__ = [
    "ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "ring_schedule",
    "hierarchical_all_reduce",
    "NaiveDDP", "BucketedDDP", "GradBucket", "SyncRecord",
    "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "TopKState", "topk_hook",
    "PowerSGDState", "powersgd_hook", "powersgd_plan",
    "ShardedOptimizer", "FSDP", "clip_grad_norm_", "grad_norm",
    "tensor_parallel", "full_state_dict", "ColumnParallelLinear", "RowParallelLinear",
    "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "FlatLayout", "assign_buckets", "shard_bounds",
    "Action", "Event", "Timeline", "schedule", "simulate", "validate", "fit_costs",
    "GPTStage", "partition", "rank_chunks", "PipelineExecutor", "StepLog", "timeline_of",
    "ParallelLayout", "build_groups", "ring_attention", "context_parallel", "shard_sequence",
    "ExpertParallelMoE", "expert_parallel", "all_to_all",
    "LocalSGD", "DiLoCo", "outer_nesterov_step", "async_sgd", "staleness_bound",
    "slowed", "proportional_batch_sizes", "weighted_average_gradients", "time_balanced_counts",
]
