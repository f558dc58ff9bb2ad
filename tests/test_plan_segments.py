"""Jobs on NVLink domains (issue 37): an NVL72 rack is handed out by 4-GPU compute tray, so any
multiple of 4 GPUs is a job, placed in equal segments of at most 72; a DGX board is whole."""
import json
import re

import pytest

from dtlib.analytic.hardware import cluster
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.cli import main
from dtlib.plan.segments import segments
from dtlib.plan.steptime import step_time


@pytest.mark.parametrize("gpus, domain, domains, per_domain", [
    (128, 72, 2, 64), (144, 72, 2, 72), (256, 72, 4, 64), (200, 72, 5, 40), (36, 72, 1, 36), (8, 72, 1, 8),
    (64, 8, 8, 8), (4, 8, 1, 4),
])
def test_segments_are_the_largest_equal_ones_that_fit_a_domain(gpus, domain, domains, per_domain):
    p = segments(gpus, domain)
    assert (p.domains, p.gpus_per_domain) == (domains, per_domain)
    assert p.domains * p.gpus_per_domain == gpus and p.idle_per_domain == domain - per_domain


@pytest.mark.parametrize("gpus, domain, message", [
    (258, 72, "valid: multiples of 4 (the NVL72 rack's compute tray)"),
    (12, 8, "valid: multiples of 8 (or at most 8)"),
    (0, 8, "gpus"),
])
def test_a_job_no_segment_holds_is_refused_naming_gpus(gpus, domain, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        segments(gpus, domain)


def test_a_128_gpu_gb200_job_is_two_64_gpu_segments_and_the_plan_says_so(capsys):
    code = main(["plan", "--model", "llama3-8b", "--gpu", "gb200", "--gpus", "128", "--global-batch", "256",
                 "--dp", "128", "--tp", "1", "--pp", "1", "--top", "1", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["gpus_per_node"] == 64
    assert d["placement"] == {"domains": 2, "gpus_per_domain": 64, "domain_size": 72,
                              "text": d["placement"]["text"]}
    assert d["placement"]["text"].startswith("placement: 2 x NVL72 rack, 64 of the job's GPUs in each (8 idle")
    # timed as two 64-GPU NVLink domains: the same step as the cluster built by hand
    layout = Parallelism(dp=128, micro_batch_size=d["configs"][0]["micro_batch"],
                         num_microbatches=d["configs"][0]["microbatches"], zero=d["configs"][0]["zero"],
                         recompute=d["configs"][0]["recompute"])
    by_hand = step_time(get_preset("llama3-8b"), layout, cluster("gb200", 2, 64))
    assert d["configs"][0]["step_time_s"] == pytest.approx(by_hand.step_time, rel=1e-9)
