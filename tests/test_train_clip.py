"""``dtlib train --clip-grad``: every layout the trainer composes clips by the global gradient norm
exactly as one process does (the norm before clipping equal within float rounding, the weights
within PARAM_TOL after steps that all clip); the monitored grad_norm is the same norm (a tied
embedding across pipeline stages counted once, ZeRO-2's gradient shards measured)."""
import pytest

from dtlib.cli import build_parser, main as cli_main
from dtlib.cli.train import config_from_args
from dtlib.experiments.parallel3d import LOSS_TOL, PARAM_TOL, single_process_config
from dtlib.launcher import launch
from dtlib.monitor import read_metrics
from dtlib.trainer import TrainConfig, train

TIMEOUT = 120
CLIP = 0.1  # below every step's norm (checked): clipping is active at every step
BASE = TrainConfig(layers=2, hidden=32, heads=4, seq=16, steps=3, micro_batch_size=2, optimizer="sgd",
                   lr=0.5, clip_grad=CLIP)
MOE = BASE.with_(moe_experts=4, moe_top_k=2)
LAYOUTS_2 = {
    "dp2": BASE.with_(dp=2), "dp2 zero1": BASE.with_(dp=2, zero=1), "dp2 zero2": BASE.with_(dp=2, zero=2),
    "dp2 zero3": BASE.with_(dp=2, zero=3), "tp2 sp": BASE.with_(tp=2, sequence_parallel=True),
    "pp2 tied": BASE.with_(pp=2, num_microbatches=2, tied_embeddings=True), "cp2": BASE.with_(cp=2),
    "dp2 ep2": MOE.with_(dp=2, ep=2),
    # monitoring only (no clipping): the norm the monitor reports is the same global norm
    "pp2 tied, monitor": BASE.with_(pp=2, num_microbatches=2, tied_embeddings=True, clip_grad=0.0),
    "dp2 zero2, monitor": BASE.with_(dp=2, zero=2, clip_grad=0.0),
}
LAYOUTS_4 = {
    "dp2 tp2 zero3": BASE.with_(dp=2, tp=2, zero=3),
    "dp2 pp2 zero3": BASE.with_(dp=2, pp=2, zero=3, num_microbatches=2),
    "tp2 pp2 sp tied": BASE.with_(tp=2, pp=2, sequence_parallel=True, num_microbatches=2, tied_embeddings=True),
}


def _many(rank, world_size, configs):
    return [train(rank, world_size, c, keep_params=True) for c in configs]


def _configs(layouts, directory):
    return {name: c.with_(metrics=str(directory / f"{name}.jsonl")) for name, c in layouts.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every layout (one launch per world size) and its one-process reference."""
    directory = tmp_path_factory.mktemp("clip")
    out = {}
    for world, layouts in ((2, LAYOUTS_2), (4, LAYOUTS_4)):
        configs = _configs(layouts, directory)
        results = launch(_many, world, args=(list(configs.values()),), timeout=TIMEOUT)[0]
        for (name, config), got in zip(configs.items(), results):
            single = single_process_config(config).with_(metrics=str(directory / f"{name} one.jsonl"))
            ref = train(0, 1, single, keep_params=True)
            out[name] = (got, read_metrics(config.metrics), ref, read_metrics(single.metrics))
    return out


@pytest.mark.parametrize("name", [*LAYOUTS_2, *LAYOUTS_4])
def test_clipping_equals_one_process(runs, name):
    got, metrics, ref, ref_metrics = runs[name]
    norms, ref_norms = [r["grad_norm"] for r in metrics], [r["grad_norm"] for r in ref_metrics]
    assert norms == pytest.approx(ref_norms, rel=1e-5)  # float32 gradients summed in another order
    if "monitor" not in name:
        assert min(ref_norms) > 2 * CLIP  # every step clips
    assert got["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL)
    worst = max((got["params"][n] - ref["params"][n]).abs().max().item() for n in ref["params"])
    assert worst < PARAM_TOL, worst


def test_clipping_changes_the_run(runs):
    # the same layout without clipping trains elsewhere: the flag is not a no-op
    unclipped = train(0, 1, single_process_config(BASE.with_(dp=2, clip_grad=0.0)), keep_params=True)
    clipped = runs["dp2"][2]
    assert max((clipped["params"][n] - unclipped["params"][n]).abs().max().item() for n in unclipped["params"]) > 1e-3


def test_clip_grad_flag_reaches_the_config():
    assert config_from_args(build_parser().parse_args(["train"])).clip_grad == 0.0  # off by default
    assert config_from_args(build_parser().parse_args(["train", "--clip-grad", "1.0"])).clip_grad == 1.0


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_bad_clip_grad_is_a_one_line_error(value, capsys):
    assert cli_main(["train", "--clip-grad", value]) == 2  # before any process starts
    err = capsys.readouterr().err
    assert "--clip-grad" in err and ">= 0" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="clip_grad"):
        BASE.with_(clip_grad=float(value)).check()
