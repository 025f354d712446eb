"""Step checkpoints at COCO size: the time to write ``last.pt`` for MV-VSE with the paper's
sizes (embed 1024, word_dim 300, BiGRU text encoder, 36 x 2048 regions, a COCO vocabulary
of 11,755 words; AdamW's two moments per weight) against the training step measured in
the same run (batch 128, synthetic inputs), and what ``train.checkpoint_every_steps: 500``
adds to an epoch: one write per 500 steps, relative to 500 steps (target < 2%).

The write is what the trainers do (:func:`infra.resume.training_state`, then
:meth:`infra.resume.StepCheckpoints.save`: a copy of the state in CPU memory, which
training waits for, then ``torch.save`` to a temporary file renamed into place in a
thread), into ``--dir`` (a temporary folder on the machine's disk by default). Timed:
``blocking`` (what the step loop waits for: the state and its copy), ``full`` (until the
file is in place; what a synchronous write cost), and the steps run while the thread
writes against steps without (the thread's CPU and memory traffic slow them: also paid).

    python benchmarks/checkpoint.py [--steps 4] [--writes 5] [--batch 128] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import infra.resume
from infra.resume import StepCheckpoints, training_state
from models.data.info import DataInfo
from models.mvvse import MVVSEConfig
from models.train import build_model

VOCAB, R, D, WORDS = 11755, 36, 2048, 14  # COCO: vocabulary, regions, their size, mean words
GPU_STEP = 0.050  # seconds: an assumed GPU step of this model (HISTORY.md; not measured)


def batch(size: int, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    words = torch.randint(4, VOCAB, (size, WORDS + 2), generator=g)
    out = {
        "regions": torch.randn(size, R, D, generator=g),
        "region_lengths": torch.full((size,), R),
        "words": words,
        "word_lengths": torch.full((size,), WORDS + 2),
        "epoch": 0,
    }
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed training steps")
    parser.add_argument("--writes", type=int, default=5, help="timed checkpoint writes")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--every", type=int, default=500, help="checkpoint_every_steps")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs, {device}")
    torch.manual_seed(0)
    info = DataInfo(region_dim=D, vocab_size=VOCAB)
    model = build_model("mvvse", MVVSEConfig(), info).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    data = batch(args.batch, device)

    def step() -> float:
        start = time.perf_counter()
        loss = model.loss(data)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
        optimizer.step()
        scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step()  # warm-up; AdamW's moments exist from here on
    steps = [step() for _ in range(args.steps)]
    params = sum(p.numel() for p in model.parameters())
    root = Path(args.dir or tempfile.mkdtemp(prefix="vse-ckpt-"))
    root.mkdir(parents=True, exist_ok=True)
    last = root / "last.pt"
    checkpoints = StepCheckpoints(log=lambda m: None)  # in the main thread: signals too
    written, save_torch = [], infra.resume.save_torch

    def timed_save(obj, path):  # the writer thread's CPU time: what it can take from training
        start = time.thread_time()
        save_torch(obj, path)
        written.append(time.thread_time() - start)

    infra.resume.save_torch = timed_save
    try:
        blocking, full = [], []
        for _ in range(args.writes):
            start = time.perf_counter()
            state = training_state(model, optimizer, scheduler, device)
            checkpoints.save({"model": "mvvse", **state, "epoch": 0, "history": []}, last)
            blocking.append(time.perf_counter() - start)
            checkpoints.wait()
            full.append(time.perf_counter() - start)
        size = last.stat().st_size
    finally:
        infra.resume.save_torch = save_torch
        checkpoints.close()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    step_s, block_s, full_s, cpu_s = map(statistics.median, (steps, blocking, full, written))
    per = args.every * step_s
    print(f"MV-VSE (paper sizes): {params / 1e6:.1f} M parameters, last.pt {size / 2**20:.0f} MiB")
    timed = ", ".join(f"{s * 1000:.0f}" for s in steps)
    print(f"training step (batch {args.batch}): median {step_s * 1000:.0f} ms ({timed} ms)")
    print(
        f"checkpoint save: blocking median {block_s * 1000:.0f} ms (min "
        f"{min(blocking) * 1000:.0f}), full write median {full_s * 1000:.0f} ms (min "
        f"{min(full) * 1000:.0f}): the step loop waits {block_s / full_s:.1%} of the write"
    )
    print(
        f"checkpoint_every_steps {args.every}: +{block_s / per:.3%} per epoch blocking, at most "
        f"+{(block_s + cpu_s) / per:.3%} with the writer's CPU time ({cpu_s * 1000:.0f} ms) "
        f"taken from training; +{full_s / per:.3%} if written in the step loop (target < 2%); "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    gpu = args.every * GPU_STEP  # a GPU step (the assumed figure), with this machine's write
    print(
        f"at {GPU_STEP * 1000:.0f} ms/step: +{block_s / gpu:.2%} blocking (+{full_s / gpu:.2%} "
        "synchronous), plus the device-to-host copy of the state (not measured here)"
    )


if __name__ == "__main__":
    main()
