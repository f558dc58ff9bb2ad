"""An emitted torchtitan TOML read and built by torchtitan v0.2.2's own code, on the meta device.

torchtitan 0.2.2 (the last release configured by TOML files) is installed without its data
dependencies (``pip install --no-deps torchtitan==0.2.2 tyro``; see docs/frameworks.md). Its
modules import ``tokenizers``, ``datasets`` and ``torchdata`` (the tokenizer and data loader) and
its MoE package imports a Triton kernel for token permutation; none of them runs in these
checks, so where one is not installed an empty module stands in for it while torchtitan imports, and is
removed after (never for a package that is installed, and never ``triton`` itself, which
PyTorch probes; the MoE kernel module, torchtitan's own, stays a stand-in).

:func:`check_torchtitan_job` then uses torchtitan's own pieces:

* ``torchtitan.config.ConfigManager`` parses the TOML into its ``JobConfig`` (unknown sections or
  keys are its error);
* ``get_train_spec(model.name).model_args[model.flavor]``, updated from the job
  (``update_from_config``) and built with the train spec's model class under
  ``torch.device("meta")``: its parameter count is the model the TOML names;
* its pipeline split: the number of stages of ``pipeline_llm`` (distributed/pipeline_parallel.py
  l. 71-115 at v0.2.2, with ``pipeline_parallel_first/last_stage_less_layers``) and
  ``generate_llm_fqn_per_model_part`` itself;
* ``model.converters`` looked up in torchtitan's converter registry
  (``protocols.model_converter``), filled by importing ``components.quantization``.
"""
from __future__ import annotations

import importlib.util
import math
import sys
import tempfile
import types
import warnings
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["TORCHTITAN_VERSION", "import_torchtitan", "parse_job", "build_meta_model", "pipeline_stages",
           "check_converters", "check_torchtitan_job"]

TORCHTITAN_VERSION = "0.2.2"
# modules torchtitan imports whose code these checks never run (tokenizer, data, a Triton kernel)
_UNUSED_HERE = ("tokenizers", "datasets", "datasets.distributed", "torchdata", "torchdata.stateful_dataloader")
_TRITON_KERNEL = "torchtitan.models.moe.kernels"


class _Absent(types.ModuleType):
    """An uninstalled module torchtitan imports but these checks never call: any name is a class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *a, **k: None})


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@cache
def import_torchtitan() -> types.ModuleType:
    """``torchtitan`` at :data:`TORCHTITAN_VERSION` with every module these checks use imported
    (config, train specs of all its models, quantization converters, pipeline split); the empty
    stand-ins (see the module docstring) are in ``sys.modules`` only while it imports."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torchtitan")
    except PackageNotFoundError:
        raise ImportError(f"torchtitan is not installed: pip install --no-deps torchtitan=={TORCHTITAN_VERSION} "
                          f"tyro") from None
    if found != TORCHTITAN_VERSION:
        raise ImportError(f"torchtitan {found} is installed; these checks read {TORCHTITAN_VERSION}")
    stand_ins = [name for name in _UNUSED_HERE if name not in sys.modules and not _installed(name.split(".")[0])]
    if _TRITON_KERNEL not in sys.modules and not _installed("triton"):
        stand_ins.append(_TRITON_KERNEL)
    for name in stand_ins:
        stub = _Absent(name)
        stub.__path__ = []
        sys.modules[name] = stub
    try:
        import torchtitan
        import torchtitan.components.quantization  # noqa: F401  (registers its converters)
        import torchtitan.config  # noqa: F401
        import torchtitan.distributed.pipeline_parallel  # noqa: F401
        from torchtitan.models import _supported_models
        from torchtitan.protocols.train_spec import get_train_spec

        for name in _supported_models:  # the LLM families; flux (diffusion) needs transformers
            try:
                get_train_spec(name)
            except ImportError:
                pass
    finally:
        for name in stand_ins:
            if name != _TRITON_KERNEL:  # torchtitan's own module: it stays, as torchtitan imported it
                sys.modules.pop(name, None)
    return torchtitan


