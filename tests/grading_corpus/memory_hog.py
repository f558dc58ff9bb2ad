# allocates until stopped, in two processes: each stays under RLIMIT_AS (per process), together they meet the row's memory cgroup
import os
_held = []
_child = os.fork() == 0
try:
    while True:
        _held.append(b"\1" * (64 << 20))  # touched: resident, not just mapped
except MemoryError:
    _held.clear()
if _child:  # a copy of the kernel: it must not go on serving the notebook
    os._exit(0)
