"""Ray Train running ``dtlib train``: the same run as ``dtlib.launch`` bit for bit (and as one
process within float32 tolerance), a worker killed mid-run restarted by Ray's FailureConfig from
dtlib's checkpoint to the uninterrupted run's weights, the CLI's ``--launcher ray --json``, bad
combinations refused before Ray starts, and no Ray process left behind.

Each Ray test starts and stops its own Ray (``run_ray``'s own lifecycle, which the CLI uses, ~4 s
on an idle machine) instead of sharing one session through a fixture: a failed run cannot leave
actors behind for the next test, and the process check below sees exactly one run's processes.
"""
import json
import os
import sys
import uuid

import psutil
import pytest

pytest.importorskip("ray.train")

from dtlib.cli import main as cli_main  # noqa: E402
from dtlib.experiments.parallel3d import compare_with_single_process  # noqa: E402
from dtlib.frameworks import ray_train  # noqa: E402
from dtlib.frameworks.ray_train import _start_ray as start_ray, run_ray  # noqa: E402
from dtlib.trainer import TrainConfig, run  # noqa: E402

TIMEOUT = 240  # a bound for a hang, far above the ~30 s a run takes here
# the trainer tests' small TinyGPT; SGD for the equality (its update is proportional to the
# gradient, so a wrong average shows), AdamW for the drill (its moments must be restored too)
SGD = TrainConfig(layers=2, hidden=32, heads=4, seq=16, steps=4, micro_batch_size=2, optimizer="sgd", lr=0.5, dp=2)
ADAMW = SGD.with_(steps=5, optimizer="adamw", lr=1e-2)


@pytest.fixture(scope="module")
def references():
    """dtlib.launch's runs (before any Ray starts in this process: launch forks its ranks) and the
    SGD run's single-process comparison (dtlib.experiments.parallel3d's float32 tolerances)."""
    return {"sgd": compare_with_single_process(SGD, timeout=TIMEOUT), "adamw": run(ADAMW, timeout=TIMEOUT)}


@pytest.fixture
def ray_processes(monkeypatch):
    """Mark every process this test starts (Ray's GCS, raylet and workers inherit the variable,
    whatever they rename themselves to) and, after the test, assert that none is still running and
    that the Ray temporary directory each start made (its sessions' logs and sockets) is gone."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv("DTLIB_RAY_TEST_MARK", mark)
    roots = []

    def start(num_cpus):
        token, root = start_ray(num_cpus)
        import ray

        # Ray's session really is in it (not in its default /tmp/ray)
        assert ray._private.worker._global_node.get_session_dir_path().startswith(root + os.sep)
        roots.append(root)
        return token, root

    monkeypatch.setattr(ray_train, "_start_ray", start)
    yield
    import ray

    assert not ray.is_initialized()
    assert roots and not [root for root in roots if os.path.exists(root)]
    marked = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get("DTLIB_RAY_TEST_MARK") == mark:
                marked.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    _, alive = psutil.wait_procs(marked, timeout=15)  # workers exit once their raylet is gone
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.name()) for p in alive]


def test_cli_ray_launcher_equals_dtlib_launch_and_one_process(references, ray_processes, capfd):
    flags = ["--dp", "2", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--steps", "4",
             "--micro-batch", "2", "--optimizer", "sgd", "--lr", "0.5"]
    assert cli_main(["train", "--launcher", "ray", "--json", *flags, "--timeout", str(TIMEOUT)]) == 0
    out = capfd.readouterr().out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out  # Ray's own logging goes to stderr
    got = json.loads(lines[0])
    ref = references["sgd"]
    # the same ranks, batches and one thread per rank as dtlib.launch's forked ranks: bit for bit
    assert got["losses"] == ref["parallel"]
    assert got["params_sha256"] == ref["parallel_sha256"]
    assert ref["equal"], ref  # ... and dtlib.launch equals one process within float32 tolerance
    assert ref["parallel_sha256"] != ref["single_sha256"]  # (another summation order, as expected)
    assert got["losses"][-1] < got["losses"][0]
    assert (got["launcher"], got["attempts"], got["restarts"], got["ray_resumed_from"]) == ("ray", 1, 0, None)
    assert got["world_size"] == 2 and got["layout"]["dp"] == 2 and got["first_step"] == 0


def test_killed_worker_restarts_from_dtlib_checkpoint(references, ray_processes, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative --checkpoint-dir means the caller's directory, not Ray's
    config = ADAMW.with_(checkpoint_dir="ckpt", checkpoint_every=2, resume=True, kill_step=3)
    got = run_ray(config, max_failures=1, storage_path="ray", timeout=TIMEOUT)
    ref = references["adamw"]
    assert (got["attempts"], got["restarts"]) == (2, 1)  # rank 1 died at step 3, Ray restarted the group
    assert got["ray_resumed_from"] == 2 and got["first_step"] == 2  # Ray's pointer and dtlib agree
    assert got["resumed"].startswith(f"resumed at step 2 from {tmp_path / 'ckpt'}")
    assert got["losses"] == ref["losses"][2:]  # steps 2, 3, 4 again, bit for bit
    assert got["params_sha256"] == ref["params_sha256"]
    # Ray's storage holds pointers to dtlib's checkpoints, not a second copy of them
    saved = [p for p in (tmp_path / "ray").glob("dtlib-train/checkpoint_*") if p.is_dir()]
    assert saved
    for directory in saved:
        assert {p.name for p in directory.iterdir()} <= {"pointer.json", "summary.json"}
        pointer = json.loads((directory / "pointer.json").read_text())
        assert pointer["checkpoint_dir"] == str(tmp_path / "ckpt") and pointer["step"] in (2, 4)


@pytest.mark.parametrize("change, kwargs, message", [
    (dict(kill_step=1, kill_agent=True), {}, "kill_agent .--kill-agent. kills a torchrun agent"),
    (dict(checkpoint_dir="unused", checkpoint_every=1, async_checkpoint=True), {}, "async_checkpoint"),
    ({}, dict(max_failures=-1), "max_failures must be"),
    ({}, dict(timeout=0), "timeout must be"),
    (dict(steps=0), {}, "steps must be"),
])
def test_run_ray_refuses_before_ray_starts(change, kwargs, message):
    import ray

    with pytest.raises(ValueError, match=message):
        run_ray(SGD.with_(**change), **kwargs)
    assert not ray.is_initialized()


@pytest.mark.parametrize("flags, message", [
    (["--launcher", "ray", "--kill-step", "1", "--kill-agent"], "--kill-agent"),
    (["--launcher", "ray", "--backend", "nccl"], "--backend nccl: --launcher ray starts CPU workers over gloo"),
    (["--launcher", "ray", "--max-failures", "-1"], "--max-failures"),
    (["--max-failures", "1"], "--max-failures is Ray Train's FailureConfig"),
    (["--launcher", "torchrun"], "not started by torchrun"),
])
def test_cli_refuses_bad_launcher_combinations(flags, message, capsys):
    import ray

    assert cli_main(["train", "--dp", "2", "--steps", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not ray.is_initialized()


def test_cli_says_how_to_install_ray(monkeypatch, capsys):
    for name in ("ray", "ray.train"):
        monkeypatch.setitem(sys.modules, name, None)  # import ray -> ImportError
    assert cli_main(["train", "--launcher", "ray", "--dp", "2", "--steps", "2"]) == 2
    assert capsys.readouterr().err == "dtlib: error: dtlib train --launcher ray needs ray: pip install 'dtlib[frameworks]'\n"