def parse_job(text: str) -> Any:
    """torchtitan's ``JobConfig`` of a TOML document, parsed by its ``ConfigManager``."""
    import_torchtitan()
    from torchtitan.config import ConfigManager

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "job.toml"
        path.write_text(text)
        try:
            return ConfigManager().parse_args(["--job.config_file", str(path)])
        except (ValueError, TypeError) as exc:
            raise ValueError(f"torchtitan's ConfigManager refuses the TOML: {str(exc).splitlines()[0]}") from None


def build_meta_model(job: Any) -> tuple[Any, Any]:
    """``(model_args, model)``: the train spec's args of ``model.flavor``, updated from the job, and
    its model class built on the meta device."""
    import torch

    import_torchtitan()
    from torchtitan.protocols.train_spec import get_train_spec

    try:
        spec = get_train_spec(job.model.name)
    except ValueError as exc:
        raise ValueError(f"[model] name = {job.model.name!r}: {exc}") from None
    if job.model.flavor not in spec.model_args:
        raise ValueError(f"[model] flavor = {job.model.flavor!r} is not a torchtitan {job.model.name} flavor; "
                         f"registered: {', '.join(spec.model_args)}")
    args = spec.model_args[job.model.flavor]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args.update_from_config(job)
        with torch.device("meta"):
            model = spec.model_cls(args)
    return args, model


def pipeline_stages(job: Any, model_args: Any) -> list[list[str]]:
    """The module names of each pipeline stage torchtitan makes of the job (``pipeline_llm``'s
    stage count, then ``generate_llm_fqn_per_model_part``); raises its refusal as ``ValueError``."""
    import_torchtitan()
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    par = job.parallelism
    pp, layers = par.pipeline_parallel_degree, model_args.n_layers
    first, last = par.pipeline_parallel_first_stage_less_layers, par.pipeline_parallel_last_stage_less_layers
    single = issubclass(get_schedule_class(par.pipeline_parallel_schedule), PipelineScheduleSingle)
    if par.pipeline_parallel_layers_per_stage is not None:  # pipeline_parallel.py l. 71-108
        per_stage = par.pipeline_parallel_layers_per_stage
        stages = math.ceil((layers + first + last) / per_stage)
        if stages % pp:
            raise ValueError(f"torchtitan makes {stages} stages of {layers} layers + {first} (first_stage_less_layers)"
                             f" + {last} (last_stage_less_layers) at layers_per_stage {per_stage}: not divisible by "
                             f"pipeline_parallel_degree {pp}")
        if single != (stages // pp == 1):
            raise ValueError(f"{par.pipeline_parallel_schedule} needs {'one stage' if single else 'two or more stages'}"
                             f" per rank; torchtitan makes {stages // pp}")
    else:  # l. 110-115: one stage per rank, or two for a multi-stage schedule
        stages = pp * (1 if single else 2)
    return generate_llm_fqn_per_model_part(stages, layers, first, last)


def check_converters(job: Any) -> None:
    """Every ``[model] converters`` name registered by torchtitan's quantization components."""
    import_torchtitan()  # which registers the quantization converters
    from torchtitan.protocols.model_converter import _registry_model_converter_cls

    for name in job.model.converters:
        if name not in _registry_model_converter_cls:
            raise ValueError(f"[model] converters: {name!r} is not a torchtitan converter; registered: "
                             f"{', '.join(sorted(_registry_model_converter_cls))}")


def check_torchtitan_job(text: str) -> dict[str, Any]:
    """The TOML parsed, its model built on meta, its pipeline split and converters checked, all by
    torchtitan's code: ``{"job", "model_args", "parameters", "stages"}``."""
    job = parse_job(text)
    check_converters(job)
    model_args, model = build_meta_model(job)
    stages = pipeline_stages(job, model_args) if job.parallelism.pipeline_parallel_degree > 1 else []
    return {"job": job, "model_args": model_args, "parameters": sum(p.numel() for p in model.parameters()),
            "stages": stages}
