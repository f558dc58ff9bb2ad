"""Restarts under torchrun: a rank SIGKILLed at a random step (then a hung one) resumes bit for bit
to the uninterrupted run's parameters; a lost node shrinks the world and training goes on."""
import json
import os
import random
import signal
import socket
import subprocess
import tempfile

import pytest
import torch.distributed as dist

from dtlib.launcher import launch
from dtlib.resilience.elastic import torchrun_command, torchrun_env
from dtlib.experiments.resilience import train_drill

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_resilience_worker.py")
STEPS = 7


def _agents(cmd, n=1, cwd=None, timeout=120):
    """Start ``n`` torchrun agents running ``cmd``, each in its own session, and kill every session
    whatever happens (the workers of a killed agent are orphans in its session). Returns
    (returncode, stdout, stderr) per agent."""
    env = torchrun_env()
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    # torchrun's agent writes its workers' logs to a new torchelastic_* folder in the temp
    # directory and never removes it: here that directory is the test's own, removed after it
    with tempfile.TemporaryDirectory(prefix="torchrun-") as scratch:
        env["TMPDIR"] = scratch
        agents = [subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True) for _ in range(n)]
        outs = []
        try:
            for a in agents:
                outs.append(a.communicate(timeout=timeout))
        finally:
            for a in agents:
                try:
                    os.killpg(a.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                a.wait()
    return [(a.returncode, out, err) for a, (out, err) in zip(agents, outs)]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lose_one_of_two_agents(target, args, rdzv_id, cwd=None, module=False):
    """``torchrun --nnodes=1:2`` with two agents of one process each (``args`` make rank 1 kill
    its agent). The rendezvous is hosted here, not by an agent: the node that dies could be the
    host (in a cluster: etcd, or a store on a node outside the job). A lost node is noticed after
    2 missed keep-alives of 1 s. A round closes when both agents have joined, or 10 s after the
    first: the two agents start seconds apart on a loaded machine, and a round closed on one agent
    would run the job on one rank (the survivor's round after the loss waits those 10 s)."""
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)
    cmd = torchrun_command(target, args, nproc_per_node=1, max_restarts=1, nnodes="1:2",
                           rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=rdzv_id, module=module)
    cmd.insert(cmd.index("--module" if module else target),
               "--rdzv-conf=is_host=false,keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=10")
    try:
        return _agents(cmd, n=2, cwd=cwd, timeout=150)
    finally:
        del store


def torchrun(outdir, *args, nproc=2, max_restarts=0, timeout=90):
    """Run the drill worker under torchrun: (returncode, log, rank 0's result or None)."""
    cmd = torchrun_command(WORKER, [str(outdir), str(STEPS), *map(str, args)], nproc_per_node=nproc,
                           max_restarts=max_restarts)
    [(code, out, err)] = _agents(cmd, timeout=timeout)
    result = os.path.join(outdir, "result.json")
    return code, out + err, json.load(open(result)) if os.path.exists(result) else None


def dtlib_train(args, nproc, cwd):
    """``dtlib train ARGS`` under ``torchrun --max-restarts 1``: (returncode, stdout, stderr)."""
    cmd = torchrun_command("dtlib", ["train", *args], nproc_per_node=nproc, max_restarts=1, module=True)
    return _agents(cmd, cwd=cwd)[0]


@pytest.mark.slow
def test_killed_then_hung_rank_resumes_bit_identical(tmp_path):
    """Attempt 0: rank 1 is SIGKILLed at a random step; torchrun restarts the group, which resumes.
    Attempt 1: rank 0 hangs two steps later; the heartbeat aborts the job; torchrun restarts it
    again. Attempt 2 finishes with the parameters of the uninterrupted run, bit for bit."""
    straight = launch(train_drill, 2, args=(str(tmp_path / "straight"), STEPS), timeout=60)[0]
    assert straight["steps_seen"] == list(range(STEPS))
    kill = random.Random().randint(1, STEPS - 3)
    hang = kill + 2
    code, log, resumed = torchrun(tmp_path / "killed", "--kill-rank", 1, "--kill-step", kill, "--hang-rank", 0,
                                  "--hang-step", hang, "--heartbeat", 4.0, max_restarts=2)
    where = f"killed at step {kill}, hung at {hang}\n{log}"
    assert code == 0, where
    assert resumed["restart_count"] == 2, where
    assert f"resumed at step {kill} on the same 2 ranks" in log, where
    assert f"heartbeat: hung rank 0 (last step {hang}, phase 'data'" in log, where
    assert f"resumed at step {hang} on the same 2 ranks" in log, where
    # the last attempt saw only the batches after its checkpoint: none twice, none skipped
    assert resumed["steps_seen"] == list(range(hang, STEPS)), where
    assert resumed["params_sha256"] == straight["params_sha256"], where


