"""What lesson 11 runs: DDP, local SGD and DiLoCo side by side, torchft's own, and an emulated slow link.

* :func:`torchft_manager` starts what ``torchft`` (Meta's fault-tolerant training library) needs on
  CPU ranks: a ``LighthouseServer`` (on rank 0; its address broadcast to the others), one
  ``TCPStore`` per replica and a ``torchft.manager.Manager`` over a ``ProcessGroupGloo``. Each rank
  is a replica group of one process, so torchft's ``LocalSGD`` / ``DiLoCo`` average over the ranks.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["torchft_manager"]


def torchft_manager(rank: int, world_size: int, model: nn.Module, timeout: float = 20.0
                    ) -> tuple[Any, Callable[[], None]]:
    """A real ``torchft.manager.Manager`` for this rank (a replica of one process), and a function
    that shuts it (and the lighthouse, on rank 0) down. Call it on every rank, inside ``launch``.

    torchft normally runs a lighthouse next to the job and a Manager per replica group; here rank 0
    hosts the lighthouse (``min_replicas=world_size``, so every quorum holds all ranks) and each
    rank its own store. ``use_async_quorum=False`` because torchft's DiLoCo requires it;
    ``init_sync=False`` because every rank builds the same seeded model (with it, the first quorum
    would copy replica 0's weights - after its first H local steps - onto the others).
    """
    os.environ.setdefault("RUST_LOG", "error")  # torchft's Rust side logs every quorum otherwise
    from torchft._torchft import LighthouseServer
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world_size) if rank == 0 else None
    address = [lighthouse.address() if lighthouse else None]
    dist.broadcast_object_list(address, src=0)
    store = dist.TCPStore("localhost", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    limit = timedelta(seconds=timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=limit), min_replica_size=world_size,
                      use_async_quorum=False, init_sync=False,
                      load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                      replica_id=str(rank), store_addr="localhost", store_port=store.port,
                      rank=0, world_size=1, lighthouse_addr=address[0], timeout=limit,
                      quorum_timeout=limit, connect_timeout=limit)

    def shutdown() -> None:
        manager.shutdown(wait=False)
        dist.barrier()  # nobody may lose the lighthouse while another rank still talks to it
        if lighthouse is not None:
            lighthouse.shutdown()
        del store_keep[:]

    store_keep = [store]
    return manager, shutdown
