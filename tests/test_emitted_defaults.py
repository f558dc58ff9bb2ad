"""Lesson 13 §4's helpers: the flags of an emitted config that differ from Megatron-LM's recorded
defaults, and dtlib's parameters per rank beside Megatron-Core's meta-device count."""
import pytest

from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.experiments.emitted_defaults import dtlib_parameters_per_rank, off_default
from dtlib.experiments.framework_notices import split_notices


def test_off_default_names_what_a_shorter_config_would_change():
    flags = ["--rotary-base", "500000", "--hidden-dropout", "0", "--attention-dropout", "0.1",
             "--moe-token-dispatcher-type", "alltoall", "--swiglu"]
    got = off_default(flags)
    assert got["--rotary-base"] == (500000, 10000)  # Megatron-LM's defaults, recorded at core_v0.16.1
    assert got["--hidden-dropout"] == (0.0, 0.1)
    assert "--attention-dropout" not in got  # written, but equal to the default
    assert got["--moe-token-dispatcher-type"] == ("alltoall", "allgather")
    assert got["--swiglu"] == (True, False)
    assert list(off_default(flags, only=("--swiglu",))) == ["--swiglu"]


def test_dtlib_parameters_per_rank_pads_the_vocabulary_as_megatron():
    model = get_preset("llama3-8b")
    whole = dtlib_parameters_per_rank(model, Parallelism(dp=8))
    assert whole == 8_030_261_248  # Llama 3 8B; 128,256 is a multiple of 128
    tp8 = dtlib_parameters_per_rank(model, Parallelism(tp=8))
    assert tp8 > whole // 8  # norms replicated, vocabulary padded to a multiple of 1,024
    with pytest.raises(ValueError, match="stage must be"):
        dtlib_parameters_per_rank(model, Parallelism(dp=8), stage="middle")


def test_notices_are_split_from_other_stderr():
    text = ("/usr/bin/ld: cannot find -laio: No such file or directory\ncollect2: error: ld returned 1 exit status\n"
            "[2026-11-29] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.\n"
            "x.py:24: UserWarning: Transformer Engine and Apex are not installed. Falling back\n"
            "  warnings.warn(\n\nTraceback (most recent call last):\nValueError: a real error\n")
    notices, other = split_notices(text)
    assert len(notices) == 5
    assert other == ["Traceback (most recent call last):", "ValueError: a real error"]
