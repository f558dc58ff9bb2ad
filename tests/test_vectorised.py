"""The vectorised path reproduces published numbers on its own, gives the scalar path's numbers
(both share the formulas; that comparison checks the broadcasting and the validity masks), and
flags exactly the configurations the scalar path rejects."""
import numpy as np
import pytest

from dtlib.analytic.flops import flops_report
from dtlib.analytic.memory import memory_per_gpu
from dtlib.models import TransformerConfig, get_preset, tiny_gpt_config
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.vectorised import flops_batch, memory_batch

FIELDS = ("parameters", "gradients", "optimizer", "activations", "temporary", "total", "cpu")


def _random_layouts(rng, n):
    pick = lambda options: rng.choice(options, n)  # noqa: E731
    return dict(dp=pick([1, 2, 4, 8]), tp=pick([1, 2, 3, 4, 8]), pp=pick([1, 2, 4, 5]),
                cp=pick([1, 2]), zero=pick([0, 1, 2, 3]), micro_batch_size=pick([1, 2, 4]),
                num_microbatches=pick([1, 4, 8]), sequence_parallel=pick([False, True]),
                pipeline_layout=pick([False, True]))  # Megatron's even split, or a layout string


@pytest.mark.parametrize("model,options", [
    ("llama3-8b", dict(recompute="selective", schedule="1f1b", offload="none")),
    ("gpt3-175b", dict(recompute="none", schedule="gpipe", offload="none")),
    ("capstone-10b", dict(recompute="full", schedule="interleaved", offload="optimizer")),
    ("tiny", dict(recompute="none", schedule="1f1b", offload="params")),
])
def test_vector_path_equals_scalar_path_on_random_configs(model, options):
    rng = np.random.default_rng(sum(map(ord, model)))  # fixed seed per case
    n = 200
    cfg = tiny_gpt_config(layers=4) if model == "tiny" else get_preset(model)
    layouts = _random_layouts(rng, n)
    if options["schedule"] == "interleaved":
        layouts["virtual_stages"] = rng.choice([1, 2], n)
    out = memory_batch(cfg, precision="megatron-bf16", on_invalid="nan", **options, **layouts)
    checked = 0
    for i in range(n):
        kw = {k: (bool(v[i]) if k in ("sequence_parallel", "pipeline_layout") else int(v[i]))
              for k, v in layouts.items()}
        try:
            scalar = memory_per_gpu(cfg, Parallelism(**kw, **options), precision="megatron-bf16")
        except ValueError:
            assert not out["valid"][i], f"scalar rejects {kw} but the vector path accepted it"
            assert np.isnan(out["total"][i])
            continue
        assert out["valid"][i], f"vector path rejects {kw}"
        for f in FIELDS:
            assert out[f][i] == pytest.approx(getattr(scalar, f), rel=1e-12), (f, kw)
        assert out["stage"][i] == scalar.stage
        checked += 1
    assert checked >= 10 and (~out["valid"]).sum() >= 10  # both branches exercised


def test_vector_path_reproduces_published_numbers():
    # Rajbhandari et al. 2020, Fig. 1: 7.5B parameters on 64 GPUs, 2 + 2 + 12 bytes per parameter:
    # 120 GB (DDP), 31.4 GB (P_os), 16.6 GB (P_os+g), 1.9 GB (P_os+g+p)
    out = memory_batch(params=np.full(4, 7.5e9), dp=64, zero=np.arange(4), precision="zero")
    states = out["parameters"] + out["gradients"] + out["optimizer"]
    assert (states / 1e9).tolist() == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)
    # Korthikanti et al. 2022, Table 2 and Sec. 5: the 22B model (s=2048, b=4, h=6144, a=64, t=8)
    # keeps sbh(10 + 24/t + 5as/(ht)) bytes per layer, 34sbh/t with sequence parallelism and
    # selective recompute: 59.25 GiB and 9.5625 GiB for its 48 layers (hand-computed). Adding 48
    # layers adds exactly that (the embedding and head terms cancel in the difference).
    s_, b, h, a, t, L = 2048, 4, 6144, 64, 8, 48
    per_layer = [s_ * b * h * (10 + 24 / t) + 5 * a * s_ * s_ * b / t, 34 * s_ * b * h / t]
    assert [L * x / 2 ** 30 for x in per_layer] == [59.25, 9.5625]
    cfg = TransformerConfig(layers=L, hidden=h, heads=a, kv_heads=a, ffn=4 * h, vocab=51200, seq=s_,
                            activation="gelu")
    for sp, recompute, want in ((False, "none", per_layer[0]), (True, "selective", per_layer[1])):
        acts = memory_batch(cfg, layers=np.array([L, 2 * L]), tp=t, micro_batch_size=b,
                            sequence_parallel=sp, recompute=recompute, convention="korthikanti-2022")["activations"]
        assert acts[1] - acts[0] == pytest.approx(L * want, rel=1e-12)


