"""The emitter explorer shows what dtlib plan --emit writes and what dtlib.analytic.memory predicts."""
import pytest

from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import memory_per_gpu
from dtlib.widgets.frameworks import MODEL, emitted_configs


def test_predicted_bytes_follow_the_zero_stage_and_the_configs_say_the_layout():
    one, three = (emitted_configs(zero, 4, 2, 1, 1, 64) for zero in (1, 3))
    assert three["predicted"]["parameters"] < one["predicted"]["parameters"]  # ZeRO-3 shards the weights
    expected = memory_per_gpu(MODEL, Parallelism(dp=4, tp=2, zero=1, num_microbatches=16), precision="zero")
    assert one["predicted"]["optimizer"] == expected.optimizer
    assert "train_batch_size: 64" in one["texts"]["DeepSpeed JSON"]
    assert '"stage": 1' in one["texts"]["DeepSpeed JSON"] and '"stage": 3' in three["texts"]["DeepSpeed JSON"]
    assert "--tensor-model-parallel-size 2" in one["texts"]["Megatron-LM flags"]
    assert "mesh {'data': 1, 'fsdp': 4, 'model': 2}" in one["texts"]["JAX mesh and specs"]


def test_what_a_framework_cannot_express_replaces_its_config():
    r = emitted_configs(1, 4, 2, 4, 1, 64)  # pp 4: a GSPMD mesh of weights has no pipeline
    assert r["texts"]["JAX mesh and specs"] == "" and r["unsupported"]["JAX mesh and specs"]
    assert r["texts"]["Megatron-LM flags"] and not r["unsupported"]["Megatron-LM flags"]


def test_a_global_batch_that_does_not_divide_is_refused_by_name():
    with pytest.raises(ValueError, match=r"global_batch \(36\) must be a multiple of dp x micro_batch_size \(8\)"):
        emitted_configs(1, 4, 2, 1, 2, 36)
