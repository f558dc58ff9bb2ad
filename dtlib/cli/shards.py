"""``dtlib shards OUT``: write a text as streaming shards for ``dtlib train --data OUT``
(:func:`dtlib.streaming.write_shards`)."""
from __future__ import annotations

import argparse
import os
from typing import Any

from dtlib.cli.args import emit, positive_int
from dtlib.outputs import check_output_dir

__all__ = ["add_shards_command"]


def add_shards_command(sub: Any) -> None:
    p = sub.add_parser("shards", help="write a text as token shards for dtlib train --data",
                       description="Cut a text (byte tokens; default: the bundled Coriolanus) into samples of "
                                   "seq + 1 tokens and write them as .npy shards with an index.json.")
    p.add_argument("out", help="the shard directory to write")
    p.add_argument("--seq", type=positive_int, default=32, help="sequence length (dtlib train --seq)")
    p.add_argument("--samples-per-shard", type=positive_int, default=256)
    p.add_argument("--text", metavar="FILE", help="a file to read as bytes (default: the bundled text)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_run_shards)


def _run_shards(args: argparse.Namespace) -> int:
    import numpy as np

    from dtlib.streaming import write_shards
    check_output_dir("OUT", args.out)
    if args.text is not None:
        if not os.path.isfile(args.text):
            raise ValueError(f"--text {args.text}: " + ("a directory, not a file" if os.path.isdir(args.text)
                                                      else "no such file"))
        with open(args.text, "rb") as f:
            tokens = np.frombuffer(f.read(), dtype=np.uint8)
    else:
        from dtlib.corpus import load_tokens
        tokens = load_tokens().numpy()
    index = write_shards(args.out, tokens, args.seq, args.samples_per_shard)
    data = {"directory": args.out, "samples": index["samples"], "shards": len(index["shards"]), "seq": args.seq}
    return emit(args, data, f"wrote {index['samples']} samples of {args.seq + 1} tokens in {len(index['shards'])} "
                            f"shards to {args.out}; train on them with: dtlib train --data {args.out} --seq {args.seq}")
