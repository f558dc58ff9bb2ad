"""Ray Train running ``dtlib train``: :func:`dtlib.trainer.train` as the per-worker function of a
``TorchTrainer``, with Ray's ``FailureConfig`` restarting the worker group from dtlib's checkpoint.

What Ray does and what dtlib keeps doing:

* **Process group.** Ray Train's ``TorchConfig(backend="gloo")`` starts one actor per rank and
  initialises the default process group in each (``env://``, after setting ``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR`` ...); :func:`~dtlib.trainer.train` finds it initialised and
  builds its dp/tp/pp/cp groups on it, exactly as under ``dtlib.launch`` or torchrun.
* **Checkpoints.** dtlib's :class:`~dtlib.resilience.checkpoint.Checkpointer` in
  ``TrainConfig.checkpoint_dir`` is the source of truth (sharded, verified, reshardable). After each
  save every rank calls ``ray.train.report``; rank 0 attaches a *pointer* checkpoint (a small
  directory with ``pointer.json``: dtlib's directory and step, Ray's documented pattern for
  checkpoints it should not copy), so Ray's storage holds a few bytes per save, not a second copy.
* **Restarts.** ``FailureConfig(max_failures=N)``: when a worker dies, Ray tears the group down and
  starts it again. A restarted worker finds the last pointer with ``ray.train.get_checkpoint()`` and
  runs ``train`` with ``resume=True`` on that directory (dtlib loads its newest complete
  checkpoint, which is the pointer's or a newer one). Without a reported checkpoint it starts from
  step 0, as Ray's own examples do.
* **First attempt.** dtlib's fault drills (``kill_step``, ``hang_step``) act on torchrun's first
  attempt only, read from ``TORCHELASTIC_RESTART_COUNT``
  (:func:`~dtlib.resilience.elastic.restart_count`). Ray Train exposes no attempt number to its
  workers, so an actor of this run counts each rank's starts and the worker sets that variable to
  its attempt (0, 1, ...) before calling ``train``: the drill fires once, like under torchrun.
* **Result.** Rank 0's summary (what :func:`dtlib.trainer.run` returns) travels back in the last
  report's checkpoint (``summary.json``), with ``launcher``, ``attempts`` and ``restarts`` added, and
  ``ray_resumed_from`` (the step of the pointer a restart found).

Ray defaults overridden, and why (also in ``docs/frameworks.md``):

* ``ray.init(num_cpus=world_size)``: Ray's CPU is a scheduling label, not a core. Each worker asks
  for ``{"CPU": 1}`` (``ScalingConfig``), so the group needs ``world_size`` of them; Ray's default
  (the machine's cores) would leave 4 ranks on 2 cores unschedulable forever, and a larger number
  only makes Ray prestart idle worker processes. dtlib's ranks share the cores as under
  ``dtlib.launch``.
* ``object_store_memory=256 MiB`` (default: 30% of RAM) and ``include_dashboard=False``: nothing
  big goes through the object store, and the dashboard is ~0.5 GB and seconds of start-up.
* ``_temp_dir``: a fresh directory under ``/tmp``, removed when the run's Ray is shut down (Ray's
  default, ``/tmp/ray``, keeps every session's logs and sockets, about 0.5 MB per ``ray.init``, for
  ever). It stays short: Ray puts its sockets under it (``session_<date>_<pid>/sockets/plasma_store``)
  and a Unix socket's path may not exceed 107 bytes, which a pytest or ``TMPDIR`` path would.
* ``TorchConfig(backend="gloo", timeout_s=timeout)``: dtlib's trainer keeps its tensors on the CPU;
  the collective timeout (default 1800 s) is bounded by the run's so a stuck rank fails in time.
* ``RunConfig(storage_path=...)``: default a temporary directory removed at the end (Ray's default,
  ``~/ray_results``, would keep pointers to checkpoints dtlib may have deleted);
  ``CheckpointConfig(num_to_keep=keep_last)``: Ray keeps as many pointers as dtlib keeps checkpoints.

Refused before Ray starts: ``kill_agent`` (a Ray worker's parent is Ray's raylet, not a torchrun
agent) and ``async_checkpoint`` (the pointer must name a complete checkpoint).
"""
from __future__ import annotations

from dtlib.extras import require

require("frameworks", "ray", feature=__name__)

import contextlib
import json
import math
import os
import shutil
import tempfile
import threading
import uuid
from dataclasses import asdict
from typing import Any, Iterator

from dtlib.analytic import validate
from dtlib.trainer import TrainConfig, check_resume, train
from dtlib.trainer.hooks import Hook

__all__ = ["run_ray", "check_ray_config"]

