"""The search: every returned layout is valid, fits and keeps the global batch; the best equals a
brute force over scalar layouts written independently here; pins and explanations."""
import itertools

import pytest

from dtlib.analytic.hardware import cluster
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import memory_per_gpu
from dtlib.analytic.presets import get_preset
from dtlib.models import TransformerConfig
from dtlib.plan.search import search, to_layout
from dtlib.plan.steptime import StepOptions, step_time

SMALL = TransformerConfig(name="small", layers=4, hidden=512, heads=8, kv_heads=4, vocab=8000, seq=1024,
                          activation="swiglu", bias=False, norm="rmsnorm", position="rope")
OPTIONS = StepOptions(efficiency=0.5)


def test_every_result_is_valid_fits_and_keeps_the_global_batch():
    c = cluster("h100-sxm", 2, 8)
    r = search(get_preset("capstone-10b"), c, 256, options=OPTIONS, top=50)
    assert len(r.configs) == 50 and r.fitting <= r.searched
    times = [x["step_time_s"] for x in r.configs]
    assert times == sorted(times)
    for x in r.configs:
        assert x["dp"] * x["tp"] * x["pp"] * x["cp"] == 16
        assert x["dp"] * x["micro_batch"] * x["microbatches"] == 256
        assert x["tp"] <= 8
        layout = to_layout(x)  # Parallelism re-checks every rule
        # the search counts memory as memory_per_gpu does (default stack and convention: bf16 gradients)
        m = memory_per_gpu(get_preset("capstone-10b"), layout, precision="bf16-mixed")
        assert m.total == pytest.approx(x["memory_per_gpu_bytes"], rel=1e-9)
        assert m.total <= 0.9 * c.gpu.memory_bytes
        assert x["step_time_s"] == pytest.approx(sum(x["breakdown"].values()), rel=1e-12)


def test_the_best_layout_is_the_brute_force_minimum_over_scalar_layouts():
    c = cluster("a100-40gb", 1, 4)
    best = None
    for tp, pp, cp, b, zero, recompute, sp, v in itertools.product(
            (1, 2, 4), (1, 2, 4), (1, 2, 4), (1, 2, 4, 8), (0, 1, 2, 3), ("none", "selective", "full"),
            (False, True), (1, 2, 3, 4, 6, 8)):
        if 4 % (tp * pp * cp) or (sp and tp == 1):
            continue
        dp = 4 // (tp * pp * cp)
        if 16 % (dp * b):
            continue
        try:
            layout = Parallelism(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, recompute=recompute,
                                 sequence_parallel=sp, micro_batch_size=b, num_microbatches=16 // (dp * b),
                                 schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v)
            m = memory_per_gpu(SMALL, layout, precision="megatron-bf16", dropout=True)  # GPT convention
        except ValueError:
            continue
        if m.total > 0.9 * c.gpu.memory_bytes:
            continue
        t = step_time(SMALL, layout, c, options=OPTIONS).step_time
        if best is None or t < best[0]:
            best = (t, layout)
    r = search(SMALL, c, 16, options=OPTIONS, top=1)
    assert r.configs[0]["step_time_s"] == pytest.approx(best[0], rel=1e-12)


def test_all_flags_pinned_evaluate_exactly_that_layout():
    c = cluster("h100-sxm", 1, 8)
    layout = Parallelism(dp=2, tp=2, pp=2, micro_batch_size=2, num_microbatches=4, zero=1,
                         recompute="selective", sequence_parallel=True, schedule="interleaved", virtual_stages=2)
    fixed = dict(dp=2, tp=2, pp=2, cp=1, ep=1, virtual_stages=2, micro_batch_size=2, zero=1,
                 recompute="selective", sequence_parallel=True)
    r = search(SMALL, c, 16, options=OPTIONS, fixed=fixed)
    assert r.searched == 1 and len(r.configs) == 1
    assert r.configs[0]["step_time_s"] == pytest.approx(step_time(SMALL, layout, c, options=OPTIONS).step_time)
    assert to_layout(r.configs[0]) == layout


def test_pinned_knobs_constrain_the_search():
    c = cluster("h100-sxm", 2, 8)
    r = search(SMALL, c, 64, options=OPTIONS, fixed={"tp": 2, "zero": 3}, top=20)
    assert r.configs and all(x["tp"] == 2 and x["zero"] == 3 for x in r.configs)


