"""Predicted vs measured peak GPU memory of a TinyGPT training step (needs CUDA).

    python benchmarks/gpu_memory_check.py [--layers 8 --hidden 1024 --heads 16 --seq 1024 --batch 8]

Prints ``dtlib.analytic.memory.memory_per_gpu``'s breakdown (fp32 weights, AdamW, GPU dropout masks of 1
byte) next to ``torch.cuda.max_memory_allocated`` over the second step (the first allocates the
optimizer states). At the peak (end of forward) the gradients of the previous step are freed
(``zero_grad(set_to_none=True)``), so the measurement is compared with the total minus gradients
as well as with the total.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from dtlib.analytic.memory import GiB, memory_per_gpu
from dtlib.models import TinyGPT, tiny_gpt_config
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.precision import precision


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 8), ("hidden", 1024), ("heads", 16), ("seq", 1024), ("batch", 8),
                          ("vocab", 32000)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--dropout", type=float, default=0.1)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    cfg = tiny_gpt_config(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                          vocab=args.vocab)
    model = TinyGPT(cfg, dropout=args.dropout).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, cfg.vocab, (args.batch, cfg.seq), device="cuda")
    for step in range(2):
        if step == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    pred = memory_per_gpu(cfg, Parallelism(micro_batch_size=args.batch), precision=precision("fp32", optimizer="adamw"),
                          dropout=args.dropout > 0, mask_bytes=1)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for k, v in pred.to_dict()["per_gpu"].items():
        print(f"  predicted {k:<12} {v / GiB:8.3f} GiB")
    print(f"  measured max_memory_allocated {measured / GiB:8.3f} GiB")
    print(f"  measured / predicted total            {measured / pred.total:6.3f}")
    print(f"  measured / (predicted total - grads)  {measured / (pred.total - pred.gradients):6.3f}")


if __name__ == "__main__":
    main()
