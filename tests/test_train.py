"""The trainer: every layout's per-step losses and final parameters equal single-process training
on the same global batches; bad flags are one-line errors before any process starts."""
import json
import os
import subprocess
import sys

import pytest
import torch

from dtlib.cli import main as cli_main
from dtlib.launcher import launch
from dtlib.experiments.parallel3d import LOSS_TOL, PARAM_TOL, PARAM_TOL_ADAM, single_process_config
from dtlib.trainer import TrainConfig, params_sha256, train

TIMEOUT = 120
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# LOSS_TOL, PARAM_TOL (SGD) and PARAM_TOL_ADAM: float32 summation order; why, in dtlib.experiments.parallel3d
BASE = TrainConfig(layers=2, hidden=32, heads=4, seq=16, steps=3, micro_batch_size=2, optimizer="sgd", lr=0.5)
MOE = BASE.with_(moe_experts=4, moe_top_k=2)


def _single(config: TrainConfig) -> dict:
    """The same run on one process: the whole global batch in one micro-batch."""
    return train(0, 1, single_process_config(config), keep_params=True)


def _many(rank, world_size, configs):
    return [train(rank, world_size, c, keep_params=True) for c in configs]


def _check(configs, world_size):
    results = launch(_many, world_size, args=(configs,), timeout=TIMEOUT)[0]
    for config, got in zip(configs, results):
        ref = _single(config)
        assert got["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL), config
        assert ref["losses"][-1] < ref["losses"][0]  # it trains
        assert sorted(got["params"]) == sorted(ref["params"])
        worst = max((got["params"][n] - ref["params"][n]).abs().max().item() for n in ref["params"])
        assert worst < (PARAM_TOL if config.optimizer == "sgd" else PARAM_TOL_ADAM), (config, worst)
        assert got["params_sha256"] == params_sha256(got["params"])


LAYOUTS_2 = [
    BASE.with_(dp=2),
    BASE.with_(dp=2, num_microbatches=2),
    BASE.with_(dp=2, zero=1), BASE.with_(dp=2, zero=2), BASE.with_(dp=2, zero=3),
    BASE.with_(dp=2, zero=1, optimizer="adamw", lr=1e-2),
    BASE.with_(cp=2),
    MOE.with_(dp=2, ep=2), MOE.with_(dp=2, ep=2, capacity_factor=1.0),
    BASE.with_(tp=2), BASE.with_(tp=2, sequence_parallel=True),
    BASE.with_(pp=2, num_microbatches=2), BASE.with_(pp=2, num_microbatches=2, schedule="gpipe"),
    BASE.with_(pp=2, num_microbatches=2, tied_embeddings=True),  # Megatron's embedding group
]


def test_two_rank_layouts_equal_single_process():
    _check(LAYOUTS_2, 2)


LAYOUTS_4 = [
    BASE.with_(dp=2, cp=2),
    BASE.with_(dp=2, cp=2, zero=3),
    MOE.with_(dp=4, ep=2, capacity_factor=1.5),
    BASE.with_(dp=2, tp=2), BASE.with_(cp=2, tp=2),
    BASE.with_(dp=2, tp=2, sequence_parallel=True, zero=1, kv_heads=2),
    BASE.with_(dp=2, tp=2, sequence_parallel=True, zero=2, kv_heads=2),  # SP sums before ZeRO-2's hooks
    BASE.with_(tp=2, pp=2, sequence_parallel=True, num_microbatches=2),  # s/t positions between stages
    BASE.with_(tp=2, pp=2, sequence_parallel=True, num_microbatches=2, tied_embeddings=True),
    BASE.with_(tp=2, pp=2, num_microbatches=2),
    BASE.with_(dp=2, pp=2, layers=4, num_microbatches=4, schedule="interleaved", virtual_stages=2),
    BASE.with_(dp=2, pp=2, num_microbatches=2, schedule="zb-h1", zero=1),
    BASE.with_(dp=2, pp=2, num_microbatches=2, zero=2),
]


def test_four_rank_layouts_equal_single_process():
    _check(LAYOUTS_4, 4)


# FSDP (ZeRO-3) over dp x cp on what TP/SP and PP leave (torchtitan's 2-D and 3-D layouts)
LAYOUTS_FSDP = [
    BASE.with_(dp=2, tp=2, zero=3),
    BASE.with_(dp=2, tp=2, zero=3, sequence_parallel=True),
    BASE.with_(dp=2, pp=2, zero=3, num_microbatches=2),
    BASE.with_(dp=2, pp=2, zero=3, layers=4, num_microbatches=4, schedule="interleaved", virtual_stages=2),
    BASE.with_(cp=2, tp=2, zero=3),
    BASE.with_(dp=2, tp=2, zero=3, tied_embeddings=True),  # a tied embedding across FSDP units and TP
]


def test_fsdp_composes_with_tensor_sequence_and_pipeline_parallelism():
    _check(LAYOUTS_FSDP, 4)


def test_eight_rank_3d_interleaved_equals_single_process():
    # dp2 x tp2 x pp2 with the interleaved schedule (1F1B runs under torchrun below)
    _check([BASE.with_(dp=2, tp=2, pp=2, layers=4, num_microbatches=4, schedule="interleaved",
                       virtual_stages=2),
            BASE.with_(dp=2, tp=2, pp=2, zero=3, sequence_parallel=True, num_microbatches=2)], 8)  # FSDP x TP/SP x PP


def test_moe_routing_matters():
    # the MoE run differs from the dense one and its expert parameters are all trained
    moe = _single(MOE)
    dense = _single(BASE)
    assert moe["losses"][0] != pytest.approx(dense["losses"][0])
    assert sum(".experts." in n for n in moe["params"]) == 2 * 4 * 4  # layers x experts x (w, b) x 2


def test_params_sha256_is_canonical():
    a = {"b": torch.tensor([1.0, 2.0]), "a": torch.tensor([3.0], dtype=torch.float64)}
    # names sorted: a's value first, as float32 little-endian
    import hashlib
    expect = hashlib.sha256(torch.tensor([3.0, 1.0, 2.0]).numpy().astype("<f4").tobytes()).hexdigest()
    assert params_sha256(a) == expect
    assert params_sha256({"a": torch.tensor([3.0]), "b": torch.tensor([1.0, 2.0 + 1e-6])}) != expect


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3"], "tp=3 must divide the 4 attention heads"),
    (["--dp", "2", "--pp", "2", "--microbatches", "2", "--zero", "3", "--tied-embeddings"],
     "use --zero 0 or 1 with --tied-embeddings and --pp"),  # FSDP x PP composes, but not with tied copies
    (["--cp", "3"], "context parallel size cp=3 must divide the sequence length 32"),
    (["--cp", "4", "--seq", "36"], "2 x cp = 8 chunks (zig-zag); seq=36 must be a multiple of 8"),
    (["--ep", "2", "--dp", "2"], "needs an MoE model"),
    (["--zero", "1"], "needs dp x cp >= 2"),
    (["--vocab", "100"], "vocab must be >= 256"),
    (["--steps", "0"], "--steps must be an integer >= 1"),
    (["--lr", "-1"], "--lr must be a finite number > 0"),
    (["--schedule", "zb"], "invalid choice: 'zb'"),
    (["--pp", "2", "--microbatches", "3", "--schedule", "interleaved", "--virtual-stages", "2", "--layers", "4"],
     "num_microbatches (3) to be a multiple of pp=2"),
    (["--resume"], "resume needs a checkpoint_dir"),
    (["--kill-step", "5", "--steps", "5"], "--kill-step must be an integer from 0 to 4, got 5"),
    (["--dp", "2", "--kill-step", "1", "--kill-rank", "2"], "--kill-rank must be an integer from 0 to 1, got 2"),
    (["--keep-last", "0"], "--keep-last"),
    (["--kill-agent"], "--kill-agent needs --kill-step"),
    (["--heartbeat", "-1"], "--heartbeat must be a finite number >= 0, got '-1'"),
    (["--heartbeat", "nan"], "--heartbeat must be a finite number >= 0, got 'nan'"),
    (["--hang-step", "9", "--steps", "3"], "--hang-step must be an integer from 0 to 2, got 9"),
    (["--kill-agent", "--kill-step", "1"], "--kill-agent kills a torchrun agent: start the run with torchrun"),
    (["--dp", "2", "--global-batch-size", "6", "--micro-batch", "2"],
     "--global-batch-size 6 must be a multiple of --micro-batch x dp = 2 x 2 = 4"),
    (["--dp", "2", "--global-batch-size", "8", "--microbatches", "3"], "--microbatches 3 contradicts"),
    (["--tp", "2", "--pp", "2", "--schedule", "zb-h1", "--microbatches", "2"], "zb-h1 computes weight gradients"),
    (["--dp", "2", "--pp", "2", "--schedule", "zb-h1", "--microbatches", "2", "--zero", "2"],
     "use --zero 0 or 1 with zb-h1"),
    (["--dp", "2", "--pp", "2", "--microbatches", "2", "--zero", "2", "--tied-embeddings"],
     "use --zero 0 or 1 with --tied-embeddings and --pp"),
])
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    assert cli_main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dtlib: error:")
    assert message in err, err


