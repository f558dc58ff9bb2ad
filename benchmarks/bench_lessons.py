"""What one lesson costs, for sizing a workshop server: each lesson of ``notebooks/`` executed alone.

    PYTHONPATH=$PWD python benchmarks/bench_lessons.py [--quick] [--lessons 00 01 ...] [--timeout 900]

For each lesson, executed with nbclient (kernel start included) in a fresh kernel:

* wall: seconds from kernel start to the last cell's end, on this machine (note its cores);
* cpu: CPU seconds of the kernel and of every process it started and reaped (its ranks and
  theirs), read in the kernel after the last cell with ``getrusage(RUSAGE_SELF)`` +
  ``getrusage(RUSAGE_CHILDREN)`` (POSIX: children's times include their own waited-for
  children), so machine load does not change it;
* peak mem: the highest sum of PSS over the kernel's process tree, sampled every ``--interval``
  seconds (PSS shares a forked rank's copy-on-write pages among the processes that map them, so
  the sum is the memory the tree holds, not RSS's count of shared pages once per process);
* procs: distinct processes seen in the tree (the kernel included), and the most at once;
* ports: distinct local TCP ports the tree had open (listening or connected), and the most
  listening at once (each launch's rendezvous store, gloo's pairs, JAX/Ray's servers).

Sampling misses processes that live shorter than the interval, so procs and ports are lower bounds.
``--quick`` measures lesson 00 only (``make benchmarks``).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import psutil
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
# Printed by the extra last cell: the kernel's CPU seconds and its reaped descendants'.
_RUSAGE = ("import resource as _r\n"
           "_s, _c = _r.getrusage(_r.RUSAGE_SELF), _r.getrusage(_r.RUSAGE_CHILDREN)\n"
           "print(_s.ru_utime + _s.ru_stime + _c.ru_utime + _c.ru_stime)")


@dataclass
class Sample:
    """What the sampler saw of one kernel's process tree."""
    pids: set = field(default_factory=set)
    ports: set = field(default_factory=set)
    peak_pss: int = 0
    peak_procs: int = 0
    peak_listening: int = 0


def _sample_tree(root: psutil.Process, seen: Sample) -> None:
    try:
        tree = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    pss, listening = 0, set()
    for p in tree:
        try:
            pss += p.memory_full_info().pss
            for c in p.net_connections(kind="tcp"):
                seen.ports.add(c.laddr.port)
                if c.status == psutil.CONN_LISTEN:
                    listening.add(c.laddr.port)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        seen.pids.add(p.pid)
    seen.peak_pss = max(seen.peak_pss, pss)
    seen.peak_procs = max(seen.peak_procs, len(tree))
    seen.peak_listening = max(seen.peak_listening, len(listening))


def measure(path: Path, timeout: float, interval: float) -> dict:
    """Execute the notebook at ``path`` in a fresh kernel; its costs (see the module's docstring)."""
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(_RUSAGE))
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(path.parent)}})
    seen, done = Sample(), threading.Event()
    start = time.monotonic()
    with client.setup_kernel():
        kernel = psutil.Process(client.km.provisioner.process.pid)

        def sampler() -> None:
            while not done.is_set():
                _sample_tree(kernel, seen)
                done.wait(interval)

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        try:
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)
        finally:
            done.set()
            thread.join()
    wall = time.monotonic() - start
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    cpu = float(nb.cells[-1].outputs[-1]["text"])
    return {"lesson": path.stem, "wall_s": wall, "cpu_s": cpu, "peak_mib": seen.peak_pss / 2**20,
            "procs": len(seen.pids), "procs_at_once": seen.peak_procs, "ports": len(seen.ports),
            "listening_at_once": seen.peak_listening, "errors": len(errors)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="lesson 00 only")
    parser.add_argument("--lessons", nargs="*", help="lesson numbers (default: every lesson)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per cell")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples of the tree")
    args = parser.parse_args()
    if args.timeout <= 0 or args.interval <= 0:
        parser.error("--timeout and --interval must be > 0 seconds")
    lessons = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    wanted = ["00"] if args.quick else args.lessons
    if wanted:
        unknown = set(wanted) - {p.name[:2] for p in lessons}
        if unknown:
            parser.error(f"--lessons: no lesson {sorted(unknown)}; valid: {[p.name[:2] for p in lessons]}")
        lessons = [p for p in lessons if p.name[:2] in wanted]
    os.environ.setdefault("MPLBACKEND", "Agg")
    print(f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
          f"load average {os.getloadavg()[0]:.1f} at start; python {sys.version.split()[0]}")
    header = (f"{'lesson':24s} {'wall s':>7s} {'cpu s':>7s} {'peak MiB':>9s} {'procs':>6s} {'at once':>8s} "
              f"{'ports':>6s} {'listening':>10s} {'errors':>7s}")
    print(header)
    rows = []
    for path in lessons:
        r = measure(path, args.timeout, args.interval)
        rows.append(r)
        print(f"{r['lesson']:24s} {r['wall_s']:7.1f} {r['cpu_s']:7.1f} {r['peak_mib']:9.0f} {r['procs']:6d} "
              f"{r['procs_at_once']:8d} {r['ports']:6d} {r['listening_at_once']:10d} {r['errors']:7d}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at end; total wall {sum(r['wall_s'] for r in rows):.0f} s, "
          f"total cpu {sum(r['cpu_s'] for r in rows):.0f} s, largest peak {max(r['peak_mib'] for r in rows):.0f} MiB")
    if any(r["errors"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
