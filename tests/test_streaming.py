"""Streaming shards: one global order for every world size and worker count, a position that
resumes exactly once on another world size (in process, through dtlib train, and under a torchrun
elastic shrink), and prefetching the profiler's input finding sees through when storage is slow."""
import json
import signal

import numpy as np
import pytest

from dtlib.corpus import load_tokens
from dtlib.streaming import (ShardedTokens, check_shards, epoch_order, read_sample_log, replica_positions,
                             write_shards)
from dtlib.trainer import TrainConfig, run

SEQ = 16


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    write_shards(str(d), load_tokens()[:4000], seq=SEQ, samples_per_shard=50)  # 249 samples, 5 shards
    return str(d)


def _global_stream(shards, world, workers, steps, global_batch=8):
    """The ids each step trained on, replicas concatenated in rank order."""
    readers = [ShardedTokens(shards, seed=3, workers=workers) for _ in range(world)]
    out = []
    for _ in range(steps):
        ids = []
        for rank, r in enumerate(readers):
            x, y, got = r.batch(global_batch, rank, world)
            assert x.shape == (global_batch // world, SEQ) and (x[:, 1:] == y[:, :-1]).all()
            ids += got
        out.append(ids)
    for r in readers:
        r.close()
    return out


def test_write_and_index(shards):
    index = check_shards(shards, SEQ)
    assert index["samples"] == (4000 - 1) // SEQ == 249
    assert [s["samples"] for s in index["shards"]] == [50, 50, 50, 50, 49]
    with pytest.raises(ValueError, match="holds samples of seq=16 tokens; --seq is 32"):
        check_shards(shards, 32)


def test_epoch_order_is_a_permutation_that_depends_on_seed_and_epoch_only():
    sizes = [50, 50, 49]
    o = epoch_order(sizes, 0, 0)
    assert sorted(o.tolist()) == list(range(149))
    assert (o == epoch_order(sizes, 0, 0)).all()
    assert not (o == epoch_order(sizes, 0, 1)).all() and not (o == epoch_order(sizes, 1, 0)).all()
    # shard-local: each shard's samples are read in one run (3 runs of shard ids)
    shard = [int(i) // 50 for i in o]
    assert sum(a != b for a, b in zip(shard, shard[1:])) == 2


@pytest.mark.parametrize("world, workers", [(2, 0), (4, 0), (1, 2), (4, 2)])
def test_global_order_is_the_same_for_every_world_size_and_worker_count(shards, world, workers):
    reference = _global_stream(shards, 1, 0, steps=40)  # 320 samples: past one epoch of 249
    assert _global_stream(shards, world, workers, steps=40) == reference
    first_epoch = [i for step in reference for i in step][:249]
    assert sorted(first_epoch) == list(range(249))


def test_resume_from_4_ranks_on_2_mid_epoch_is_exactly_once(shards):
    seen = []
    four = [ShardedTokens(shards, seed=1) for _ in range(4)]
    for _ in range(5):
        for rank, r in enumerate(four):
            seen += r.batch(8, rank, 4)[2]
    state = four[0].state_dict()
    assert state["consumed"] == 40
    two = [ShardedTokens(shards, seed=1) for _ in range(2)]
    for r in two:
        r.load_state_dict(state)
    for _ in range(20):  # 160 more: 200 of the epoch's 249
        for rank, r in enumerate(two):
            seen += r.batch(8, rank, 2)[2]
    assert len(seen) == len(set(seen)) == 200
    assert seen == _first(shards, 1, 200)


def _first(shards, seed, n):
    """The first ``n`` sample ids of the global order."""
    return ShardedTokens(shards, seed=seed).sample_ids(range(n))


def test_replica_positions_are_global():
    assert replica_positions(16, 8, 1, 2) == [20, 21, 22, 23]
    assert replica_positions(16, 8, 3, 4) == [22, 23]
    with pytest.raises(ValueError, match="multiple of dp"):
        replica_positions(0, 6, 0, 4)


def test_state_of_another_dataset_is_refused(shards):
    r = ShardedTokens(shards, seed=0)
    with pytest.raises(ValueError, match="seed 5"):
        r.load_state_dict({"consumed": 8, "seed": 5, "samples": 249})


FLAGS = dict(layers=1, hidden=32, heads=4, seq=SEQ, optimizer="sgd", lr=0.05)


def test_dtlib_train_resumes_the_stream_on_fewer_ranks_exactly_once(shards, tmp_path):
    """2 ranks train 3 steps and checkpoint; 1 rank resumes (2 micro-batches keep the global batch
    of 4) and trains 3 more: every sample of the 6 steps once, in the global order."""
    log, ckpt = str(tmp_path / "log"), str(tmp_path / "ckpt")
    common = dict(FLAGS, data=shards, sample_log=log, checkpoint_dir=ckpt, checkpoint_every=1, resume=True)
    run(TrainConfig(**common, dp=2, steps=3), timeout=60)
    out = run(TrainConfig(**common, dp=1, num_microbatches=2, steps=6), timeout=60)
    assert "resumed at step 3" in out["resumed"] and out["samples_consumed"] == 24
    ids = read_sample_log(log)
    assert sorted(ids) == list(range(6))
    flat = [i for s in range(6) for i in ids[s]]
    assert flat == _first(shards, 0, 24)
    assert len(set(flat)) == 24


@pytest.mark.slow
def test_elastic_shrink_under_torchrun_trains_every_sample_once(shards, tmp_path):
    """torchrun --nnodes=1:2, two agents of one rank; rank 1's node is SIGKILLed at step 3; the
    survivor resumes the 2-rank checkpoint alone (--global-batch-size keeps 4 samples a step) and
    the sample log holds every position of the 6 steps once: none skipped, none repeated."""
    from test_resume import _lose_one_of_two_agents
    log = tmp_path / "log"
    args = ["train", "--data", shards, "--sample-log", str(log), "--layers", "1", "--hidden", "32", "--seq",
            str(SEQ), "--steps", "6", "--global-batch-size", "4", "--micro-batch", "2", "--optimizer", "sgd",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1", "--resume",
            "--kill-step", "3", "--kill-rank", "1", "--kill-agent", "--json"]
    agents = _lose_one_of_two_agents("dtlib", args, "stream-shrink", cwd=str(tmp_path), module=True)
    text = "\n".join(out + err for _, out, err in agents)
    assert sorted(code for code, _, _ in agents) == [-signal.SIGKILL, 0], text
    ids = read_sample_log(str(log))
    assert sorted(ids) == list(range(6)), text
    flat = [i for s in range(6) for i in ids[s]]
    assert len(flat) == len(set(flat)) == 24, text
    assert flat == _first(shards, 0, 24), text
    summary = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
    assert summary["world_size"] == 1 and summary["samples_consumed"] == 24, text


def test_slow_storage_shows_as_the_input_finding_and_healthy_reads_do_not(shards, tmp_path):
    """Prefetching one step ahead cannot hide reads slower than a step: the profiler names
    'input' first; with healthy storage input is at most a small share (compared in one test)."""
    base = dict(FLAGS, data=shards, steps=4)
    healthy = run(TrainConfig(**base, profile=str(tmp_path / "h")), timeout=120)
    slow = run(TrainConfig(**base, data_delay=0.5, profile=str(tmp_path / "s")), timeout=120)
    def input_share(out):  # the share of the step lost to data loading (0 when not reported)
        return next((f["share"] for f in out["profile"]["findings"] if f["kind"] == "input"), 0.0)
    # a 0.5 s read against a step of milliseconds: input is the top finding, most of the step; the
    # healthy run's reads (a few rows from memory-mapped shards) are a small share if reported at all
    assert slow["profile"]["findings"][0]["kind"] == "input", slow["profile"]["findings"]
    assert input_share(slow) > 0.5 and input_share(healthy) < 0.5 * input_share(slow), \
        (healthy["profile"]["findings"], slow["profile"]["findings"])
    assert np.isclose(sum(healthy["losses"]), sum(slow["losses"]))  # the same samples either way


def test_bad_data_options_fail_before_anything_starts(shards, tmp_path):
    with pytest.raises(ValueError, match="--data .*no index.json"):
        TrainConfig(data=str(tmp_path)).check()
    with pytest.raises(ValueError, match="need --data"):
        TrainConfig(sample_log=str(tmp_path)).check()
    with pytest.raises(ValueError, match="prefetch must be"):
        TrainConfig(data=shards, seq=SEQ, prefetch=-1).check()


def test_command_line_writes_shards_and_trains_on_them(tmp_path, capsys):
    from dtlib.cli import main as cli_main
    out = str(tmp_path / "shards")
    assert cli_main(["shards", out, "--seq", "16", "--samples-per-shard", "64", "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written["samples"] == check_shards(out, 16)["samples"] == (len(load_tokens()) - 1) // 16
    metrics = str(tmp_path / "m.jsonl")
    assert cli_main(["train", "--data", out, "--seq", "16", "--layers", "1", "--hidden", "32", "--steps", "2",
                     "--metrics", metrics, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["samples_consumed"] == 4 and len(open(metrics).readlines()) == 2
    assert cli_main(["train", "--data", out, "--seq", "32"]) == 2
    assert "holds samples of seq=16 tokens; --seq is 32" in capsys.readouterr().err
    # a file where the shards should go, or a folder as the text: one line each, and the file kept
    (tmp_path / "notes.txt").write_text("precious")
    assert cli_main(["shards", str(tmp_path / "notes.txt")]) == 2
    assert capsys.readouterr().err == (f"dtlib: error: OUT {tmp_path / 'notes.txt'} is a file; "
                                       f"give a directory (created if missing)\n")
    assert (tmp_path / "notes.txt").read_text() == "precious"
    assert cli_main(["shards", str(tmp_path / "more"), "--text", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"dtlib: error: --text {tmp_path}: a directory, not a file\n"


def _corrupt_copy(shards, tmp_path, how):
    """A copy of the shard directory whose shard 1 has one byte flipped or is cut short."""
    import shutil
    d = tmp_path / how
    shutil.copytree(shards, d)
    path = d / "shard.00001.npy"
    data = bytearray(path.read_bytes())
    if how == "flipped":
        data[-5] ^= 0x01  # a sample byte (the .npy header still parses)
    else:
        data = data[:len(data) // 2]
    path.write_bytes(bytes(data))
    return str(d)


@pytest.mark.parametrize("how", ["flipped", "truncated"])
def test_a_corrupt_shard_is_refused_by_name_when_first_read(shards, tmp_path, how):
    """Shard 1's sha256 no longer matches index.json: reading any of its samples is a ValueError
    naming it; shard 0 still reads (checked lazily, per shard); verify=False reads the bad bytes."""
    d = _corrupt_copy(shards, tmp_path, how)
    r = ShardedTokens(d)
    assert r.read([0, 1]).shape == (2, SEQ + 1)
    with pytest.raises(ValueError, match=r"shard\.00001\.npy is corrupt or truncated: its sha256 differs from index\.json's"):
        r.read([50])
    if how == "flipped":
        good = ShardedTokens(shards).read(list(range(50, 100)))
        assert not (ShardedTokens(d, verify=False).read(list(range(50, 100))) == good).all()


def test_sample_log_with_tp_and_pp_logs_each_sample_once(shards, tmp_path):
    """dp1 x tp2 x pp2: four ranks train on one replica's rows; the first of them logs them, so the
    exactly-once audit sees each step's global batch once (it saw each id 4 times before)."""
    log = str(tmp_path / "log")
    run(TrainConfig(**{**FLAGS, "layers": 2}, tp=2, pp=2, num_microbatches=2, data=shards, sample_log=log, steps=2),
        timeout=60)
    ids = read_sample_log(log)
    assert [ids[s] for s in range(2)] == [_first(shards, 0, 8)[:4], _first(shards, 0, 8)[4:]]
