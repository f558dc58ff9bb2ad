"""dtlib.resilience.heartbeat: an injected hang is caught, named, and beats the collective timeout."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from dtlib.launcher import RankFailedError, launch
from dtlib.resilience.heartbeat import EXIT_CODE, Heartbeat, find_hung

COLLECTIVE_TIMEOUT = 120  # dtlib.launch's timeout is also the ranks' collective timeout
HEARTBEAT = 1.5


def test_find_hung_blames_the_rank_behind():
    records = {0: {"step": 3, "phase": "all_reduce", "beats": 12}, 1: {"step": 3, "phase": "data", "beats": 10},
               2: {"step": 3, "phase": "all_reduce", "beats": 12}}
    stalled = {0: 2.0, 1: 2.0, 2: 2.0}
    assert find_hung(records, stalled, timeout=1.5) == [1]
    assert find_hung(records, {**stalled, 1: 1.0}, timeout=1.5) == []  # not yet
    even = {r: {**rec, "beats": 12} for r, rec in records.items()}
    assert find_hung(even, stalled, timeout=1.5) == [0, 1, 2]  # all stuck in one place: all named
    assert find_hung({**records, 1: {**records[1], "phase": "done"}}, stalled, 1.5) == [0, 2]


def _hang_at(rank, world_size, hang_rank, hang_step, outdir=None):
    def report(message):  # what the default does (print, exit), with the message kept for the test
        open(os.path.join(outdir, f"rank{rank}.txt"), "w").write(message)
        os._exit(EXIT_CODE)
    hb = Heartbeat(timeout=HEARTBEAT, interval=0.1, on_hang=report if outdir else None).start()
    for step in range(6):
        hb.beat(step, "data")
        if rank == hang_rank and step == hang_step:
            print(f"hang starts at {time.time()}", flush=True)
            while True:  # a stuck data loader
                time.sleep(0.01)
        hb.beat(step, "all_reduce")
        dist.all_reduce(torch.ones(1))
    hb.stop()
    return hb.detected


def test_injected_hang_is_named_before_the_collective_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailedError):  # the first rank to exit: 75, or a peer's closed connection
        launch(_hang_at, 3, args=(1, 3, str(tmp_path)), timeout=COLLECTIVE_TIMEOUT)
    elapsed = time.monotonic() - start
    # the hung rank's own watchdog always reports (its main thread is stuck: no error can end it)
    message = (tmp_path / "rank1.txt").read_text()
    assert "hung rank 1 (last step 3, phase 'data'" in message, message
    assert ("waiting for it: rank 0 in step 3, phase 'all_reduce', rank 2 in step 3, phase 'all_reduce'"
            in message), message
    # caught at HEARTBEAT seconds (+ start-up of 3 ranks), long before the gloo timeout
    assert elapsed < COLLECTIVE_TIMEOUT / 2, elapsed


def test_no_false_alarm_on_a_healthy_run():
    detected = launch(_hang_at, 2, args=(-1, -1), timeout=COLLECTIVE_TIMEOUT)
    assert detected == [None, None]


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout must be a finite number > 0"):
        Heartbeat(timeout=0)
