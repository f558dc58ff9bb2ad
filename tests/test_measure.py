"""Measuring the local CPU (dtlib.measure.measure_cpu): a plausible matmul peak and main-memory
bandwidth, a copy large enough to leave the caches, and the result usable as a catalogue entry."""
import re
import time

import pytest

from dtlib.analytic.hardware import ACCELERATORS, add_accelerator, get_gpu
from dtlib.measure import MAX_COPY_BYTES, _l3_bytes, measure_cpu


def test_measure_and_add_the_local_cpu():
    start = time.process_time()  # CPU seconds of this process: what the measurement costs, whatever the load
    cpu = measure_cpu(n=128, repeats=2, name="cpu-test")
    elapsed = time.process_time() - start
    try:
        assert 1e8 < cpu.peak("fp32") < 1e14 and "measured" in cpu.source
        # main memory, not a cache: the copy is at least 256 MiB and 4 x L3, and says so
        copied = float(re.search(r"from a ([0-9.]+) MiB torch copy", cpu.source).group(1))
        assert copied >= 256 and copied * 2 ** 20 >= min(4 * (_l3_bytes() or 0), MAX_COPY_BYTES)
        assert 1e8 < cpu.memory_bandwidth < 1e13
        assert elapsed < 10  # about 0.3 CPU s on 2 cores
        add_accelerator(cpu)
        assert get_gpu("cpu-test") is cpu
        with pytest.raises(ValueError, match="has no bf16 peak"):
            cpu.peak("bf16")
    finally:
        ACCELERATORS.pop("cpu-test", None)
    with pytest.raises(ValueError, match="copy_bytes must be an integer >= 1048576, got 8192"):
        measure_cpu(n=16, repeats=1, copy_bytes=8 * 2 ** 10)


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
