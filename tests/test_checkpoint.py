"""dtlib.resilience.checkpoint: resharding across layouts, atomicity under SIGKILL, async, retention,
and errors that name the file."""
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dtlib import cli
from dtlib.launcher import launch
from dtlib.parallel import FSDP, ShardedOptimizer
from dtlib.resilience.checkpoint import (Checkpointer, CheckpointError, checkpoint_steps, read_manifest,
                                         to_torch)

TIMEOUT = 60
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(seed=0, hidden=16):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, 5))


def _batch(step, rank, world_size, rows=12):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(rows, 7, generator=g), torch.randint(0, 5, (rows,), generator=g)
    return x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]


def _build(layout, rank, world_size):
    """(model to run, optimizer, wrapper to checkpoint) for a layout."""
    model = _model()
    if layout == "fsdp":
        wrapped = FSDP(model, unit_types=(nn.Linear,))
        return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2), wrapped
    if layout == "zero2":
        return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2), model
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), model


def _train(model, opt, layout, steps, rank, world_size, first=0):
    for step in range(first, first + steps):
        x, y = _batch(step, rank, world_size)
        nn.functional.cross_entropy(model(x), y).backward()
        if layout == "replicated" and world_size > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world_size
        opt.step()
        opt.zero_grad()


def _save_after_training(rank, world_size, layout, directory, steps=2):
    model, opt, wrapped = _build(layout, rank, world_size)
    _train(model, opt, layout, steps, rank, world_size)
    Checkpointer(directory).save(steps, wrapped, opt, data_position={"batch": steps})


def _load_and_save(rank, world_size, layout, source, target):
    model, opt, wrapped = _build(layout, rank, world_size)
    info = Checkpointer(source).load(wrapped, opt)
    Checkpointer(target).save(info["step"], wrapped, opt, data_position=info["data_position"])
    return info["rng_restored"], info["layout"]["kind"]


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _same(a[k], b[k])
        else:
            assert torch.equal(a[k], b[k]), k


def test_reshard_fsdp4_to_fsdp2_zero2_and_one_process(tmp_path):
    """FSDP on 4 ranks (dim-0 rows: 5 rows as 2, 2, 1, 0) saved; loaded by FSDP on 2, ZeRO-2 on 3
    (flat shards cut mid-row) and one process, each saves again: parameters and AdamW state
    identical bit for bit."""
    a, b, c, d = (str(tmp_path / n) for n in "abcd")
    launch(_save_after_training, 4, args=("fsdp", a), timeout=TIMEOUT)
    assert launch(_load_and_save, 2, args=("fsdp", a, b), timeout=TIMEOUT)[0] == (False, "fsdp")
    launch(_load_and_save, 3, args=("zero2", b, c), timeout=TIMEOUT)
    _load_and_save(0, 1, "replicated", c, d)
    saved = [to_torch(p, str(tmp_path / f"{i}.pt")) for i, p in enumerate((a, b, c, d))]
    assert saved[0]["step"] == 2 and saved[0]["data_position"] == {"batch": 2}
    assert saved[0]["model"]["0.weight"].shape == (16, 7)
    assert saved[0]["optimizer"]["0.weight"]["exp_avg"].abs().sum() > 0
    for other in saved[1:]:
        _same(saved[0]["model"], other["model"])
        _same(saved[0]["optimizer"], other["optimizer"])


def _resume_same_world(rank, world_size, directory, kill_at):
    """dp2 training with dropout: save every step, reload at ``kill_at`` into fresh objects."""
    model, opt, _ = _build("replicated", rank, world_size)
    torch.manual_seed(rank)
    ck = Checkpointer(directory, keep_last=1)
    for step in range(6):
        if step == kill_at:
            model, opt, _ = _build("replicated", rank, world_size)
            torch.manual_seed(1234)  # a restarted process has another RNG state
            assert ck.load(model, opt)["data_position"] == step
        _train(model, opt, "replicated", 1, rank, world_size, first=step)
        ck.save(step + 1, model, opt, data_position=step + 1)
    return [p.detach().clone() for p in model.parameters()]


