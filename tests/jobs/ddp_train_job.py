"""Run by test_train under ``torchrun --nproc_per_node 2``: trains VSE++ on the tiny pairs
with DDP (gloo) and writes each rank's parameter checksums."""

import json
import sys
from pathlib import Path

import torch
from model_data import TinyPairs

from models.common import TrainConfig
from models.train import train
from models.vsepp import VSEPPConfig

out = Path(sys.argv[1])
data = TinyPairs(n_images=32)
cfg = TrainConfig(epochs=2, batch_size=8, lr=2e-3, device="cpu")
result = train("vsepp", VSEPPConfig(embed_size=32, word_dim=16), cfg, data, data, out / "model")
rank = torch.distributed.get_rank()
sums = {name: float(p.double().sum()) for name, p in result["model"].state_dict().items()}
(out / f"rank{rank}.json").write_text(json.dumps(sums, sort_keys=True))
torch.distributed.destroy_process_group()