def test_raise_mode_names_the_first_bad_index():
    cfg = get_preset("llama3-8b")
    with pytest.raises(ValueError, match=r"configuration \(2,\): tensor parallel size tp=3 must divide"):
        memory_batch(cfg, tp=np.array([1, 2, 3, 4]))
    with pytest.raises(ValueError, match="unknown fields \\['tpp'\\]"):
        memory_batch(cfg, tpp=2)
    with pytest.raises(ValueError, match="recompute must be one of"):
        memory_batch(cfg, recompute="most")


def test_bare_parameter_counts_and_model_width_arrays():
    params = np.array([7.5e9, 70e9, 405e9])
    out = memory_batch(params=params, dp=64, zero=2)
    for p, total in zip(params, out["total"]):
        assert total == pytest.approx(memory_per_gpu(float(p), Parallelism(dp=64, zero=2)).total)
    assert out["activations"] is None
    cfg = tiny_gpt_config()
    widths = memory_batch(cfg, hidden=np.array([64, 128]), ffn=np.array([256, 512]), micro_batch_size=2)
    for i, h in enumerate((64, 128)):
        scalar = memory_per_gpu(cfg.with_(hidden=h, ffn=4 * h), Parallelism(micro_batch_size=2))
        assert widths["total"][i] == pytest.approx(scalar.total, rel=1e-12)


def test_flops_batch_equals_flops_report():
    cfg = get_preset("llama3-70b")
    batch, seq = np.array([8, 16, 32]), np.array([2048, 4096, 8192])
    out = flops_batch(cfg, batch=batch, seq=seq, step_time=np.array([1.0, 2.0, 4.0]), gpus=64,
                      recompute="selective")
    for i in range(3):
        r = flops_report(cfg, int(batch[i]), seq=int(seq[i]), step_time=[1.0, 2.0, 4.0][i], gpus=64,
                         recompute="selective")
        for k in ("model_flops_per_step", "hardware_flops_per_step", "mfu", "hfu"):
            assert out[k][i] == pytest.approx(r[k], rel=1e-12)


def test_both_paths_reject_the_same_interleaved_layouts():
    """Megatron-LM interleaves only with v >= 2 virtual stages, pp >= 2 and m a multiple of pp:
    the rules live in dtlib.analytic.layout, so the scalar and the vector path agree row by row."""
    cfg = get_preset("llama3-8b")
    pp = np.array([4, 4, 1, 4, 2, 8])
    v = np.array([2, 1, 2, 2, 4, 2])
    m = np.array([8, 8, 8, 6, 2, 16])
    out = memory_batch(cfg, schedule="interleaved", on_invalid="nan", pp=pp, virtual_stages=v, num_microbatches=m)
    assert out["valid"].tolist() == [True, False, False, False, True, True]
    for i in range(len(pp)):
        kw = dict(pp=int(pp[i]), virtual_stages=int(v[i]), num_microbatches=int(m[i]), schedule="interleaved")
        try:
            scalar = memory_per_gpu(cfg, Parallelism(**kw))
        except ValueError:
            assert not out["valid"][i] and np.isnan(out["total"][i]), kw
            continue
        assert out["total"][i] == pytest.approx(scalar.total, rel=1e-12)
    with pytest.raises(ValueError, match=r"configuration \(1,\): the interleaved schedule needs virtual_stages >= 2"):
        memory_batch(cfg, schedule="interleaved", pp=pp[:2], virtual_stages=v[:2], num_microbatches=m[:2])
