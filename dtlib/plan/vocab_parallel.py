"""The tensor-parallel collectives outside the transformer layers: the vocabulary-parallel embedding,
the output layer (LM head) and the vocabulary-parallel cross-entropy, per micro-batch on one TP rank.

Read from Megatron-LM's ``megatron/core`` at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553
(2026-08-22), the layout :mod:`dtlib.parallel.tensor` follows:

* ``tensor_parallel/layers.py`` ``VocabParallelEmbedding.forward``: each rank looks up its
  vocabulary rows and the partial embeddings are summed, ``reduce_from_tensor_model_parallel_region``
  (an all-reduce forward, nothing backward: the input is token ids), or under sequence parallelism
  ``reduce_scatter_to_sequence_parallel_region`` (a reduce-scatter forward, its all-gather backward);
* the output layer is a ``ColumnParallelLinear``: its replicated input's gradient is all-reduced
  backward (``allreduce_dgrad``, ``copy_to_tensor_model_parallel_region``), or under sequence
  parallelism its input is all-gathered forward and the gradient reduce-scattered backward;
* ``tensor_parallel/cross_entropy.py`` ``_VocabParallelCrossEntropy.forward``: three all-reduces of
  ``[s, b]`` fp32 statistics (the logits' maximum, the target's logit, the sum of exponentials) and
  none backward; ``fusions/fused_cross_entropy.py`` (``--cross-entropy-loss-fusion``, ``native``)
  sends the two sums as one ``[2, s, b]`` message: two all-reduces, as
  :func:`dtlib.parallel.tensor.vocab_parallel_cross_entropy` does.

None of them is in a transformer layer, so full recomputation repeats none of them. The embedding is
on the first pipeline stage, the output layer and loss on the last; each multi-token-prediction
layer (DeepSeek-V3 Sec. 2.2; Megatron-Core ``multi_token_prediction.py``) embeds, projects and takes
a loss again on its stage. Like the layers' term, the re-gather of a column-parallel layer's input
in backward under sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2) is not counted.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from dtlib.analytic import validate

__all__ = ["CROSS_ENTROPY_ALL_REDUCES", "STATS_BYTES", "vocab_parallel_collectives"]

# all-reduces of the vocabulary-parallel cross-entropy per loss: Megatron-Core's
# vocab_parallel_cross_entropy (3) or its fused one and dtlib.parallel.tensor's (2)
CROSS_ENTROPY_ALL_REDUCES = (2, 3)
STATS_BYTES = 4  # the loss's statistics are fp32: both implementations cast the logits with .float()


def vocab_parallel_collectives(tokens: Any, hidden: Any, act_bytes: Any, sequence_parallel: Any,
                               embeddings: Any, heads: Any,
                               cross_entropy_all_reduces: int = 3) -> list[tuple[str, str, Any, Any]]:
    """The collectives one TP rank makes outside the transformer layers per micro-batch, forward and
    backward, as ``(part, op, bytes, calls)``: ``part`` is ``embedding``, ``output_layer`` or
    ``cross_entropy``, ``bytes`` is the buffer nccl-tests sizes (the whole
    ``tokens x hidden`` activation for the all-gather's output and the reduce-scatter's input, as
    :class:`dtlib.measure.CollectiveCounter` records it), ``calls`` how many of that message.

    ``tokens``: the micro-batch's tokens on the rank before sequence sharding (``b s / cp``);
    ``embeddings`` / ``heads``: how many embedding lookups and output layers + losses the stage
    holds (1 on the first / last stage, + one each per MTP layer there). Arrays broadcast."""
    validate.one_of("cross_entropy_all_reduces", cross_entropy_all_reduces, CROSS_ENTROPY_ALL_REDUCES)
    sp = np.asarray(sequence_parallel, dtype=bool)
    act = np.asarray(tokens) * hidden * act_bytes
    stats = np.asarray(tokens) * STATS_BYTES
    sums = cross_entropy_all_reduces - 1  # the target logit and the sum of exp: 2 messages, or 1 of both
    # (the loss's calls "+ 0 * sp": every entry broadcast to the layouts' shape)
    return [
        ("embedding", "all_reduce", act, embeddings * ~sp),          # forward
        ("embedding", "reduce_scatter", act, embeddings * sp),       # forward, SP
        ("embedding", "all_gather", act, embeddings * sp),           # its backward, SP
        ("output_layer", "all_reduce", act, heads * ~sp),            # the input's gradient, backward
        ("output_layer", "all_gather", act, heads * sp),             # the input, forward, SP
        ("output_layer", "reduce_scatter", act, heads * sp),         # its gradient, backward, SP
        ("cross_entropy", "all_reduce", stats, heads + 0 * sp),      # the logits' maximum
        ("cross_entropy", "all_reduce", 2 * stats / sums, sums * heads + 0 * sp),  # the two sums
    ]