def test_resume_restores_rng_and_optimizer(tmp_path):
    straight = launch(_resume_same_world, 2, args=(str(tmp_path / "a"), -1), timeout=TIMEOUT)
    resumed = launch(_resume_same_world, 2, args=(str(tmp_path / "b"), 3), timeout=TIMEOUT)
    for p, q in zip(straight[0], resumed[0]):
        assert torch.equal(p, q)
    assert checkpoint_steps(str(tmp_path / "b")) == [6]  # keep_last=1


def _async_vs_sync(rank, world_size, directory):
    model, opt, _ = _build("replicated", rank, world_size)
    _train(model, opt, "replicated", 2, rank, world_size)
    sync, asyn = Checkpointer(os.path.join(directory, "sync")), Checkpointer(os.path.join(directory, "async"),
                                                                            async_save=True)
    sync.save(2, model, opt)
    asyn.save(2, model, opt)
    _train(model, opt, "replicated", 1, rank, world_size, first=2)  # training goes on meanwhile
    asyn.close()
    return asyn.blocking_seconds


def test_async_save_holds_the_state_at_save_time(tmp_path):
    launch(_async_vs_sync, 2, args=(str(tmp_path),), timeout=TIMEOUT)
    sync, asyn = (to_torch(str(tmp_path / k), str(tmp_path / f"{k}.pt")) for k in ("sync", "async"))
    _same(sync["model"], asyn["model"])
    _same(sync["optimizer"], asyn["optimizer"])


def test_retention_keeps_last_and_milestones(tmp_path):
    model, opt, _ = _build("replicated", 0, 1)
    ck = Checkpointer(str(tmp_path), keep_last=2, milestone_every=3)
    for step in range(1, 9):
        ck.save(step, model, opt)
    assert checkpoint_steps(str(tmp_path)) == [3, 6, 7, 8]
    assert open(tmp_path / "latest").read() == "step00000008"


KILLER = r"""
import os, signal, sys, threading, time, torch
sys.path.insert(0, {root!r})
from dtlib.resilience import checkpoint as ck_module
from dtlib.resilience.checkpoint import Checkpointer
directory, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Linear(1000, 1000)
ck = Checkpointer(directory)
ck.save(1, model)
with torch.no_grad():
    model.weight.add_(1.0)
if mode == "publishing":  # data written, killed before the manifest and the rename
    ck_module.Checkpointer._publish = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
else:  # killed while DCP writes the files
    def kill_when_writing():
        tmp = os.path.join(directory, ".tmp-step00000002")
        while not (os.path.isdir(tmp) and any(n.endswith(".distcp") for n in os.listdir(tmp))):
            time.sleep(0.0005)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=kill_when_writing, daemon=True).start()
ck.save(2, model)
print("save finished before the kill")
"""


@pytest.mark.parametrize("mode", ["writing", "publishing"])
def test_killed_during_save_leaves_previous_loadable(tmp_path, mode):
    script = tmp_path / "killer.py"
    script.write_text(KILLER.format(root=ROOT))
    directory = str(tmp_path / "ck")
    proc = subprocess.Popen([sys.executable, str(script), directory, mode], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, out
    assert os.path.isdir(os.path.join(directory, ".tmp-step00000002"))  # the partial save is there...
    assert checkpoint_steps(directory) == [1]  # ...and ignored
    torch.manual_seed(5)
    model = torch.nn.Linear(1000, 1000)
    ck = Checkpointer(directory)
    assert ck.load(model)["step"] == 1
    torch.manual_seed(0)
    assert torch.equal(model.weight, torch.nn.Linear(1000, 1000).weight)  # step 1's values
    ck.save(2, model)
    assert not os.path.exists(os.path.join(directory, ".tmp-step00000002"))  # swept by the next save


@pytest.fixture
def saved(tmp_path):
    model, opt, _ = _build("replicated", 0, 1)
    _train(model, opt, "replicated", 1, 0, 1)
    Checkpointer(str(tmp_path)).save(1, model, opt)
    return str(tmp_path / "step00000001")


def _shard(path):
    return os.path.join(path, next(n for n in os.listdir(path) if n.endswith(".distcp")))


def _load(directory):
    model, opt, _ = _build("replicated", 0, 1)
    return Checkpointer(directory).load(model, opt)


def test_corrupt_truncated_missing_name_the_file(saved):
    directory, shard = os.path.dirname(saved), _shard(saved)
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard} is corrupt"):
        _load(directory)
    open(shard, "wb").write(bytes(data[:-10]))
    with pytest.raises(CheckpointError, match=f"{shard} is truncated"):
        _load(directory)
    os.remove(shard)
    with pytest.raises(CheckpointError, match=f"{shard} is missing"):
        _load(directory)