_POINTER = "pointer.json"
_SUMMARY = "summary.json"
_OBJECT_STORE_BYTES = 256 * 2 ** 20
# Ray Train's controller settings (environment variables it reads, ray/train/v2/_internal/constants.py):
# poll the workers every 0.5 s instead of 2 s (a report, a dead worker and the end are seen sooner;
# each save waits for its report to be committed), and no spot-preemption watcher (an extra
# process polling the nodes every 5 s, for cloud preemptions a local run never has)
_SESSION_VARIABLE = "DTLIB_RAY_SESSION"  # marks the processes of a Ray that run_ray started
_RAY_TRAIN_SETTINGS = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
# TrainConfig's paths: Ray's workers run in its run directory (os.chdir), so they get absolute ones
_PATHS = ("checkpoint_dir", "profile", "data", "sample_log", "metrics", "tensorboard")
_RAY_ROOT = "/tmp"  # parent of each run's Ray temporary directory: short, see the module docstring


def check_ray_config(config: TrainConfig, max_failures: int = 0, timeout: float = 300.0) -> TrainConfig:
    """Raise a one-line ValueError naming the first option Ray cannot honour (before Ray starts),
    after :meth:`TrainConfig.check` and :func:`dtlib.trainer.check_resume`."""
    config.check()
    check_resume(config)
    validate.integer("max_failures", max_failures, minimum=0)
    validate.number("timeout", timeout)
    if config.kill_agent:
        raise ValueError("kill_agent (--kill-agent) kills a torchrun agent; a Ray worker's parent is Ray's "
                         "raylet: use --kill-step alone with --launcher ray")
    if config.async_checkpoint:
        raise ValueError("async_checkpoint (--async-checkpoint) is not supported with Ray: each save is "
                         "reported to Ray as a pointer, which must name a complete checkpoint")
    return config


def run_ray(config: TrainConfig, *, max_failures: int = 0, storage_path: str | None = None,
            timeout: float = 300.0) -> dict[str, Any]:
    """Run ``config`` as a Ray Train ``TorchTrainer`` job of ``config.world_size`` CPU workers and
    return rank 0's summary (as :func:`dtlib.trainer.run`), plus ``launcher: "ray"``, ``attempts``
    (worker-group starts), ``restarts`` (``attempts - 1``) and ``ray_resumed_from`` (the step of
    the checkpoint Ray handed the last attempt, or None).

    ``max_failures``: worker-group restarts Ray may do (``FailureConfig``); ``storage_path``: Ray's
    storage for its run directory (default: a temporary directory removed afterwards);
    ``timeout``: seconds for the whole run, Ray's start included. Starts a Ray instance of its own
    when this process is not connected to one, and always shuts down what it started; on timeout Ray is shut down in any case, so nothing is
    left running. A run that fails more than ``max_failures`` times raises Ray's
    ``TrainingFailedError`` (with the worker's traceback)."""
    check_ray_config(config, max_failures, timeout)
    config = config.with_(**{name: os.path.abspath(getattr(config, name)) for name in _PATHS
                             if getattr(config, name) is not None})
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    started = not ray.is_initialized()
    token, ray_root = None, None
    temporary = tempfile.mkdtemp(prefix="dtlib-ray-") if storage_path is None else None
    attempts = None
    try:
        if started:
            token, ray_root = _start_ray(config.world_size)
        attempts = _attempt_counter()
        trainer = TorchTrainer(
            _worker, train_loop_config={"config": asdict(config), "attempts": attempts, "timeout": timeout},
            torch_config=TorchConfig(backend="gloo", timeout_s=math.ceil(timeout)),
            scaling_config=ScalingConfig(num_workers=config.world_size, use_gpu=False,
                                         resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="dtlib-train", storage_path=os.path.abspath(storage_path or temporary),
                                 failure_config=FailureConfig(max_failures=max_failures),
                                 checkpoint_config=CheckpointConfig(num_to_keep=config.keep_last)))
        with _environment(_RAY_TRAIN_SETTINGS):  # read by the controller fit() starts
            result = _fit(trainer, timeout)
        with result.checkpoint.as_directory() as directory:
            with open(os.path.join(directory, _SUMMARY)) as f:
                summary = json.load(f)
        starts = ray.get(attempts.starts.remote())[0]
        return {**summary, "launcher": "ray", "attempts": starts, "restarts": starts - 1}
    except TimeoutError:
        started = True  # a run past its deadline is stopped with everything Ray runs
        raise
    finally:
        if started:
            ray.shutdown()
            if token is not None:  # workers and agents exit on their own soon after; now, for sure
                _kill_session(token)
            if ray_root is not None:  # the session's logs and sockets, once nothing writes them
                shutil.rmtree(ray_root, ignore_errors=True)
        elif attempts is not None:  # a Ray session of the caller's: leave nothing of this run in it
            ray.kill(attempts)
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)