def test_tensor_parallelism_leaves_the_node_only_when_asked():
    c = cluster("h100-sxm", 2, 4)
    mha = SMALL.with_(kv_heads=8)  # tp 8 divides its heads and KV heads
    inside = search(mha, c, 64, options=OPTIONS, top=10_000)
    assert max(x["tp"] for x in inside.configs) == 4
    across = search(mha, c, 64, options=OPTIONS, top=10_000, tp_within_node=False)
    assert max(x["tp"] for x in across.configs) == 8


def test_nothing_fits_says_the_smallest_memory_and_what_to_change():
    r = search(get_preset("llama3-405b"), cluster("h100-sxm", 1, 8), 8, options=OPTIONS)
    assert r.configs == [] and r.searched > 0 and r.fitting == 0
    assert r.why.startswith("nothing fits: the smallest memory per GPU found is ")
    assert "GiB" in r.why and "72.0 GiB is available" in r.why and "more GPUs" in r.why


def test_no_valid_layout_names_the_broken_rule():
    r = search(SMALL, cluster("h100-sxm", 1, 8), 8, options=OPTIONS, fixed={"tp": 8, "pp": 1, "cp": 1})
    assert r.searched == 0 and "tp=8 must divide the 4 KV heads (kv_heads, Megatron's query groups); valid tp: 1, 2, 4" in r.why
    r = search(SMALL, cluster("h100-sxm", 1, 8), 8, options=OPTIONS, fixed={"tp": 3})
    assert "tp x pp x cp = 3 must divide the 8 GPUs" in r.why
    r = search(SMALL, cluster("h100-sxm", 1, 8), 7, options=OPTIONS, fixed={"dp": 8})
    assert "global batch 7 must be a multiple of dp x micro-batch" in r.why


@pytest.mark.parametrize("kwargs,match", [
    (dict(global_batch=0), "global_batch must be an integer >= 1"),
    (dict(global_batch=2.5), "global_batch must be an integer >= 1"),
    (dict(headroom=0), "headroom must be a finite number > 0 and <= 1, got 0"),
    (dict(top=0), "top must be an integer >= 1"),
    (dict(fixed={"offload_layers": 2}), "cannot fix \\['offload_layers'\\]"),
    (dict(fixed={"schedule": "zb-h1"}), "schedule must be one of 'gpipe', '1f1b', 'interleaved', 'dualpipe', 'dualpipev', got 'zb-h1'"),
    (dict(fixed={"recompute": "most"}), "recompute must be one of"),
])
def test_bad_arguments(kwargs, match):
    args = dict(global_batch=16) | kwargs
    with pytest.raises(ValueError, match=match):
        search(SMALL, cluster("h100-sxm", 1, 8), args.pop("global_batch"), **args)


def test_the_whole_search_of_a_10b_model_on_10000_gpus_times_every_candidate():
    # its speed (the 1 s) is measured in benchmarks/bench_plan_search.py, not here
    model = get_preset("capstone-10b")
    r = search(model, cluster("h100-sxm", 1250, 8), 5000, top=5)
    # 10,590 fit: the default stack's fused SwiGLU keeps 3 FFN-wide tensors, not 4 (speed: benchmarks/);
    # splits Megatron's even rule refuses are placed by a layout string, one more layer only on the
    # chunks that take the remainder (before: the whole first rank rounded up, 10,569)
    assert r.searched == 10_788 and r.fitting == 10_590 and len(r.configs) == 5


def test_a_top_1_search_names_the_same_best_layout_as_a_top_5_one():
    """Equal step times are ordered by memory in every search (lesson 10: the search ranked ZeRO-3
    first while check_design's top-1 search called the tied ZeRO-2 layout the best). BERT-large on
    4 nodes: ZeRO-2 and ZeRO-1 at micro-batch 8 tie (the same reduce-scatter and gather, hidden
    alike), and ZeRO-2 keeps less memory."""
    model = get_preset("bert-large")
    cl = cluster("h100-sxm", nodes=4, gpus_per_node=8, inter="ib-ndr")
    five = search(model, cl, global_batch=256, top=5).configs
    one = search(model, cl, global_batch=256, top=1).configs
    assert one[0] == five[0]
    assert five[0]["step_time_s"] == five[1]["step_time_s"]  # the tie this is about
    assert five[0]["memory_per_gpu_bytes"] <= five[1]["memory_per_gpu_bytes"]