@pytest.mark.slow
def test_elastic_shrink_two_agents_to_one(tmp_path):
    """torchrun --nnodes=1:2 with two agents of one process; the node of rank 1 (agent and worker)
    is SIGKILLed; the surviving agent restarts alone, reshards the 2-rank checkpoint onto 1 rank,
    accumulates 4 micro-batches instead of 2 (the global batch of 8 stays) and finishes."""
    agents = _lose_one_of_two_agents(WORKER, [str(tmp_path), str(STEPS), "--kill-rank", "1", "--kill-step", "3",
                                              "--kill-agent"], "shrink")
    logs = [out + err for _, out, err in agents]
    log = "\n".join(logs)
    codes = sorted(code for code, _, _ in agents)
    assert codes == [-signal.SIGKILL, 0], log
    result = json.load(open(tmp_path / "result.json"))
    assert result["world_size"] == 1 and result["restart_count"] == 1, log
    assert "resumed at step 3 on 1 ranks instead of 2: checkpoint resharded, num_microbatches 2 -> 4 keeps the global batch of 8" in log, log
    assert result["steps_seen"] == list(range(3, STEPS)), log


# ---- dtlib train under torchrun: a rank SIGKILLed at a random step --------------------------------
TRAIN = ["--layers", "2", "--hidden", "32", "--seq", "16", "--steps", "6", "--optimizer", "adamw",
         "--lr", "0.01", "--json"]
DRILLS = {"dp2": ["--dp", "2"], "dp2 x zero2": ["--dp", "2", "--zero", "2"],
          "tp2 x pp2": ["--tp", "2", "--pp", "2", "--microbatches", "2"]}
EVERY = 2


@pytest.mark.slow
@pytest.mark.parametrize("layout", DRILLS)
def test_dtlib_train_killed_rank_resumes_bit_identical(layout, tmp_path, capsys):
    """`dtlib train --checkpoint-every 2 --resume` under `torchrun --max-restarts 1`; a random rank
    SIGKILLs itself at a random step; torchrun restarts the group, which loads the last checkpoint,
    redoes the steps after it and ends with the uninterrupted run's params_sha256."""
    from dtlib.cli import main as cli_main
    flags = DRILLS[layout] + TRAIN
    world = 4 if "tp2" in layout else 2
    assert cli_main(["train", *flags]) == 0
    straight = json.loads(capsys.readouterr().out)
    rng = random.Random()
    kill, rank = rng.randint(EVERY, 5), rng.randrange(world)
    resumed_at = kill - kill % EVERY
    code, out, err = dtlib_train([*flags, "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", str(EVERY),
                                  "--resume", "--kill-step", str(kill), "--kill-rank", str(rank)], world, tmp_path)
    where = f"{layout}: rank {rank} killed at step {kill}\n{err[-4000:]}"
    assert code == 0, where
    assert f"fault drill: rank {rank} SIGKILLs itself at step {kill}" in err, where
    assert f"resumed at step {resumed_at} from {tmp_path / 'ck'}" in err, where
    summary = json.loads(out)  # --json: stdout is the one JSON object, drills and resume lines on stderr
    assert summary["first_step"] == resumed_at, where
    assert summary["losses"] == straight["losses"][resumed_at:], where  # the steps redone, bit for bit
    assert summary["params_sha256"] == straight["params_sha256"], where


