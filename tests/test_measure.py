"""Measuring the local CPU (dtlib.measure.measure_cpu): the peak and main-memory bandwidth it
computes from its timings (exactly, on a scripted clock), a copy large enough to leave the caches,
and the result usable as a catalogue entry."""
import re
import time

import pytest

from dtlib import measure
from dtlib.analytic.hardware import ACCELERATORS, add_accelerator, get_gpu
from dtlib.measure import MAX_COPY_BYTES, _l3_bytes, measure_cpu


def test_measure_and_add_the_local_cpu():
    start = time.process_time()  # CPU seconds of this process: what the measurement costs, whatever the load
    cpu = measure_cpu(n=128, repeats=2, name="cpu-test")
    elapsed = time.process_time() - start
    try:
        # wall-clock figures: load only lowers them (a 128 x 128 matmul measured 0.08 GFLOP/s with
        # six busy loops on 2 cores, 100 GFLOP/s alone), so no floor but > 0; what they are computed
        # from is checked exactly in test_the_figures_come_from_the_fastest_repeat
        assert 0 < cpu.peak("fp32") < 1e14 and "measured" in cpu.source
        # main memory, not a cache: the copy is at least 256 MiB and 4 x L3, and says so
        copied = float(re.search(r"from a ([0-9.]+) MiB torch copy", cpu.source).group(1))
        assert copied >= 256 and copied * 2 ** 20 >= min(4 * (_l3_bytes() or 0), MAX_COPY_BYTES)
        assert 0 < cpu.memory_bandwidth < 1e13
        assert elapsed < 10  # about 0.3 CPU s on 2 cores
        add_accelerator(cpu)
        assert get_gpu("cpu-test") is cpu
        with pytest.raises(ValueError, match="has no bf16 peak"):
            cpu.peak("bf16")
    finally:
        ACCELERATORS.pop("cpu-test", None)
    with pytest.raises(ValueError, match="copy_bytes must be an integer >= 1048576, got 8192"):
        measure_cpu(n=16, repeats=1, copy_bytes=8 * 2 ** 10)


def test_the_figures_come_from_the_fastest_repeat(monkeypatch):
    """On a scripted clock (the durations _timed returns, in call order: the matmuls, then the
    copies): FLOP/s are 2 n^3 over the fastest matmul, bandwidth the bytes read + written over the
    fastest copy. Whatever the load, this is what the measured figures mean."""
    durations = iter([4e-3, 2e-3, 3e-3, 0.5, 0.25, 0.4])
    timed = []

    def scripted(fn):
        fn()  # the work still runs: only its duration is scripted
        timed.append(fn)
        return next(durations)

    monkeypatch.setattr(measure, "_timed", scripted)
    cpu = measure_cpu(n=64, repeats=3, name="cpu-scripted", copy_bytes=2 ** 20)
    assert len(timed) == 6  # 3 repeats of each, and nothing else timed
    assert cpu.peak("fp32") == pytest.approx(2 * 64 ** 3 / 2e-3, rel=1e-12)
    assert cpu.memory_bandwidth == pytest.approx(2 * 2 ** 20 / 0.25, rel=1e-12)  # STREAM Copy: read + write
    assert "64x64 matmul, best of 3" in cpu.source and "1 MiB torch copy" in cpu.source


def test_l3_size_is_read_from_sysfs(tmp_path):
    def index(i, level, size):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "level").write_text(f"{level}\n")
        (tmp_path / f"index{i}" / "size").write_text(f"{size}\n")

    index(0, 1, "48K")
    index(2, 2, "2048K")
    assert _l3_bytes(str(tmp_path)) is None  # no level-3 cache
    index(3, 3, "32768K")
    assert _l3_bytes(str(tmp_path)) == 32 * 2 ** 20
    (tmp_path / "index3" / "size").write_text("big\n")
    assert _l3_bytes(str(tmp_path)) is None
    l3 = _l3_bytes()  # this machine: read if sysfs has it
    assert l3 is None or 2 ** 16 <= l3 <= 2 ** 32
