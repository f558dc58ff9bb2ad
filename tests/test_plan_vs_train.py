"""``benchmarks/bench_plan_vs_train.py --quick``: calibrate, plan and train every layout on this
machine, and end with the one summary line (its format and finite numbers; the error goal is the
full run's, recorded in docs/plan.md, and not a property of a loaded test machine)."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench_plan_vs_train.py")
LINE = re.compile(r"^plan vs train: (\d+) layouts, median error ([\d.]+)%, worst ([\d.]+)%, "
                  r"rank correlation (-?[\d.]+|nan)$")
ROW = re.compile(r"^(.+?)\s+([\d.]+)\s+([\d.]+)\s+([+-][\d.]+)%$")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_plan_vs_train", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_spearman_is_scipys():
    stats = pytest.importorskip("scipy.stats")
    spearman = _bench().spearman
    x, y = [3.0, 1.0, 2.0, 2.0, 5.0], [30.0, 12.0, 25.0, 19.0, 40.0]
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_layouts_keep_two_ranks_and_the_global_batch():
    bench = _bench()
    for name, layout in bench.LAYOUTS:
        sizes = [layout.get(k, 1) for k in ("dp", "tp", "pp")]
        assert sizes[0] * sizes[1] * sizes[2] == bench.RANKS, name
        assert sizes[0] * layout["micro_batch_size"] * layout["num_microbatches"] == 8, name
    assert len({name for name, _ in bench.LAYOUTS}) == len(bench.LAYOUTS)


def test_quick_run_ends_with_the_summary_line():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, BENCH, "--quick"], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    match = LINE.match(lines[-1])
    assert match, lines[-1]
    n, median, worst, r = match.groups()
    layouts = _bench().LAYOUTS
    assert int(n) == len(layouts) >= 6
    assert 0 <= float(median) <= float(worst) and r != "nan" and -1 <= float(r) <= 1
    # one row per layout before it: plan and train both positive, the error their own
    rows = [ROW.match(line) for line in lines[-1 - len(layouts):-1]]
    assert all(rows) and [row.group(1) for row in rows] == [name for name, _ in layouts]
    for row in rows:
        plan, train, error = (float(row.group(i)) for i in (2, 3, 4))
        assert plan > 0 and train > 0
        # the row prints plan and train to 0.05 ms and the error to 0.05 points: the error of the printed
        # times is the printed error within 100 x 0.05 (1/train + plan/train^2) + 0.05
        assert error == pytest.approx(100 * (plan - train) / train, abs=0.06 + 5.01 * (train + plan) / train ** 2)
    errors = sorted(abs(float(row.group(4))) for row in rows)
    assert float(worst) == pytest.approx(errors[-1], abs=0.2)
    # the layouts' planned costs span well beyond a few percent of noise (the rank correlation's point)
    planned = [float(row.group(2)) for row in rows]
    assert max(planned) > 2 * min(planned)