@pytest.mark.parametrize("flags, message", [
    (["--checkpoint-dir", "{file}", "--checkpoint-every", "1"], "--checkpoint-dir {file} is a file; give a directory"),
    (["--resume", "--checkpoint-dir", "{file}"], "--checkpoint-dir {file} is a file; give a directory"),
    (["--steps", "3", "--profile", "{file}"], "--profile {file} is a file; give a directory"),
    (["--tensorboard", "{file}/runs"], "--tensorboard {file}/runs: cannot create it, {file} is a file"),
    (["--metrics", "{dir}"], "--metrics {dir} is a directory; give a file path"),
    (["--sample-log", "{file}"], "--sample-log {file} is a file; give a directory"),
])
def test_output_paths_are_checked_before_any_rank_starts(tmp_path, monkeypatch, capsys, flags, message):
    # the first rank to write died with FileExistsError / IsADirectoryError after every rank had started
    from dtlib import trainer

    monkeypatch.setattr(trainer, "run", lambda *a, **k: pytest.fail("ranks were started"))
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "dir").mkdir()
    names = {"file": str(tmp_path / "file"), "dir": str(tmp_path / "dir")}
    assert cli_main(["train", "--dp", "2", *[f.format(**names) for f in flags]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.format(**names) in err, err


def test_command_line_json_and_help(capsys):
    assert cli_main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--layers", "--hidden", "--heads", "--kv-heads", "--ffn", "--vocab", "--seq", "--moe-experts",
                 "--moe-top-k", "--dp", "--tp", "--pp", "--cp", "--ep", "--sequence-parallel", "--zero",
                 "--schedule", "--virtual-stages", "--micro-batch", "--microbatches", "--steps", "--lr", "--seed",
                 "--checkpoint-dir", "--checkpoint-every", "--keep-last", "--milestone-every", "--async-checkpoint", "--resume",
                 "--global-batch-size", "--kill-step", "--kill-rank", "--kill-agent", "--hang-step", "--hang-rank",
                 "--heartbeat", "--json"):
        assert flag in text, flag
    argv = ["train", "--dp", "2", "--layers", "2", "--hidden", "32", "--seq", "16", "--steps", "2",
            "--optimizer", "sgd", "--lr", "0.5", "--json"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    ref = _single(BASE.with_(dp=2, steps=2))
    assert out["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL)
    assert out["steps"] == 2 and out["layout"]["dp"] == 2 and out["tokens_per_s"] > 0 and 0 < out["mfu"] < 1
    assert len(out["params_sha256"]) == 64 and len(out["peak_memory_bytes"]) == 2
    # what ran, and which peak the MFU is of (issue 28: "MFU 2.81%" said neither)
    assert out["backend"] == "gloo" and out["model"]["layers"] == 2 and out["model"]["seq"] == 16
    assert out["mfu_peak"].startswith("this CPU's measured fp32 matmul peak (")


def test_command_line_runs_fsdp_with_tensor_and_sequence_parallelism(capsys):
    # the command line: dtlib train --zero 3 --tp 2 --dp 2 (+ --sequence-parallel)
    argv = ["train", "--dp", "2", "--zero", "3", "--tp", "2", "--sequence-parallel", "--layers", "2", "--hidden", "32",
            "--seq", "16", "--steps", "2", "--optimizer", "sgd", "--lr", "0.5", "--json"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    ref = _single(BASE.with_(dp=2, tp=2, zero=3, sequence_parallel=True, steps=2))
    assert out["world_size"] == 4 and out["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL)


def test_global_batch_size_sets_the_accumulation(capsys):
    # Megatron's rule: num_microbatches = global / (dp x micro-batch); 8 sequences on 2 replicas of 2
    argv = ["train", "--dp", "2", "--global-batch-size", "8", "--layers", "1", "--hidden", "32", "--seq", "16",
            "--steps", "1", "--optimizer", "sgd", "--lr", "0.5", "--json"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    ref = _single(BASE.with_(layers=1, dp=2, num_microbatches=2, steps=1))
    assert out["global_batch"] == 8 and out["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL)


def test_torchrun_two_agents(tmp_path):
    # two torchrun agents of 4 processes each on localhost (two "nodes"), the same code: dp2 x tp2 x pp2
    # TMPDIR: torchrun's agents would leave their torchelastic_* log folders in the system temp directory
    env = {**os.environ, "PYTHONPATH": ROOT, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-id", "dtlib-train-test"]
    port_probe = subprocess.run([sys.executable, "-c", "import socket; s=socket.socket(); s.bind(('',0)); "
                                 "print(s.getsockname()[1])"], capture_output=True, text=True)
    endpoint = f"localhost:{port_probe.stdout.strip()}"
    torchrun[torchrun.index("localhost:0")] = endpoint
    args = ["-m", "dtlib", "train", "--dp", "2", "--tp", "2", "--pp", "2", "--microbatches", "2", "--layers", "2",
            "--hidden", "32", "--seq", "16",
            "--steps", "2", "--optimizer", "sgd", "--lr", "0.5", "--json"]
    agents = [subprocess.Popen(torchrun + (["--rdzv-conf", "is_host=1"] if i == 0 else ["--rdzv-conf", "is_host=0"])
                               + args, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for i in range(2)]
    outs = []
    for a in agents:
        try:
            out, err = a.communicate(timeout=TIMEOUT)
        finally:
            a.kill()
        assert a.returncode == 0, err[-3000:]
        outs.append(out)
    summary = json.loads(next(line for o in outs for line in o.splitlines() if line.startswith("{")))
    ref = _single(BASE.with_(dp=2, tp=2, pp=2, num_microbatches=2, steps=2))
    assert summary["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL)
    assert summary["world_size"] == 8


def _resume(rank, world_size, config, directory):
    whole = train(rank, world_size, config)
    first = train(rank, world_size, config.with_(steps=2, checkpoint_dir=directory, checkpoint_every=2))
    rest = train(rank, world_size, config.with_(checkpoint_dir=directory, resume=True))
    return whole, first, rest


@pytest.mark.parametrize("config", [BASE.with_(dp=2, zero=1, optimizer="adamw", lr=1e-2, steps=4),
                                    BASE.with_(cp=2, zero=3, steps=4)])
def test_checkpoint_and_resume_is_bit_exact(config, tmp_path):
    # stop after 2 steps (a DCP checkpoint), resume to 4: the same weights, bit for bit
    whole, first, rest = launch(_resume, 2, args=(config, str(tmp_path)), timeout=TIMEOUT)[0]
    assert (tmp_path / "latest").read_text() == "step00000002"
    assert rest["first_step"] == 2 and len(rest["losses"]) == 2
    assert first["losses"] + rest["losses"] == whole["losses"]
    assert rest["params_sha256"] == whole["params_sha256"] != first["params_sha256"]
