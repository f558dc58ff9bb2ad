"""Bad numbers never become NaN, infinity or a negative size (issue 9, item 7).

Each row of the table went through silently on the old code (a NaN or negative result, a raw
OverflowError, a division by zero, 'no' read as True). Every one now gives one line that names the
argument (Python) or the flag (command line) and the valid range; the command line exits 2.
"""
import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest

from dtlib.analytic import validate
from dtlib.analytic.comm import bubble_fraction, bytes_sent_per_rank, collective_time, comm_report
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.flops import flops_report, utilization
from dtlib.analytic.layout import Parallelism, in_flight
from dtlib.analytic.memory import memory_per_gpu
from dtlib.analytic.precision import Precision
from dtlib.analytic.presets import get_preset
from dtlib.analytic.vectorised import flops_batch, memory_batch
from dtlib.cli import main
from dtlib.parallel.buckets import shard_bounds
from dtlib.profile import profile_steps

NAN, INF = float("nan"), float("inf")
LLAMA = get_preset("llama3-8b")

API = {
    "params nan": (lambda: memory_per_gpu(NAN), "params must be a finite number > 0, got nan"),
    "params inf": (lambda: memory_per_gpu(1e999), "params must be a finite number > 0, got inf"),
    "overhead inf": (lambda: memory_per_gpu(7e9, overhead_bytes=INF),
                     "overhead_bytes must be a finite number >= 0, got inf"),
    "largest layer nan": (lambda: memory_per_gpu(7e9, Parallelism(zero=3), largest_layer_params=NAN),
                          "largest_layer_params must be a finite number >= 0, got nan"),
    "dropout 'no'": (lambda: memory_per_gpu(LLAMA, dropout="no"), "dropout must be True or False, got 'no'"),
    "comm bytes inf": (lambda: comm_report("all_reduce", INF, 8, "nvlink4"),
                       "nbytes must be a finite number > 0, got inf"),
    "batch params -1": (lambda: memory_batch(params=[-1, 0, NAN]),
                        r"configuration \(0,\): params must be a finite number > 0, got -1.0"),
    "batch params 0": (lambda: memory_batch(params=[1e9, 0]),
                       r"configuration \(1,\): params must be a finite number > 0, got 0.0"),
    "batch params nan": (lambda: memory_batch(params=[NAN]),
                         r"configuration \(0,\): params must be a finite number > 0, got nan"),
    "batch dp 2.5": (lambda: memory_batch(LLAMA, dp=[1, 2.5]),
                     r"configuration \(1,\): dp must be an integer >= 1, got 2.5"),
    "batch overhead nan": (lambda: memory_batch(params=[7e9], overhead_bytes=NAN),
                           "overhead_bytes must be a finite number >= 0, got nan"),
    "flops batch gpus 0": (lambda: flops_batch(LLAMA, batch=8, step_time=1.0, gpus=[8, 0]),
                           "gpus must be an integer >= 1, got 0"),
    "step_time 0": (lambda: utilization(1e15, 0, 8, "h100-sxm"), "step_time must be a finite number > 0, got 0"),
    "gpus -1": (lambda: utilization(1e15, 1.0, -1, "h100-sxm"), "gpus must be an integer >= 1, got -1"),
    "MFU > 100%": (lambda: flops_report(LLAMA, 8, gpus=8, step_time=0.001),
                   r"step_time must be at least 0.4795 s .*an MFU of 47,946 %; impossible on this hardware"),
    "ranks 0": (lambda: bytes_sent_per_rank("all_reduce", 1e9, 0), "ranks must be an integer >= 1, got 0"),
    "pp 0": (lambda: bubble_fraction(0, 4), "pp must be an integer >= 1, got 0"),
    "interleaved v=1": (lambda: bubble_fraction(4, 8, 1, "interleaved"),
                        "the interleaved schedule needs virtual_stages >= 2, got 1"),
    "interleaved m % pp": (lambda: bubble_fraction(4, 6, 2, "interleaved"),
                           r"num_microbatches \(6\) to be a multiple of pp=4"),
    "nbytes nan": (lambda: collective_time("all_reduce", NAN, 8, "nvlink4"),
                   "nbytes must be a finite number >= 0, got nan"),
    "shard_size 2.0": (lambda: Parallelism(dp=2, shard_size=2.0), "shard_size must be an integer >= 1, got 2.0"),
    "sequence_parallel 'no'": (lambda: Parallelism(tp=2, sequence_parallel="no"),
                               "sequence_parallel must be True or False, got 'no'"),
    "zero True": (lambda: Parallelism(zero=True), "zero must be an integer from 0 to 3, got True"),
    "negative bytes per param": (lambda: Precision("mine", param=-2, grad=2, master=4, grad_copy=0,
                                                   states=8, activation=2),
                                 "param must be a finite number >= 0, got -2"),
    "states nan": (lambda: Precision("mine", 2, 2, 4, 0, NAN, 2), "states must be a finite number >= 0, got nan"),
    "bias 'no'": (lambda: TransformerConfig(layers=2, hidden=64, heads=4, vocab=100, seq=16, bias="no"),
                  "bias must be True or False, got 'no'"),
    # the runtime uses the same checks
    "shard_bounds world 0": (lambda: shard_bounds(10, 0), "world_size must be an integer >= 1, got 0"),
    "shard_bounds numel -1": (lambda: shard_bounds(-1, 2), "numel must be an integer >= 0, got -1"),
    "profile warmup 0": (lambda: profile_steps(lambda: None, steps=2, warmup=0),
                         "warmup must be an integer >= 1, got 0"),
    # past int64 numpy raised OverflowError; between 2**53 and 2**63 the sums wrapped to negative bytes
    "layers 10**20": (lambda: TransformerConfig(layers=10 ** 20, hidden=64, heads=4, vocab=100, seq=16),
                      r"layers must be an integer >= 1 and <= 2\*\*53 = 9007199254740992, got an integer of 21 digits"),
    "ranks 2**63 - 1": (lambda: bytes_sent_per_rank("all_reduce", 1e9, 2 ** 63 - 1),
                        r"ranks must be an integer >= 1 and <= 2\*\*53 = 9007199254740992, got 9223372036854775807"),
}


