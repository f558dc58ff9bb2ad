"""The full-size rehearsal's table in docs/rehearse.md: Llama 3 8B and 70B under FSDP2 (+ TP, SP)
as torchtitan applies them, one rank's peak from PyTorch's FSDPMemTracker beside ``dtlib memory``,
term by term, and the seconds each measurement takes on this CPU.

    python benchmarks/bench_fullsize.py            # the three layouts of the table
    python benchmarks/bench_fullsize.py llama3-8b  # one preset's rows
"""
from __future__ import annotations

import sys

from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.frameworks.fullsize import fullsize_lines, rehearse_full_size

# micro-batch 1 of each preset's sequence (8,192 tokens), as torchtitan's llama3 TOMLs train
LAYOUTS = (("llama3-8b", Parallelism(dp=8, zero=3)),
           ("llama3-8b", Parallelism(dp=4, tp=2, zero=3, sequence_parallel=True)),
           ("llama3-70b", Parallelism(dp=8, tp=8, zero=3, sequence_parallel=True)))


def main(names: list[str]) -> None:
    for name, layout in LAYOUTS:
        if not names or name in names:
            print("\n".join(fullsize_lines(rehearse_full_size(get_preset(name), layout))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
