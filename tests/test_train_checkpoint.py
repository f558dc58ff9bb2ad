"""dtlib train's checkpoints load on another layout: the loaded parameters equal the saved ones bit
for bit, and one more step equals the saving layout's own next step (AdamW state resharded too)."""
import os

import pytest
import torch

from dtlib.launcher import launch
from dtlib.resilience.checkpoint import read_manifest, to_torch
from dtlib.trainer import TrainConfig, train

TIMEOUT = 120
# one more AdamW step on another layout: float32 sums in another order (see tests/test_train.py)
LOSS_TOL, PARAM_TOL_ADAM = 1e-5, 1e-4
BASE = TrainConfig(layers=2, hidden=32, heads=4, seq=16, steps=3, micro_batch_size=2, optimizer="adamw", lr=1e-2)
MOE = BASE.with_(moe_experts=4, moe_top_k=2)
TIED = BASE.with_(tied_embeddings=True)

# (saving layout, loading layout, what the resume line says): the same global batch of 4 sequences
# (2 for tp2 -> 1), checkpoint after step 2 of 3
RESHARD = [
    (BASE.with_(dp=2, tp=2, zero=1), BASE.with_(dp=4, micro_batch_size=1),
     "resharded from dp2 x tp2, zero1 to dp4"),
    (BASE.with_(tp=2), BASE, "resharded from tp2 to 1 process"),
    (BASE.with_(dp=4, zero=3, micro_batch_size=1), BASE.with_(dp=2, zero=3),
     "resharded from dp4, zero3 to dp2, zero3"),
    (BASE.with_(tp=2, pp=2, num_microbatches=2), BASE.with_(micro_batch_size=4),
     "resharded from tp2 x pp2 to 1 process"),
    (MOE.with_(dp=2, ep=2), MOE.with_(dp=2), "resharded from dp2 x ep2 to dp2"),
    # FSDP's dim-0 rows of TP slabs, and of pipeline stages (the model's own parameters)
    (BASE.with_(dp=2, tp=2, zero=3, sequence_parallel=True), BASE.with_(micro_batch_size=4),
     "resharded from dp2 x tp2, zero3, sp to 1 process"),
    (BASE.with_(dp=2, pp=2, zero=3, micro_batch_size=1, num_microbatches=2), BASE.with_(dp=2, tp=2, zero=3),
     "resharded from dp2 x pp2, zero3 to dp2 x tp2, zero3"),
    # tied embeddings: the first stage saves wte, the last stage loads its copy too
    (TIED.with_(pp=2, num_microbatches=2), TIED.with_(micro_batch_size=4), "resharded from pp2 to 1 process"),
    (TIED.with_(dp=2), TIED.with_(pp=2, num_microbatches=2), "resharded from dp2 to pp2"),
]


def _run(config, fn, *args):
    if config.world_size == 1:
        return fn(0, 1, config, *args)
    return launch(fn, config.world_size, args=(config, *args), timeout=TIMEOUT)[0]


def _save(rank, world_size, config, directory):
    return train(rank, world_size, config.with_(checkpoint_dir=directory, checkpoint_every=2), keep_params=True)


def _load_and_continue(rank, world_size, config, directory):
    loaded = train(rank, world_size, config.with_(steps=2, checkpoint_dir=directory, resume=True), keep_params=True)
    more = train(rank, world_size, config.with_(steps=3, checkpoint_dir=directory, resume=True), keep_params=True)
    return loaded, more


@pytest.mark.parametrize("saver, loader, line", RESHARD, ids=[r[2].split(" from ")[1] for r in RESHARD])
def test_checkpoint_loads_on_another_layout(saver, loader, line, tmp_path):
    directory = str(tmp_path)
    saved = _run(saver, _save, directory)
    step2 = os.path.join(directory, "step00000002")
    assert read_manifest(step2)["world_size"] == saver.world_size
    full = to_torch(directory, str(tmp_path / "full.pt"))["model"]  # the full parameters at step 2
    loaded, more = _run(loader, _load_and_continue, directory)
    assert line in loaded["resumed"], loaded["resumed"]
    assert loaded["first_step"] == 2 and loaded["losses"] == []
    for name, value in loaded["params"].items():  # bit for bit, every parameter
        assert torch.equal(value, full[name]), name
    assert more["losses"] == pytest.approx(saved["losses"][2:], abs=LOSS_TOL)
    worst = max((more["params"][n] - saved["params"][n]).abs().max().item() for n in saved["params"])
    assert worst < PARAM_TOL_ADAM, worst


def test_async_checkpoints_equal_synchronous_ones(tmp_path):
    """The background save writes the state as it was when save() returned, not as training changed it."""
    config = BASE.with_(dp=2, zero=2, steps=4, checkpoint_every=2)
    sync = launch(train, 2, args=(config.with_(checkpoint_dir=str(tmp_path / "sync")),), timeout=TIMEOUT)[0]
    done = launch(train, 2, args=(config.with_(checkpoint_dir=str(tmp_path / "async"), async_checkpoint=True),),
                  timeout=TIMEOUT)[0]
    assert done["params_sha256"] == sync["params_sha256"] and len(done["checkpoint_blocking_s"]) == 2
    for step in ("step00000002", "step00000004"):
        a = to_torch(str(tmp_path / "async" / step), str(tmp_path / "a.pt"))
        b = to_torch(str(tmp_path / "sync" / step), str(tmp_path / "b.pt"))
        for part in ("model", "optimizer"):
            assert a[part].keys() == b[part].keys()
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert all(torch.equal(a["optimizer"][k][s], b["optimizer"][k][s]) for k in a["optimizer"]
                   for s in a["optimizer"][k])


def test_resume_past_the_end_and_nothing_to_resume(tmp_path):
    first = train(0, 1, BASE.with_(steps=2, checkpoint_dir=str(tmp_path), resume=True, checkpoint_every=2))
    assert first["resumed"] == f"no checkpoint in {tmp_path} yet: starting at step 0" and first["first_step"] == 0
    with pytest.raises(ValueError, match="at step 2, past --steps 1: ask for more steps"):
        train(0, 1, BASE.with_(steps=1, checkpoint_dir=str(tmp_path), resume=True))


def test_bad_checkpoint_is_a_one_line_error_before_any_rank_starts(tmp_path, capsys):
    from dtlib.cli import main as cli_main
    flags = ["train", "--layers", "2", "--hidden", "32", "--seq", "16", "--steps", "2",
             "--checkpoint-dir", str(tmp_path), "--resume"]
    assert cli_main([*flags, "--checkpoint-every", "2", "--json"]) == 0
    capsys.readouterr()
    # another model: the manifest is named, with the first tensors that differ
    assert cli_main([*flags[:4], "64", *flags[5:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "step00000002/manifest.json is from an incompatible model: " in err, err
    # a truncated shard: the file is named
    shard = tmp_path / "step00000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    assert cli_main(flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{shard} is truncated or overwritten: 100 bytes" in err, err


def test_retention_keeps_the_last_and_the_milestones(tmp_path):
    from dtlib.resilience.checkpoint import checkpoint_steps
    train(0, 1, BASE.with_(steps=7, checkpoint_dir=str(tmp_path), checkpoint_every=1, keep_last=2, milestone_every=3))
    assert checkpoint_steps(str(tmp_path)) == [3, 6, 7]
