"""The real frameworks, run side by side with dtlib on the same small model.

One module per framework, each the glue that runs a small model under that framework on CPU
ranks (gloo, host devices) and returns a :class:`~dtlib.frameworks.common.FrameworkRun` -- losses,
full (gathered) final parameters, per-rank memory and collective counts -- in the same shape as
dtlib's own runs, so a lesson and a test can put them next to each other:

* :mod:`dtlib.frameworks.deepspeed_zero` - DeepSpeed ZeRO 1-3 and CPU optimizer offload;
* :mod:`dtlib.frameworks.megatron_core` - Megatron-Core's tensor-parallel layers, ``GPTModel``
  and pipeline schedules;
* :mod:`dtlib.frameworks.jax_gspmd` - JAX/XLA automatic sharding over a device mesh;
* :mod:`dtlib.frameworks.ray_train` - Ray Train's ``TorchTrainer`` running ``dtlib train``.

Each framework is imported only inside these modules' functions, so ``import dtlib`` never needs
them. The CPU shims a framework needs live in its module, each with its reason, and are applied
only on a machine without GPUs.
"""
