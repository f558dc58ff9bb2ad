"""A planned layout, shrunk to TinyGPT on a few CPU ranks, trained and compared with one process.

The planner (:mod:`dtlib.plan`) picks a layout for 128 GPUs; before paying for them, the same
combination of parallelisms can run here, small, through the trainer (:mod:`dtlib.trainer`), and
must give single-process training's numbers. Megatron-LM's and torchtitan's users do the same
with a few-GPU "smoke test" of their config before the full job.

* :func:`~dtlib.trainer.shrink.shrink_layout` - the planner's
  :class:`~dtlib.analytic.layout.Parallelism` as a :class:`~dtlib.trainer.TrainConfig` of TinyGPT
  on at most ``max_ranks`` ranks, and what changed and why (its rules are in
  :mod:`dtlib.trainer.shrink`);
* :func:`train_command` - the ``dtlib train ...`` command line of a config, built from the parser;
* :func:`train_shrunk` - shrink, train on the ranks and on one process, compare.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Sequence

from dtlib.analytic.layout import Parallelism
from dtlib.experiments.parallel3d import compare_with_single_process
from dtlib.trainer import TrainConfig
from dtlib.trainer.shrink import DROP_ORDER, SIZE, TINY, shrink_layout

__all__ = ["TINY", "SIZE", "DROP_ORDER", "shrink_layout", "train_command", "train_shrunk"]


# flags first that describe the layout, in the order a reader scans them
_LAYOUT_FIRST = ("dp", "tp", "pp", "cp", "ep", "zero", "sequence_parallel", "schedule", "virtual_stages",
                 "micro_batch_size", "num_microbatches", "recompute")


def train_command(config: TrainConfig) -> str:
    """The ``dtlib train`` command line that runs ``config``: ``--dp`` and ``--microbatches``
    always, every other option where it differs from :class:`TrainConfig`'s default. Flag names
    come from the command's own parser, so they follow it."""
    from dtlib.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    flags = {a.dest: a for a in sub.choices["train"]._actions if a.option_strings}
    default = TrainConfig()
    names = list(_LAYOUT_FIRST) + [f.name for f in fields(TrainConfig) if f.name not in _LAYOUT_FIRST]
    words = ["dtlib", "train"]
    for name in names:
        value = getattr(config, name)
        if value == getattr(default, name) and name not in ("dp", "num_microbatches"):
            continue
        if name not in flags:
            raise ValueError(f"{name}={value!r} has no 'dtlib train' flag")
        flag = flags[name].option_strings[-1]
        if flags[name].nargs == 0:  # a switch: store_true
            words += [flag] if value else []
        else:
            words += [flag, str(value)]
    return " ".join(words)


def train_shrunk(layout: Parallelism, max_ranks: int = 8, timeout: float = 120.0,
                 drop_order: Sequence[str] = DROP_ORDER) -> dict[str, Any]:
    """Shrink ``layout`` (:func:`shrink_layout`), train it on its ranks and on one process
    (:func:`~dtlib.experiments.parallel3d.compare_with_single_process`). Returns the comparison
    plus ``config``, ``lines`` and ``command``."""
    config, lines = shrink_layout(layout, max_ranks, drop_order)
    return {"config": config, "lines": lines, "command": train_command(config),
            **compare_with_single_process(config, timeout=timeout)}
