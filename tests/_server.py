"""A server started for a test (JupyterLab, JupyterHub): up when its URL answers, then stopped
with everything it started, whatever the test did."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import psutil


@contextlib.contextmanager
def serve(args: list[str], ready_url: str, log: Path, start_s: float, stop_s: float,
          **popen) -> Iterator[subprocess.Popen]:
    """Run ``args`` (output to ``log``) until ``ready_url`` answers, within ``start_s`` seconds;
    on exit SIGTERM it (Jupyter servers stop their kernels, the hub its servers and proxy), then
    SIGKILL whatever of its process tree is left after ``stop_s`` seconds."""
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **popen)
        server = psutil.Process(proc.pid)
        try:
            deadline = time.monotonic() + start_s
            while True:
                assert proc.poll() is None, f"{args[2]} exited: {log.read_text()[-3000:]}"
                try:
                    with urllib.request.urlopen(ready_url, timeout=2):
                        break
                except OSError:
                    assert time.monotonic() < deadline, f"{ready_url} did not answer within {start_s} s"
                    time.sleep(0.5)
            yield proc
        finally:
            # kernels run in their own sessions, and spawn ranks: note them all before stopping
            started = [server] + server.children(recursive=True) if proc.poll() is None else []
            proc.send_signal(signal.SIGTERM)
            _, alive = psutil.wait_procs(started, timeout=stop_s)
            for p in alive:
                p.kill()
            psutil.wait_procs(alive, timeout=10)
            proc.wait(timeout=10)
