"""Run by test_step_resume (``torchrun --nproc_per_node N``, or plainly for one process):
VSE++ on the tiny pairs, SIGTERM to every rank during optimizer step ``stop`` (0: never),
or ``--resume``; each rank writes the caption positions of the batches it consumed, in
order (batches are built in the loop: consumed = built). With ``--kill-rank R`` only rank
R is stopped at step ``stop``, by SIGKILL (a machine lost: nothing written), and a step
checkpoint is written every 2 steps.

usage: ddp_elastic_job.py OUT BATCH_PER_RANK STOP [--resume] [--kill-rank R]"""

import json
import os
import signal
import sys
from pathlib import Path

import torch
from model_data import TinyPairs

from infra.resume import Preempted
from models.common import TrainConfig
from models.train import train
from models.vsepp import VSEPPConfig

out, batch, stop = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
data = TinyPairs(n_images=48)
consumed = []
pair_batch = data.pair_batch


def recorded(captions):
    consumed.append([int(c) for c in captions])
    return pair_batch(captions)


data.pair_batch = recorded
step, count = torch.optim.AdamW.step, [0]


rank = int(os.environ.get("RANK", "0"))
kill = int(sys.argv[sys.argv.index("--kill-rank") + 1]) if "--kill-rank" in sys.argv else None


def step_then_signal(self, *args, **kwargs):
    count[0] += 1
    if count[0] == stop and kill is None:
        os.kill(os.getpid(), signal.SIGTERM)
    if count[0] == stop and rank == kill:
        os.kill(os.getpid(), signal.SIGKILL)
    return step(self, *args, **kwargs)


torch.optim.AdamW.step = step_then_signal
every = 2 if kill is not None else 0
cfg = TrainConfig(
    epochs=2, batch_size=batch, lr=2e-3, device="cpu", prefetch=0, checkpoint_every_steps=every
)
model = VSEPPConfig(embed_size=16, word_dim=8)
code = 0
try:
    train("vsepp", model, cfg, data, data, out / "model", resume="--resume" in sys.argv)
except Preempted:
    code = 75
except Exception:  # a peer lost: this rank's collective fails (the run is resumed)
    if kill is None:
        raise
    code = 1
name = "resumed" if "--resume" in sys.argv else "first"
(out / f"{name}-rank{rank}.json").write_text(json.dumps(consumed))
if code == 1:
    os._exit(code)  # its peer is gone: no group to take down
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
sys.exit(code)
