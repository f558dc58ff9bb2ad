"""A resume notices what changed since its checkpoint (both the DCP and the incremental kind), an
incremental checkpoint verifies itself, and ``dtlib train --json`` prints exactly one JSON object."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from dtlib.trainer import TrainConfig, check_resume, run, train

# plain SGD, so that one step's update is -lr x the gradient (see the override test)
SMALL = TrainConfig(layers=1, hidden=32, heads=2, seq=16, micro_batch_size=2, optimizer="sgd", lr=0.5)


@pytest.fixture(scope="module", params=["dcp", "incremental"])
def saved(request, tmp_path_factory):
    """Two steps in this process, checkpointed after step 2: (config, rank 0's summary)."""
    directory = str(tmp_path_factory.mktemp(request.param))
    config = SMALL.with_(steps=2, checkpoint_dir=directory, checkpoint_every=2,
                         incremental=request.param == "incremental")
    return config, train(0, 1, config, keep_params=True)


@pytest.mark.parametrize("change, message", [
    (dict(lr=0.05), "--lr 0.05 differs from the checkpoint's 0.5 ("),
    (dict(optimizer="adamw"), "--optimizer adamw differs from the checkpoint's sgd ("),
    (dict(tied_embeddings=True), "was trained without --tied-embeddings (an LM head of its own"),
    (dict(heads=4), "--heads 4 differs from the checkpoint's 2 ("),  # every shape the same
])
def test_a_changed_setting_is_refused_by_name_before_any_rank_starts(saved, change, message):
    config, _ = saved
    changed = config.with_(resume=True, steps=3, **change)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_resume(changed)
    check_resume(config.with_(resume=True, steps=3))  # nothing changed: fine
    if "lr" in change or "tied_embeddings" in change:  # the silent ones: refused in the ranks too
        with pytest.raises(ValueError, match=re.escape(message)):
            train(0, 1, changed)


def test_override_trains_at_the_new_lr(saved):
    """Step 3 resumed at the saved lr 0.5 and, with --override-optimizer-params, at 0.05: plain SGD
    subtracts lr x the same gradient from the same parameters, so the second update is 0.1 x the
    first (the checkpoint had restored 0.5 into the optimizer; the override replaced it)."""
    config, first = saved
    again = config.with_(resume=True, steps=3)
    same = train(0, 1, again, keep_params=True)
    new = train(0, 1, again.with_(lr=0.05, override_optimizer_params=True), keep_params=True)
    assert "lr 0.5 -> 0.05 (--override-optimizer-params)" in new["resumed"]
    for name, before in first["params"].items():
        d_same, d_new = same["params"][name] - before, new["params"][name] - before
        # each difference carries the rounding of two float32 values of size |p|: a few ulps
        tol = 4 * torch.finfo(torch.float32).eps * float(before.abs().max())
        torch.testing.assert_close(d_new, 0.1 * d_same, rtol=0, atol=tol)
    moved = sum(float((same["params"][n] - first["params"][n]).abs().sum()) for n in first["params"])
    assert moved > 1e-2  # the step did move the parameters (the ratio is not 0 = 0.1 x 0)


def test_override_needs_resume():
    with pytest.raises(ValueError, match="--override-optimizer-params .* needs --resume"):
        SMALL.with_(override_optimizer_params=True).check()


# ---- incremental checkpoints verify themselves ---------------------------------------------------
INCR = SMALL.with_(dp=2, incremental=True, checkpoint_every=1, full_every=4, resume=True)


def test_a_corrupt_incremental_checkpoint_is_named_and_the_resume_falls_back(tmp_path):
    """dp2, a checkpoint after every step (step 1 full, 2 and 3 deltas); one byte of rank 1's
    step-3 delta flipped: both ranks resume from step 2 (the newest step every rank verifies),
    say so, and end equal to the uninterrupted run. Then the base is cut short: no step verifies,
    and the resume is refused before any rank starts, naming the file."""
    d = str(tmp_path / "ckpt")
    straight = run(SMALL.with_(dp=2, steps=4), timeout=60)
    run(INCR.with_(steps=3, checkpoint_dir=d), timeout=60)
    bad = os.path.join(d, "incr-step00000003", "rank1.pt")
    data = bytearray(open(bad, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(bad, "wb").write(bytes(data))
    resumed = run(INCR.with_(steps=4, checkpoint_dir=d), timeout=60)
    assert resumed["resumed"].startswith("resumed at step 2 from "), resumed["resumed"]
    assert f"the last good checkpoint ({bad} is corrupt: its sha256 differs from its record's)" in resumed["resumed"]
    assert resumed["params_sha256"] == straight["params_sha256"]
    # the resumed run saved step 3 (full) and 4 (delta) and swept the older steps, folders too
    assert sorted(os.listdir(d)) == ["incr-step00000003", "incr-step00000004"]
    base = os.path.join(d, "incr-step00000003", "rank0.pt")
    with open(base, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=re.escape(f"{base} is truncated or overwritten: 100 bytes")):
        check_resume(INCR.with_(steps=5, checkpoint_dir=d))


# ---- dtlib train --json: one JSON object on stdout, whatever the ranks print ---------------------
def test_json_output_is_one_object_with_drills_alerts_and_a_resume(tmp_path, capsys):
    """A gradient-spike drill (its drill line and the alert) and then a resume (its line): stdout
    is exactly one JSON object each time (``python -m json.tool`` reads it), the rest on stderr."""
    from dtlib.cli import main as cli_main
    flags = ["train", "--dp", "2", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16",
             "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "4", "--resume", "--json"]
    assert cli_main([*flags, "--steps", "4", "--spike-step", "3", "--metrics", str(tmp_path / "m.jsonl")]) == 0
    out, err = capsys.readouterr()
    assert "fault drill: gradients x 1000 at step 3" in err and "alert after step 3: grad_norm" in err
    assert json.loads(out)["alerts"]
    assert cli_main([*flags, "--steps", "5"]) == 0
    out, err = capsys.readouterr()
    assert "resumed at step 4 from " in err and json.loads(out)["resumed"].startswith("resumed at step 4")
    tool = subprocess.run([sys.executable, "-m", "json.tool"], input=out, capture_output=True, text=True)
    assert tool.returncode == 0, tool.stderr
