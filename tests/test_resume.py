"""Bit-identical resume under torchrun: a rank SIGKILLed at a random step, torchrun restarts the
group, it resumes from the last checkpoint and ends with the uninterrupted run's parameters."""
import json
import os
import random
import signal
import subprocess
import sys

from dtlib.launcher import launch
from dtlib.resilience.elastic import torchrun_command, torchrun_env
from _resilience_worker import options, train

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_resilience_worker.py")
STEPS = 7


def torchrun(outdir, *args, nproc=2, max_restarts=0, timeout=90):
    """Run the worker under torchrun in its own session; kill the whole group whatever happens."""
    env = torchrun_env()
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    cmd = torchrun_command(WORKER, [str(outdir), str(STEPS), *map(str, args)], nproc_per_node=nproc,
                           max_restarts=max_restarts)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result = os.path.join(outdir, "result.json")
    return proc.returncode, log, json.load(open(result)) if os.path.exists(result) else None


def test_killed_then_hung_rank_resumes_bit_identical(tmp_path):
    """Attempt 0: rank 1 is SIGKILLed at a random step; torchrun restarts the group, which resumes.
    Attempt 1: rank 0 hangs two steps later; the heartbeat aborts the job; torchrun restarts it
    again. Attempt 2 finishes with the parameters of the uninterrupted run, bit for bit."""
    launch(train, 2, args=(options([str(tmp_path / "straight"), str(STEPS)]),), timeout=60)
    straight = json.load(open(tmp_path / "straight" / "result.json"))
    assert straight["steps_seen_last_attempt"] == list(range(STEPS))
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
    assert resumed["steps_seen_last_attempt"] == list(range(hang, STEPS)), where
    assert resumed["params_sha256"] == straight["params_sha256"], where
