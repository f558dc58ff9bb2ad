"""What a batch's verdicts' parent loads, decided by the master (issue 39's cost goal): torch and the
launcher's pre-warm only for a master whose setup imports torch, and whatever must hold once they
are in (one thread before any fork, the data-only codec) holds however late they are imported."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dtlib.grading import on_import, pipeline, prefork, sandbox, transfer, verdict
from tests.test_grading import _tiny_course

ROOT = Path(__file__).resolve().parent.parent


def _python(source: str) -> dict:
    """Run ``source`` in a fresh interpreter (nothing imported yet) and read the JSON it prints last."""
    ran = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return json.loads(ran.stdout.strip().splitlines()[-1])


def test_when_imported_runs_once_right_after_the_module_loads_and_again_after_a_failed_import(tmp_path,
                                                                                             monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    (tmp_path / "cost_probe_a.py").write_text("VALUE = 1\n")
    on_import.when_imported("cost_probe_a", lambda m: seen.append(("a", m.VALUE)))
    assert seen == []
    import cost_probe_a  # noqa: F401
    assert seen == [("a", 1)]
    on_import.when_imported("cost_probe_a", lambda m: seen.append(("loaded", m.VALUE)))  # already in: at once
    assert seen == [("a", 1), ("loaded", 1)]
    (tmp_path / "cost_probe_b.py").write_text("raise RuntimeError('not yet')\n")
    on_import.when_imported("cost_probe_b", lambda m: seen.append(("b", m.VALUE)))
    with pytest.raises(RuntimeError, match="not yet"):
        import cost_probe_b  # noqa: F401
    (tmp_path / "cost_probe_b.py").write_text("VALUE = 2\n")
    sys.modules.pop("cost_probe_b", None)
    import cost_probe_b  # noqa: F401, F811
    assert seen[-1] == ("b", 2) and not any(isinstance(f, on_import._Hook) and f.name.startswith("cost_probe")
                                             for f in sys.meta_path)


def _maps_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's library mapped (it imported torch)."""
    return any("libtorch" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


@pytest.mark.timeout(300)
def test_the_verdicts_parent_loads_torch_only_for_a_master_whose_setup_imports_it(tmp_path):
    tiny = _tiny_course(tmp_path / "course") / "99_tiny.ipynb"
    lesson_03 = pipeline._master_for("03")  # arithmetic only: its setup imports no torch
    import nbformat

    cases = {"tiny": (verdict.setup_sources(nbformat.read(tiny, as_version=4)), False),
             "03": (verdict.setup_sources(nbformat.read(lesson_03, as_version=4)), False),
             "torch": (["import torch", "from dtlib.grading import feedback"], True)}
    runner = prefork.Forker(tmp_path, tmp_path / "runner.log", timeout=240)  # the executions' parent
    try:
        for name, (setup, loads_torch) in cases.items():
            parent = prefork.Forker(tmp_path, tmp_path / f"{name}.log", 240, setup, zygote=runner)
            try:
                assert _maps_torch(parent.pid) == loads_torch, name  # reported by the parent itself
            finally:
                parent.close()
            assert _ends_within(parent.pid, 30), f"{name}: the verdicts' parent outlived its socket"
        assert not _maps_torch(runner.pid)
        # once a verdict of a torch-free master needed torch, the parent loads it for the next ones
        parent = prefork.Forker(tmp_path, tmp_path / "late.log", 240, cases["tiny"][0], zygote=runner)
        try:
            parent.torch = True
            with open(os.devnull, "r+b") as null:  # a verdict with no job: it ends at once
                verdict_pid = parent.start([null.fileno()] * 3, tmp_path, {}, sandbox.Limits(), None,
                                           sandbox.Mounts(), ())
            assert _maps_torch(parent.pid) and _ends_within(verdict_pid, 60)
        finally:
            parent.close()
    finally:
        runner.close()


def _ends_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_torch_and_the_launcher_imported_late_are_single_threaded_and_data_only():
    # a torch-free master's parent: plain replies are read without torch; torch, imported later
    # (a class answer's base, a test), is single-threaded at once; the launcher reads ranks' data only
    got = _python(
        "import json, sys\n"
        "from dtlib.grading import transfer, verdict\n"
        "verdict.prepare(['import math'])\n"
        "out = {'after_setup': 'torch' in sys.modules}\n"
        "out['reply'] = transfer.decode(transfer.encode({'q': [1, 2.5, None, 'x', True]}))\n"
        "out['after_reply'] = 'torch' in sys.modules\n"
        "base = verdict._trusted_base('torch.nn.modules.module', 'Module')\n"
        "import torch\n"
        "from dtlib import launcher\n"
        "out.update(base=base is torch.nn.Module, threads=torch.get_num_threads(),\n"
        "           codec=launcher._codec == (transfer.encode, transfer.decode),\n"
        "           prewarmed='torch._dynamo' in sys.modules)\n"
        "print(json.dumps(out))")
    assert got == {"after_setup": False, "reply": {"q": [1, 2.5, None, "x", True]}, "after_reply": False,
                   "base": True, "threads": 1, "codec": True, "prewarmed": False}
    # a torch master's parent: torch single-threaded before the setup's first op, launcher pre-warmed
    got = _python(
        "import json, sys\n"
        "from dtlib.grading import transfer, verdict\n"
        "verdict.prepare(['import torch', 'THREADS = torch.get_num_threads()'])\n"
        "from dtlib import launcher\n"
        "print(json.dumps({'threads': verdict._SETUP['THREADS'], 'prewarmed': 'torch._dynamo' in sys.modules,\n"
        "                  'codec': launcher._codec == (transfer.encode, transfer.decode)}))")
    assert got == {"threads": 1, "prewarmed": True, "codec": True}


def test_plain_data_travels_as_json_and_everything_else_keeps_its_type():
    plain = {"n": 3, "x": -0.0, "big": 2 ** 80, "nan": float("nan"), "flag": True, "none": None,
             "nested": [[1, "é\ud800"], {"k": [2.5]}]}
    blob = transfer.encode(plain)
    assert blob[:1] == b"J"
    back = transfer.decode(blob)
    assert json.dumps(back) == json.dumps(plain) and type(back["flag"]) is bool and type(back["n"]) is int
    deep: list = []
    for _ in range(40):
        deep = [deep]
    others = [(1, 2), {1: "a"}, np.float64(2.5), torch.ones(2), deep, [(1,)]]
    for value in others:
        blob = transfer.encode(value)
        assert blob[:1] != b"J", value
        back = transfer.decode(blob)
        assert type(back) is type(value) and (torch.equal(back, value) if type(value) is torch.Tensor
                                              else back == value), value
    assert transfer.encode(10 ** 5000)[:1] != b"J"  # more digits than Python writes as text
