"""The real frameworks, run side by side with dtlib on the same small model.

One module per framework, each the glue that runs a small model under that framework on CPU
ranks (gloo, host devices) and returns a :class:`~dtlib.frameworks.common.FrameworkRun` -- losses,
full (gathered) final parameters, per-rank memory and collective counts -- in the same shape as
dtlib's own runs, so a lesson and a test can put them next to each other:

* :mod:`dtlib.frameworks.deepspeed_zero` - DeepSpeed ZeRO 1-3 and CPU optimizer offload (its
  JSON config's rules in :mod:`~dtlib.frameworks.deepspeed_config`);
* :mod:`dtlib.frameworks.megatron_core` - Megatron-Core's ``GPTModel`` and pipeline schedules
  (Megatron-LM's flags in :mod:`~dtlib.frameworks.megatron_flags`, the column/row-parallel layers
  next to dtlib's in :mod:`~dtlib.frameworks.megatron_layers`, the CPU shims in
  :mod:`~dtlib.frameworks.megatron_cpu`);
* :mod:`dtlib.frameworks.jax_gspmd` - JAX/XLA automatic sharding over a device mesh (the model
  and step run in a subprocess: :mod:`~dtlib.frameworks.jax_worker`);
* :mod:`dtlib.frameworks.ray_train` - Ray Train's ``TorchTrainer`` running ``dtlib train``;
* :mod:`dtlib.frameworks.configs` - each config :mod:`dtlib.plan.emit` writes, checked by the
  framework's own config classes: Megatron-LM's argument list recorded from its parser
  (:mod:`~dtlib.frameworks.megatron_args`), Megatron-Core's ``GPTModel`` of the flags built on the
  meta device for one rank of a fake world (:mod:`~dtlib.frameworks.megatron_meta`), torchtitan
  0.2.2's config, model and pipeline code (:mod:`~dtlib.frameworks.torchtitan_check`);
  :mod:`dtlib.frameworks.rehearse` - a planned layout shrunk and
  run under the framework, compared with one process (``dtlib plan --emit F --rehearse``).

Each framework is imported only inside these modules' functions, so ``import dtlib`` never needs
them. The CPU shims a framework needs live in its module, each with its reason, and are applied
only on a machine without GPUs.
"""