def _start_ray(num_cpus: int) -> tuple[str, str]:
    """``ray.init`` with the settings above, in a temporary directory of its own; returns the token
    that marks every process of this Ray and that directory (the caller removes it after
    ``ray.shutdown``). The token marks every process of this Ray (an environment variable its GCS and
    raylet inherit and pass on to every worker and agent,
    whatever they rename themselves to, and wherever they are re-parented), so that
    :func:`_kill_session` can end them all. Ray gives its raylet 30 s to register with the GCS
    (``raylet_start_wait_time_s`` in ray/_private/node.py, not configurable), which an overloaded
    machine can miss, and a failed ``ray.init`` leaves what it started running: that is killed and
    the start is tried once more."""
    import ray

    token = uuid.uuid4().hex
    root = tempfile.mkdtemp(prefix="dtlib-ray-session-", dir=_RAY_ROOT if os.path.isdir(_RAY_ROOT) else None)
    for attempt in (1, 2):
        try:
            with _environment({_SESSION_VARIABLE: token}):
                # "local": a new instance of our own. Without an address ray.init joins whatever Ray
                # already runs on the machine (RAY_ADDRESS, or the newest GCS it finds), which a
                # run that shuts its Ray down afterwards must not do.
                ray.init(address="local", num_cpus=num_cpus, object_store_memory=_OBJECT_STORE_BYTES,
                         include_dashboard=False, _temp_dir=root)
            break
        except Exception:
            ray.shutdown()
            _kill_session(token)
            if attempt == 2:
                shutil.rmtree(root, ignore_errors=True)
                raise
    return token, root


def _kill_session(token: str) -> None:
    """SIGKILL every process (but this one) that carries ``token``: what a Ray start left."""
    import psutil  # a dependency of Ray

    left = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.pid != os.getpid() and proc.environ().get(_SESSION_VARIABLE) == token:
                proc.kill()
                left.append(proc)
    psutil.wait_procs(left, timeout=10)


@contextlib.contextmanager
def _environment(settings: dict[str, str]) -> Iterator[None]:
    """``settings`` in ``os.environ`` for the duration (a value the user set wins), then restored."""
    added = {k: v for k, v in settings.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _fit(trainer: Any, timeout: float) -> Any:
    """``trainer.fit()`` with a deadline: fit blocks the caller, so it runs in a daemon thread
    (which ``ray.shutdown`` then ends) and the caller waits at most ``timeout`` seconds."""
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=fit, name="dtlib-ray-fit", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"the Ray Train run did not finish within timeout={timeout} s: Ray is shut down")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _attempt_counter() -> Any:
    """A Ray actor counting each rank's starts: a rank's n-th start is attempt n - 1, since Ray
    restarts the whole group and every rank starts once per attempt. The class is defined here, not
    at module level, so Ray ships it by value and its process imports neither dtlib nor torch."""
    import ray

    class AttemptCounter:
        def __init__(self) -> None:
            self.counts: dict[int, int] = {}

        def start(self, rank: int) -> int:
            self.counts[rank] = self.counts.get(rank, 0) + 1
            return self.counts[rank] - 1

        def starts(self) -> dict[int, int]:
            return self.counts

    return ray.remote(num_cpus=0)(AttemptCounter).remote()


def _worker(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker: a rank of ``dtlib.trainer.train`` on the process group Ray set up."""
    import ray
    import ray.train
    from ray.train import CheckpointConsistencyMode

    config, timeout = TrainConfig(**loop_config["config"]), loop_config["timeout"]
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    attempt = ray.get(loop_config["attempts"].start.remote(rank))
    # dtlib's drills fire on attempt 0 only (dtlib.resilience.elastic.restart_count): Ray's attempt
    # number in torchrun's variable
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    resumed_from = saved = None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:  # a restart: resume from the dtlib checkpoint Ray's pointer names
        with checkpoint.as_directory() as directory:
            with open(os.path.join(directory, _POINTER)) as f:
                pointer = json.load(f)
        if pointer["step"] is not None:
            config = config.with_(checkpoint_dir=pointer["checkpoint_dir"], resume=True)
            resumed_from = saved = pointer["step"]

    def report(metrics: dict[str, Any], summary: dict[str, Any] | None = None) -> None:
        """Every rank reports (Ray's report is a barrier); rank 0 attaches a pointer to dtlib's
        newest checkpoint (and, at the end, its summary)."""
        if rank != 0:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="dtlib-ray-pointer-") as directory:
            with open(os.path.join(directory, _POINTER), "w") as f:
                json.dump({"checkpoint_dir": config.checkpoint_dir, "step": saved}, f)
            if summary is not None:
                with open(os.path.join(directory, _SUMMARY), "w") as f:
                    json.dump(summary, f)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))

    class ReportSaves(Hook):
        """After the step dtlib's checkpoint hook saved (the same condition), report it to Ray."""

        def after_step(self, run: Any, loss: float, seconds: float) -> None:
            nonlocal saved
            if not config.checkpoint_every or run.step_count % config.checkpoint_every:
                return
            saved = run.step_count
            report({"step": saved, "loss": loss})
            if rank == 0:
                # Ray's controller registers a report when it next polls the workers; a worker dying
                # before that loses it. Wait until it is committed, so a restart after this step
                # resumes from it (as dtlib's own save returns once the checkpoint is published).
                ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED,
                                                       timeout_s=timeout)

    summary = train(rank, world_size, config, extra_hooks=[ReportSaves()])
    if rank != 0:
        report({"step": config.steps})
        return
    losses = summary["losses"]  # none when resumed at the last step
    report({"step": config.steps, **({"loss": losses[-1]} if losses else {})},
           {**summary, "ray_resumed_from": resumed_from})
