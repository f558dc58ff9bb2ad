"""The planner: joins the analytic core (memory, FLOPs, communication) into a step-time model, a
search over layouts, a training plan and a cluster topology. Pure arithmetic on numpy arrays.

* :mod:`~dtlib.plan.gemm` - compute time from GEMM shapes (tile/wave quantization, roofline, FlashAttention, power cap);
* :mod:`~dtlib.plan.eager` - the HBM traffic of eager PyTorch's memory-bound operators;
* :mod:`~dtlib.plan.calibration` - the two global fitted efficiencies, and where they come from;
* :mod:`~dtlib.plan.steptime` - one step's time as a breakdown that sums to it, every term sourced;
* :mod:`~dtlib.plan.search` - every valid, fitting layout, ranked by step time at equal global batch;
* :mod:`~dtlib.plan.training` - days, GPU-hours, cost, energy, failures, checkpoints, goodput;
* :mod:`~dtlib.plan.topology` - fat-tree and rail-optimised fabrics, oversubscription;
* :mod:`~dtlib.plan.published` - the published runs (data: model, cluster, layout, stack, metric, source and link);
* :mod:`~dtlib.plan.validation` - those runs against the planner's predictions, the fit, leave-one-source-out;
* :mod:`~dtlib.plan.uncertainty` - every prediction's error band from the held-out residuals of comparable runs;
* :mod:`~dtlib.plan.residuals` - those residuals, stored (``data/residuals.json``) and checked against the model.
"""
