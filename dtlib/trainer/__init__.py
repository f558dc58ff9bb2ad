"""One trainer for every layout: TinyGPT on a rank grid (DP/ZeRO/FSDP x TP/SP x PP x CP x EP).

In pieces, one concept each:

* :mod:`~dtlib.trainer.config` -- :class:`TrainConfig`, every option, and its refusals;
* :mod:`~dtlib.trainer.rank` -- one rank's parallel model, optimizer and step (how the layouts
  compose, and why the result equals single-process training);
* :mod:`~dtlib.trainer.hooks` -- what runs around each step (fault drill, monitor, sample log,
  progress) behind one small interface;
* :mod:`~dtlib.trainer.checkpoints` -- saves, the resume and :func:`check_resume`;
* :mod:`~dtlib.trainer.loop` -- :func:`train` and :func:`run`.

Started three ways with the same :func:`train`: ``dtlib.launch(train, n, args=(config,))`` from a
notebook, ``dtlib train ...`` (which launches the ranks itself), and
``torchrun --nproc-per-node G -m dtlib train ...`` on one or several nodes (:mod:`dtlib.cli.train`
parses the flags).
"""
from __future__ import annotations

from dtlib.extras import require

require("course", "torch", feature=__name__)

from dtlib.trainer.checkpoints import check_resume
from dtlib.trainer.config import OPTIMIZERS, SCHEDULES, TrainConfig
from dtlib.trainer.loop import run, train
from dtlib.trainer.rank import _Run, params_sha256  # _Run: benchmarks/bench_train.py drives its step

__all__ = ["TrainConfig", "train", "run", "check_resume", "params_sha256", "SCHEDULES", "OPTIMIZERS"]
