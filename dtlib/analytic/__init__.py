"""The analytic core: numbers in, numbers out. No processes, no ``torch.distributed``.

* :mod:`~dtlib.analytic.units` - KiB/MiB/GiB, GB, formatting;
* :mod:`~dtlib.analytic.hardware` - accelerators, links, clusters (datasheet numbers, sourced);
* :mod:`~dtlib.analytic.precision` - bytes per parameter of each mixed-precision convention;
* :mod:`~dtlib.analytic.config` / :mod:`~dtlib.analytic.presets` - a transformer's shape;
* :mod:`~dtlib.analytic.layout` - a parallel layout (dp, tp, pp, cp, ep, ZeRO, schedule) and
  the rules that make one valid;
* :mod:`~dtlib.analytic.activations`, :mod:`~dtlib.analytic.memory` - memory per GPU;
* :mod:`~dtlib.analytic.stacks` - what each software stack (Megatron-Core, torchtitan, DeepSpeed,
  FSDP) overlaps, fuses and stores, each default cited;
* :mod:`~dtlib.analytic.flops` - FLOPs, MFU and HFU;
* :mod:`~dtlib.analytic.comm` - the alpha-beta cost of collectives and per-strategy volumes;
* :mod:`~dtlib.analytic.vectorised` - the same formulas over numpy arrays of layouts;
* :mod:`~dtlib.analytic.validate` - the checks every public function runs on its arguments;
* :mod:`~dtlib.analytic.timing` - how a measurement's repeats become one figure (min, median, mean);
* :mod:`~dtlib.analytic.reliability` - job MTBF, Young/Daly checkpoint interval, goodput.

The planner (``dtlib.plan``) joins them into step times and training plans. The runtime
(``dtlib.launcher``, ``dtlib.parallel``, ``dtlib.models``) and the course layer (``dtlib.experiments``,
``dtlib.viz``, ``dtlib.widgets``, ``dtlib.grading``) build on it.
"""