@pytest.mark.slow
def test_dtlib_train_loses_a_node_and_goes_on_with_the_same_global_batch(tmp_path, capsys):
    """`dtlib train --global-batch-size 8` under `torchrun --nnodes=1:2`, two agents of one process;
    at step 3 rank 1 SIGKILLs its agent and itself (a lost node). The survivor restarts alone,
    reshards the dp2 checkpoint onto one rank, accumulates 4 micro-batches instead of 2 and
    finishes the run: the same losses as the uninterrupted dp2 run (float32 reordering)."""
    from dtlib.cli import main as cli_main
    flags = ["--global-batch-size", "8", "--layers", "2", "--hidden", "32", "--seq", "16", "--steps", "5",
             "--optimizer", "sgd", "--lr", "0.5", "--json"]
    assert cli_main(["train", "--dp", "2", *flags]) == 0
    straight = json.loads(capsys.readouterr().out)
    agents = _lose_one_of_two_agents("dtlib", ["train", *flags, "--checkpoint-dir", str(tmp_path / "ck"),
                                                     "--checkpoint-every", "1", "--resume", "--kill-step", "3",
                                                     "--kill-rank", "1", "--kill-agent"],
                                     "train-shrink", cwd=tmp_path, module=True)
    log = "\n".join(err for _, _, err in agents)
    assert sorted(code for code, _, _ in agents) == [-signal.SIGKILL, 0], log[-4000:]
    assert "resumed at step 3 from" in log and "(resharded from dp2 to 1 process); num_microbatches 2 -> 4 " \
        "keeps the global batch of 8" in log, log[-4000:]
    summary = json.loads(next(out for code, out, _ in agents if code == 0))  # stdout: the JSON object alone
    assert summary["world_size"] == 1 and summary["first_step"] == 3 and summary["global_batch"] == 8
    assert summary["losses"] == pytest.approx(straight["losses"][3:], abs=1e-5)


@pytest.mark.slow
def test_dtlib_train_hung_rank_is_named_and_the_run_resumes(tmp_path, capsys):
    """`dtlib train --heartbeat 3` under `torchrun --max-restarts 1`: rank 1 hangs in the data phase
    of step 3 (no collective, no progress); the heartbeat names it within seconds, ends the job
    with exit 75, torchrun restarts it, the run resumes from step 2 and ends bit-identical."""
    from dtlib.cli import main as cli_main
    flags = ["--dp", "2"] + TRAIN
    assert cli_main(["train", *flags]) == 0
    straight = json.loads(capsys.readouterr().out)
    code, out, err = dtlib_train([*flags, "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", str(EVERY),
                                  "--resume", "--hang-step", "3", "--hang-rank", "1", "--heartbeat", "3"], 2, tmp_path)
    assert code == 0, err[-4000:]
    assert "fault drill: rank 1 hangs in the data phase of step 3" in err, err[-4000:]
    assert "heartbeat: hung rank 1 (last step 3, phase 'data'" in err, err[-4000:]
    assert f"resumed at step 2 from {tmp_path / 'ck'}" in err, err[-4000:]
    summary = json.loads(out)  # --json: stdout is the one JSON object, drills and resume lines on stderr
    assert summary["losses"] == straight["losses"][2:] and summary["params_sha256"] == straight["params_sha256"]


def test_kill_and_resume_prints_nothing_and_reports_the_failure_whole(tmp_path, capfd):
    """Lesson 8's drill: its ranks print nothing of their own (the lesson prints each run's log in
    order: the kill, then the resume), and the failure line keeps the launcher's whole first line
    with gloo's source path cut to its file, never a path cut mid-word."""
    from dtlib.experiments.resilience import kill_and_resume

    drill = kill_and_resume(str(tmp_path / "drill"), steps=4, kill_step=2)
    out, err = capfd.readouterr()
    assert "resumed at step" not in out + err
    assert drill["resumed"]["log"][0].startswith("resumed at step 2")
    assert drill["failure"].startswith("rank 1 SIGKILLed at step 2; the launcher reports: rank ")
    assert "/__w/" not in drill["failure"] and not drill["failure"].endswith("...")  # cut mid-word once
    assert drill["straight"]["params_sha256"] == drill["resumed"]["params_sha256"]


def test_failure_line_shortens_gloo_source_paths_only():
    from dtlib.experiments.resilience import failure_line
    from dtlib.launcher import RankFailedError

    error = RankFailedError("rank 0 of 2 failed: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/"
                            "transport/tcp/pair.cc:537] Read error [127.0.0.1]:32680: Connection reset by peer. "
                            "This is typically caused by a remote worker hanging. GLHF!\ntraceback",
                            rank=0, rank_traceback="")
    assert failure_line(error) == ("rank 0 of 2 failed: RuntimeError: [pair.cc:537] Read error [127.0.0.1]:32680: "
                                   "Connection reset by peer. …")
    error = RankFailedError("rank 1 of 2 failed: ValueError: bad step 3\ntraceback", rank=1, rank_traceback="")
    assert failure_line(error) == "rank 1 of 2 failed: ValueError: bad step 3"