def test_incompatible_model_and_bad_manifest(saved):
    directory = os.path.dirname(saved)
    bigger = _model(hidden=32)
    with pytest.raises(CheckpointError, match=r"manifest.json is from an incompatible model.*0.weight: \[16, 7\] saved, \[32, 7\]"):
        Checkpointer(directory).load(bigger, torch.optim.AdamW(bigger.parameters()))
    model, _, _ = _build("replicated", 0, 1)
    with pytest.raises(CheckpointError, match="holds a AdamW with 1 param groups; this is a SGD"):
        Checkpointer(directory).load(model, torch.optim.SGD(model.parameters(), lr=0.1))
    open(os.path.join(saved, "manifest.json"), "w").write("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is not valid JSON"):
        read_manifest(saved)
    open(os.path.join(saved, "manifest.json"), "w").write("[1]")  # was AttributeError: 'list' ... 'get'
    with pytest.raises(CheckpointError, match="manifest.json holds a JSON list, not a manifest"):
        read_manifest(saved)
    with pytest.raises(ValueError, match="keep_last must be an integer >= 1, got 0"):
        Checkpointer(directory, keep_last=0)


def test_cli_inspect_and_convert(saved, tmp_path, capsys):
    directory = os.path.dirname(saved)
    assert cli.main(["checkpoint", "inspect", directory]) == 0
    out = capsys.readouterr().out
    assert "step00000001" in out and "0.weight" in out and "[16, 7]" in out
    target = str(tmp_path / "out.pt")
    assert cli.main(["checkpoint", "convert", directory, "--to-torch", target]) == 0
    state = torch.load(target, weights_only=False)
    assert state["model"]["0.weight"].shape == (16, 7) and state["step"] == 1
    # a folder as the file: one line before DCP reads anything (was torch's RuntimeError traceback)
    assert cli.main(["checkpoint", "convert", directory, "--to-torch", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"dtlib: error: --to-torch {tmp_path} is a directory; give a file path\n"
    assert cli.main(["checkpoint", "convert", directory, "--to-torch", str(tmp_path / "new" / "m.pt")]) == 0
    assert torch.load(tmp_path / "new" / "m.pt", weights_only=False)["step"] == 1  # its folder made
    assert cli.main(["checkpoint", "inspect", str(tmp_path / "nothing")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    shard = _shard(saved)
    os.remove(shard)
    assert cli.main(["checkpoint", "inspect", directory]) == 2  # a missing shard: one line naming it
    assert f"{shard} is missing" in capsys.readouterr().err


@pytest.mark.parametrize("shape", [(10,), (4, 6), (3, 4, 5), (2, 3, 1, 4), ()])
def test_boxes_tile_a_flat_range_with_contiguous_boxes(shape):
    """Any flat shard [lo, hi) of a tensor is cut into boxes that cover it exactly once, each the
    contiguous run of elements its flat start says (what makes a mid-row FSDP shard a DCP chunk)."""
    from dtlib.resilience.chunks import boxes
    numel = int(torch.Size(shape).numel())
    values = torch.arange(numel).view(shape)
    for lo in range(numel + 1):
        for hi in range(lo, numel + 1):
            covered = []
            for start, offsets, sizes in boxes(lo, hi, shape):
                box = values[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
                assert box.tolist() == list(range(start, start + box.numel())), (lo, hi, offsets, sizes)
                covered += box.tolist()
            assert sorted(covered) == list(range(lo, hi)), (shape, lo, hi)
            assert len(boxes(lo, hi, shape)) <= 2 * max(len(shape), 1) - 1  # end of row, rows, start of row