@pytest.mark.parametrize("call,message", API.values(), ids=API.keys())
def test_python_api_names_the_argument_and_the_range(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


def test_bucket_size_inf_is_a_clear_error_not_an_overflow():
    torch = pytest.importorskip("torch")
    from dtlib.parallel.ddp import BucketedDDP

    with pytest.raises(ValueError, match="bucket_size_mb must be a finite number > 0, got inf"):
        BucketedDDP(torch.nn.Linear(2, 2), bucket_size_mb=INF)


def test_bubble_fraction_rejects_exactly_what_in_flight_rejects():
    """One set of rules (dtlib.analytic.layout.RULES): the same layouts, the same message."""
    with pytest.raises(ValueError) as a:
        bubble_fraction(4, 8, 1, "interleaved")
    with pytest.raises(ValueError) as b:
        in_flight("interleaved", 4, 8, 1)
    assert str(a.value) == str(b.value)
    assert bubble_fraction(4, 8, 2, "interleaved") == 3 / 16  # Narayanan et al. 2021, Sec. 2.2


def test_invalid_rows_come_back_as_nan_never_negative():
    out = memory_batch(params=[7e9, -1, 0, NAN], on_invalid="nan")
    assert out["valid"].tolist() == [True, False, False, False]
    assert out["total"][0] == 16 * 7e9 and np.isnan(out["total"][1:]).all()


CLI = {
    "params 1e999": (["memory", "--params", "1e999"], "--params must be a finite number > 0, got '1e999'"),
    "params -7B": (["memory", "--params", "-7B"], "--params must be a finite number > 0, got '-7B'"),
    "params nan": (["memory", "--params", "nan"], "argument --params: cannot read 'nan'; write e.g. 7e9"),
    "overhead 1e999": (["memory", "--params", "7B", "--overhead", "1e999"],
                       "--overhead must be a finite number >= 0, got '1e999'"),
    "largest layer 1e999": (["memory", "--params", "7B", "--zero", "3", "--largest-layer", "1e999"],
                            "--largest-layer must be a finite number >= 0"),
    "bytes 1e999": (["comm", "--bytes", "1e999", "--ranks", "8"], "--bytes must be a finite number >= 0, got '1e999'"),
    "bytes -1GB": (["comm", "--bytes", "-1GB", "--ranks", "8"], "--bytes must be a finite number >= 0, got '-1GB'"),
    "bytes 0": (["comm", "--bytes", "0", "--ranks", "8"], "--bytes must be a finite number > 0, got 0"),
    "ranks 0": (["comm", "--bytes", "1GB", "--ranks", "0"], "--ranks must be an integer >= 1, got '0'"),
    "step time 0": (["flops", "llama3-8b", "--step-time", "0"], "--step-time must be a finite number > 0, got '0'"),
    "step time inf": (["flops", "llama3-8b", "--step-time", "inf"], "--step-time must be a finite number > 0"),
    "step time -1": (["flops", "llama3-8b", "--step-time", "-1"], "--step-time must be a finite number > 0, got '-1'"),
    "MFU > 100%": (["flops", "--model", "llama3-8b", "--gpus", "8", "--step-time", "0.001"],
                   r"--step-time must be at least 0.515 s .*impossible on this hardware"),
    "gpus -8": (["memory", "llama3-8b", "--gpus", "-8"], "--gpus must be an integer >= 1, got '-8'"),
    "tp 2.0": (["memory", "llama3-8b", "--tp", "2.0"], "--tp must be an integer >= 1, got '2.0'"),
    "microbatches -2": (["memory", "llama3-8b", "--microbatches", "-2"],
                        "--microbatches must be an integer >= 1, got '-2'"),
    "micro-batch 0": (["memory", "llama3-8b", "--micro-batch", "0"], "--micro-batch must be an integer >= 1, got '0'"),
    "seq -1": (["flops", "llama3-8b", "--seq", "-1"], "--seq must be an integer >= 1, got '-1'"),
    "seq 10**20": (["flops", "llama3-8b", "--seq", "1" + "0" * 20],
                   r"--seq must be an integer >= 1 and <= 2\*\*53 = 9007199254740992, got '1000"),
    "mtp-layers 2**63 - 1": (["memory", "llama3-8b", "--mtp-layers", str(2 ** 63 - 1)],
                             r"--mtp-layers must be an integer >= 0 and <= 2\*\*53"),
    "gpus 10**20": (["plan", "llama3-8b", "--global-batch", "64", "--gpus", "1" + "0" * 20],
                    r"--gpus must be an integer >= 1 and <= 2\*\*53"),
}


@pytest.mark.parametrize("argv,message", CLI.values(), ids=CLI.keys())
def test_command_line_names_the_flag_and_exits_2(capsys, argv, message):
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("dtlib: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not re.search(r"\bnan\b.*GiB|inf GiB|Traceback", err)


def test_the_command_itself_exits_2_without_a_traceback():
    r = subprocess.run([sys.executable, "-m", "dtlib.cli", "memory", "--params", "1e999", "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("dtlib: error: --params must be a finite number > 0, got '1e999' "
                                "(see 'dtlib memory --help')")


def _no_constants(name):
    raise AssertionError(f"JSON output contains {name}")


@pytest.mark.parametrize("argv", [
    ["memory", "--params", "1e30", "--json"],
    ["memory", "llama3-8b", "--zero", "3", "--gpus", "8", "--json"],
    ["comm", "--bytes", "1e30", "--ranks", "16", "--json"],
    ["flops", "--params", "1e30", "--seq", "2048", "--json"],
])
def test_json_output_is_strict_json(capsys, argv):
    """No NaN or Infinity (which json.loads accepts by default but JSON does not have)."""
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out, parse_constant=_no_constants)
    assert data


def test_validate_messages_share_one_wording():
    assert str(validate.InvalidArgument("params", validate.requirement(minimum=0, exclusive=True), NAN)) == \
        "params must be a finite number > 0, got nan"
    assert validate.integer("dp", np.int64(4)) == 4 and validate.number("x", 3) == 3.0
    assert validate.boolean("flag", np.bool_(True)) is True
    for bad in (True, 2.0, "2", None, 0, -(10 ** 400)):
        with pytest.raises(validate.InvalidArgument, match="dp must be an integer >= 1"):
            validate.integer("dp", bad)
    for bad in (NAN, INF, -INF, True, "1", 10 ** 400):
        with pytest.raises(validate.InvalidArgument, match="x must be a finite number > 0"):
            validate.number("x", bad)
    assert math.isclose(validate.number("timeout", 604800, maximum=604800), 604800)
    with pytest.raises(validate.InvalidArgument, match="timeout must be a finite number > 0 and <= 604800"):
        validate.number("timeout", 604801, maximum=604800)


def test_divisor_lists_the_valid_sizes():
    assert validate.divisor("node_size", np.int64(2), 4, "the world size") == 2
    for bad in (3, 0, -2, 8, True, 2.0, "2"):
        with pytest.raises(validate.InvalidArgument,
                           match=r"^node_size must be a divisor of the world size 4 \(1, 2, 4\), got "):
            validate.divisor("node_size", bad, 4, "the world size")
    assert validate.divisors(12) == "1, 2, 3, 4, 6, 12"
    assert validate.divisors(720720, limit=3) == "1, 2, 3, ..."


def test_divisors_of_is_every_divisor_in_order_up_to_two_to_the_53():
    for n in range(1, 1500):
        assert validate.divisors_of(n) == [d for d in range(1, n + 1) if n % d == 0]
    assert validate.divisors_of(2 ** 53) == [2 ** k for k in range(54)]
    assert validate.divisors_of(10 ** 15 + 37) == [1, 10 ** 15 + 37]  # a prime: its square root is scanned
    assert validate.divisors(10 ** 30) == "the divisors of " + "1" + "0" * 30  # a product of sizes, in a message


@pytest.mark.parametrize("argv, message", [
    # a loop to n listed these divisors: a prime sequence length of a billion took minutes to refuse
    (["memory", "llama3-8b", "--seq", "1000000007", "--cp", "2"], "valid cp: 1, 1000000007"),
    # and the planner's candidate degrees: 2**53 GPUs never finished
    (["plan", "llama3-8b", "--global-batch", "64", "--gpus", str(2 ** 53)],
     "no valid layout of llama3-8b on 9007199254740992 GPUs at global batch 64"),
])
def test_huge_sizes_are_answered_in_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
