"""Profile one TinyGPT training step on one GPU: breakdown, MFU against the catalogue peak next to
nanoGPT's ``estimate_mfu`` convention, and the CUDA kernels' time against the breakdown.

    python benchmarks/profile_gpu.py --gpu h100-sxm            # GPT-2 small shape, bf16 autocast
    python benchmarks/profile_gpu.py --quick                   # tiny model on CPU (no GPU needed)

MFU (dtlib): model FLOPs of :func:`dtlib.analytic.flops.step_flops` (full attention, logits
counted, 3 x forward) / (step time x the catalogue's dense bf16 peak). nanoGPT's ``estimate_mfu``
(model.py): ``6N + 12 L H Q T`` FLOPs per token (PaLM App. B, N without the position
embedding, = :func:`dtlib.analytic.flops.palm_flops_per_token`) against a hard-coded 312 TFLOP/s
(A100 bf16); printed with that constant and with this GPU's peak. Traces go to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from dtlib.analytic.flops import palm_flops_per_token, step_flops
from dtlib.analytic.hardware import get_gpu
from dtlib.models import TinyGPT, tiny_gpt_config
from dtlib.profile import PARTS, diagnose, format_summary, phase, profile_steps, summarize

NANOGPT_PEAK = 312e12  # nanoGPT model.py estimate_mfu: "A100 GPU bfloat16 peak flops is 312 TFLOPS"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 12), ("hidden", 768), ("heads", 12), ("seq", 1024), ("batch", 16),
                          ("vocab", 50304), ("steps", 5), ("warmup", 3)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--gpu", default="h100-sxm", help="catalogue entry for the peak")
    ap.add_argument("--out", default="profile-gpu", help="folder for the Chrome trace")
    ap.add_argument("--quick", action="store_true", help="tiny model on CPU, peak measured")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    if args.quick:
        args.layers, args.hidden, args.heads, args.seq, args.batch, args.vocab = 2, 64, 4, 32, 4, 256
        args.steps, args.warmup = 2, 1
    device = torch.device("cuda" if cuda else "cpu")
    _ = torch.manual_seed(0)
    cfg = tiny_gpt_config(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                          vocab=args.vocab)
    model = TinyGPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    tokens = torch.randint(0, cfg.vocab, (args.batch, cfg.seq + 1), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()

    def step() -> None:
        with phase("data"):
            x, y = tokens[:, :-1], tokens[:, 1:]
        with phase("forward"), autocast:
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    shape = cfg.numbers(cfg.seq)
    analytic = step_flops(args.batch * cfg.seq, **shape)
    peak = get_gpu(args.gpu) if cuda else None
    rank = profile_steps(step, steps=args.steps, warmup=args.warmup, trace_dir=args.out,
                         peak=peak, dtype="bf16" if cuda else "fp32", model_flops=analytic["model"],
                         tokens=args.batch * cfg.seq)
    profile = summarize([rank])
    print(format_summary(profile, diagnose(profile)))
    counted = rank["flops"]["counted_model"]
    print(f"model FLOPs per step: dtlib.analytic.flops {analytic['model']:.4g}, FlopCounterMode "
          f"3 x forward {counted:.4g} (ratio {counted / analytic['model']:.4f})")
    non_embedding = sum(p.numel() for p in model.parameters()) - (model.wpe.weight.numel() if model.wpe is not None else 0)
    per_token = palm_flops_per_token(non_embedding, cfg.layers, cfg.heads, cfg.hidden // cfg.heads, cfg.seq)
    achieved = per_token * args.batch * cfg.seq / profile["step_time"]
    print(f"nanoGPT estimate_mfu: {achieved / NANOGPT_PEAK:.1%} of 312 TFLOP/s (its A100 constant), "
          f"{achieved / rank['peak_flops']:.1%} of this device's peak {rank['peak_flops']:.4g} FLOP/s; "
          f"dtlib MFU {profile['mfu']:.1%}")
    with open(os.path.join(args.out, "rank0.json")) as f:
        events = json.load(f)["traceEvents"]
    kernels = sum(e["dur"] for e in events if e.get("cat") == "kernel") / 1e6 / args.steps
    parts = profile["breakdown"][0]
    busy = parts["compute"] + parts["exposed_comm"] + parts["overlapped_comm"]
    print(f"CUDA kernels {kernels * 1e3:.2f} ms per step (sum of durations) vs breakdown compute + "
          f"communication {busy * 1e3:.2f} ms; parts sum {sum(parts[p] for p in PARTS) * 1e3:.2f} ms "
          f"= step {parts['step'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
