"""The project's check on a GPU machine, in one run, written to one JSON file.

Four parts, each under a time cap (a part that reaches its cap skips what is left and
says so in the JSON), in under eight minutes on one H100:

1. ``cuda_tests``: ``pytest -m cuda`` with ``VSE_STRICT_SKIPS=cuda`` (a test skipped for
   want of CUDA fails the run): counts, return code, seconds, the output's tail on failure.
2. ``butd``: bottom-up-attention extraction (features/images/butd, built by
   ``build_image_extractor("regions", ...)``): ResNet-101 at the published shapes with
   random values in py-bottom-up-attention's layout (benchmarks/extract.py's checkpoint),
   300 proposals, the test photos and crops of them resized to 600/1000 px;
   ``extractor.regions`` in images/s at batch 1, 4 and 8, in float32 and under bf16
   autocast, with peak GPU memory and GPU busy share.
3. ``training``: MV-VSE and CAMERA at the papers' sizes, batch 128, on a COCO-shaped
   synthetic store (36 regions x 2048 float16 per image, 5 captions each:
   benchmarks/train_input.py's), through the stage's data path (``PairData``,
   ``Batches``) and step (bf16 autocast, AdamW, gradient clipping): samples/s, GPU busy
   share, peak memory.
4. ``ddp``: one DDP step of MV-VSE on every GPU (``torchrun --standalone``, nccl): world
   size, seconds, and whether the ranks' parameters agree after it.

Targets, reported under ``targets`` in the JSON: BUTD R101 at 600/1000 px with 300
proposals >= 25 images/s on one H100 (ambition 50); GPU busy >= 90% while training MV-VSE
at batch 128; ``pytest -m cuda`` green. GPU busy share is NVML's
(``torch.cuda.utilization``, which needs ``pip install nvidia-ml-py``); without it the
share is null, with the reason.

``--dry-run`` runs the same parts on the CPU at tiny sizes (BUTD width 8, 30 proposals,
64 px; a store of 64 images, batch 8; one gloo process; ``pytest -m cuda
--collect-only`` in place of the tests), for CI.

    benchmarks/gpu_check.sh [--out benchmarks/results/gpu_check.json]
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import yaml
from torch import nn
from train_input import CAPTIONS, D, R, generate  # benchmarks/ is on the path as a script

from infra.config import UserError, one_line
from infra.device import autocast
from infra.files import write_json
from models.common import TrainConfig
from models.data.batches import Batches
from models.data.info import FeaturePaths
from models.data.pairs import PairData
from models.registry import model_class, model_inputs
from models.train import _LossOf, build_model, epoch_batches

REPO = Path(__file__).resolve().parent.parent
log = functools.partial(print, flush=True)

# seconds per part at most; with start-up, the whole run stays under eight minutes
CAPS = {"cuda_tests": 150, "butd": 110, "training": 150, "ddp": 50}
COCO_TRAIN_IMAGES = 113_287  # Karpathy train + restval
# crops (fraction of width, of height) after the whole photos: other sizes and shapes
CROPS = ((1.0, 1.0), (0.6, 1.0), (1.0, 0.55), (0.75, 0.8))
TRAIN_MODELS = ("mvvse", "camera")
DDP_MODEL = "mvvse"


@dataclass(frozen=True)
class Plan:
    """The sizes of a run: the check's (:data:`FULL`) or the dry run's (:data:`DRY`)."""

    butd_width: int = 64  # 64: ResNet-101 as published
    proposals: int = 300
    min_side: int = 600
    max_side: int = 1000
    butd_images: int = 16
    butd_batches: tuple[int, ...] = (1, 4, 8)
    passes: int = 2  # timed passes over the images per BUTD config; the best counts
    train_images: int = 4096  # 160 batches of 128: 10 warm up, 150 timed
    batch: int = 128
    warmup_steps: int = 10
    steps: int = 150  # timed steps per model, at most
    model_sizes: str = "paper"  # the models' code defaults (the papers'); "demo": params.yaml
    dry_run: bool = False


FULL = Plan()
DRY = Plan(
    butd_width=8,
    proposals=30,
    min_side=64,
    butd_images=8,
    passes=1,
    train_images=64,
    batch=8,
    warmup_steps=2,
    steps=5,
    model_sizes="demo",
    dry_run=True,
)
STORE_WHY = (
    "{n} of COCO's {coco} train images: generating the store (single-threaded) counts "
    "against the part's cap, and a step's speed does not depend on the store's size once "
    "the page cache holds it, as it holds full COCO's {gb:.0f} GB of float16 regions on a "
    "machine with more memory than that"
)


class Clock:
    """Seconds left of a cap."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mib(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**20)


def busy_unavailable(device: torch.device) -> str | None:
    """Why the GPU busy share cannot be read here (None: it can)."""
    if device.type != "cuda":
        return "no CUDA device (CPU run)"
    try:
        torch.cuda.utilization(device)
    except ModuleNotFoundError:
        return "pynvml is not installed: pip install nvidia-ml-py, then rerun"
    except Exception as err:  # noqa: BLE001 - NVML's errors: driver, permissions
        return f"NVML failed ({one_line(err)}): check the driver with nvidia-smi"
    return None


class Busy:
    """The GPU busy share over a block, from NVML's utilization (the percent of its last
    sample period in which a kernel ran) sampled by a background thread."""

    def __init__(self, device: torch.device, unavailable: str | None, every: float = 0.1):
        self.device, self.unavailable, self.every = device, unavailable, every
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(torch.cuda.utilization(self.device))

    def __enter__(self) -> Busy:
        if self.unavailable is None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def share(self) -> float | None:
        if not self.samples:
            return None
        return sum(self.samples) / len(self.samples) / 100


# --------------------------------------------------------------------------- pytest -m cuda


class CudaTests:
    """``pytest -m cuda`` (``--collect-only`` in a dry run) as a subprocess."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:randomly"]
        if dry_run:
            self.command.append("--collect-only")

    def start(self) -> CudaTests:
        env = {**os.environ, "VSE_STRICT_SKIPS": "cuda"}
        self.start_time, self.proc = time.perf_counter(), None
        if importlib.util.find_spec("pytest") is None:
            return self
        self.proc = subprocess.Popen(
            self.command,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        return self

    def result(self, cap: float) -> dict:
        """Wait for the run (up to ``cap`` seconds since it started) and read its counts."""
        wait = max(1.0, cap - (time.perf_counter() - self.start_time))
        out = {"command": " ".join(["pytest", *self.command[3:]]), "strict_skips": "cuda"}
        if self.proc is None:
            return {**out, "error": "pytest is not installed here: pip install -e '.[dev]'"}
        try:
            output, _ = self.proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            output, _ = self.proc.communicate()
            out["skipped"] = (  # the part's reason; the tests' count is under "counts"
                f"time cap of {cap:.0f} s reached: run `VSE_STRICT_SKIPS=cuda pytest -m cuda` "
                "alone to see which test is slow"
            )
        out["returncode"] = self.proc.returncode
        out["seconds"] = round(time.perf_counter() - self.start_time, 1)
        lines = output.strip().splitlines()
        last = lines[-1] if lines else ""
        if self.dry_run:
            found = re.search(r"(\d+)(?:/\d+)? tests? collected", last)
            out["collected"] = int(found.group(1)) if found else 0
            if not out["collected"]:
                out["error"] = "no test marked cuda was collected: see tests/strict_skips.py"
        else:
            out["counts"] = {}
            for key in ("passed", "failed", "skipped", "errors"):
                found = re.search(rf"(\d+) {key.rstrip('s')}", last)
                out["counts"][key] = int(found.group(1)) if found else 0
        if out["returncode"] != 0:
            out["tail"] = lines[-40:]
        return out


# --------------------------------------------------------------------------- BUTD


def butd_images(n: int):
    """``n`` images of several sizes: the test photos whole, then crops of them
    (:data:`CROPS`), so that batches mix sizes and aspect ratios."""
    from extract import PHOTOS
    from PIL import Image

    photos = sorted(PHOTOS.glob("*.jpg"))
    if not photos:
        raise UserError(f"{PHOTOS}: no photos; restore them with git checkout {PHOTOS}")
    images = []
    for i in range(n):
        image = Image.open(photos[i % len(photos)]).convert("RGB")
        fw, fh = CROPS[(i // len(photos)) % len(CROPS)]
        w, h = image.size
        images.append(image.crop((0, 0, round(w * fw), round(h * fh))))
    return images


def time_regions(extractor, items, batch, dtype, device, passes, unavailable) -> dict:
    """images/s of the regions of ``items`` in batches of ``batch``, run as the stage runs
    them (each batch's forward on this thread, its selection on a background thread beside
    the next forward): the best of ``passes`` passes, after one warm-up batch, with peak
    memory and busy share."""
    bf16 = dtype == "bfloat16"
    chunks = [items[i : i + batch] for i in range(0, len(items), batch)]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        extractor.regions(chunks[0])
    sync(device)
    reset_peak(device)
    best, regions = float("inf"), 0
    with Busy(device, unavailable) as busy, ThreadPoolExecutor(max_workers=1) as selecting:
        for _ in range(passes):
            start = time.perf_counter()
            regions, previous = 0, None
            for chunk in chunks:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    raw = extractor.forward(chunk)
                if previous is not None:
                    regions += sum(len(r["boxes"]) for r in previous.result())
                previous = selecting.submit(extractor.select, chunk, raw)
            regions += sum(len(r["boxes"]) for r in previous.result())
            sync(device)
            best = min(best, time.perf_counter() - start)
    return {
        "dtype": dtype,
        "batch": batch,
        "images_per_s": round(len(items) / best, 2),
        "seconds": round(best, 3),
        "regions_per_image": round(regions / len(items), 1),
        "peak_memory_mib": peak_mib(device),
        "busy_share": busy.share,
    }


def butd_part(plan: Plan, device: torch.device, cap: float, unavailable: str | None) -> dict:
    from extract import butd_checkpoint

    from features.images.config import RegionsConfig
    from features.images.extract import build_image_extractor

    clock = Clock(cap)
    images = butd_images(plan.butd_images)
    root = Path(tempfile.mkdtemp(prefix="vse-gpu-check-butd-"))
    try:
        cfg = RegionsConfig(
            weights=str(butd_checkpoint(root, plan.butd_width)),
            device=device.type,
            proposals=plan.proposals,
            min_side=plan.min_side,
            max_side=plan.max_side,
        )
        extractor = build_image_extractor("regions", cfg)
    finally:
        shutil.rmtree(root)
    items = [extractor.prepare(image, {}) for image in images]
    sizes = sorted({tuple(it["image"].shape[1:]) for it in items})
    out = {
        "model": extractor.name,
        "width": plan.butd_width,
        "proposals": plan.proposals,
        "min_side": plan.min_side,
        "max_side": plan.max_side,
        "images": len(items),
        "input_sizes_hw": [list(s) for s in sizes],
        "busy_share_unavailable": unavailable,
        "runs": [],
        "skipped": [],
    }
    log(f"butd: {extractor.name}, {len(items)} images of {len(sizes)} sizes, {device}")
    last = 0.0
    for dtype in ("float32", "bfloat16"):
        for batch in plan.butd_batches:
            if clock.left() < 1.5 * last:  # the next config would pass the cap
                out["skipped"].append(f"{dtype} batch {batch}: time cap of {cap:.0f} s reached")
                continue
            start = time.perf_counter()
            try:
                run = time_regions(extractor, items, batch, dtype, device, plan.passes, unavailable)
            except Exception as err:  # noqa: BLE001 - one config's failure; the others run
                error = f"{type(err).__name__}: {one_line(err, 300)}"
                out["runs"].append({"dtype": dtype, "batch": batch, "error": error})
                log(f"butd {dtype} batch {batch} failed: {error}")
                continue
            last = time.perf_counter() - start
            out["runs"].append(run)
            log(
                f"butd {dtype} batch {batch}: {run['images_per_s']:.1f} images/s, "
                f"{run['regions_per_image']:.0f} regions/image, peak {run['peak_memory_mib']} "
                f"MiB, busy {percent(run['busy_share'])}"
            )
    return out


# --------------------------------------------------------------------------- training


def model_config(name: str, sizes: str):
    """``models.<name>`` at the papers' sizes (the code defaults, as ``vse init`` writes
    them) or at the demo's (params.yaml)."""
    cls = model_class(name)
    if sizes == "paper":
        return cls.Config()
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    return cls.Config.model_validate(params["models"][name])


def train_step(wrapped, model, optimizer, batch, device, cfg: TrainConfig) -> torch.Tensor:
    """One optimizer step as the training loop takes it (models/train.py)."""
    batch["epoch"] = 0
    with autocast(device):
        loss = wrapped(batch)["loss"]
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    return loss.detach()


def train_model(name, plan, paths, device, cap, unavailable) -> dict:
    """Samples/s of ``name``'s training steps: ``plan.warmup_steps``, then up to
    ``plan.steps`` timed (fewer if ``cap`` seconds run out)."""
    clock = Clock(cap)
    cfg = TrainConfig(batch_size=plan.batch, device=device.type)
    model_cfg = model_config(name, plan.model_sizes)
    data = PairData(paths, "train", model_inputs(name, model_cfg))
    torch.manual_seed(cfg.seed)
    model = build_model(name, model_cfg, data.info).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    wrapped = _LossOf(model)
    order = epoch_batches(len(data), cfg.batch_size, cfg.seed, 0, 0, 1)
    tasks = [("pair", c) for c in order]
    warm = tasks[: plan.warmup_steps]
    timed = tasks[plan.warmup_steps : plan.warmup_steps + plan.steps]
    if not timed:
        raise UserError(
            f"{len(data)} captions give {len(tasks)} batches of {plan.batch}, and "
            f"{plan.warmup_steps} warm up: raise --train-images"
        )
    with Batches(data, device, num_workers=cfg.num_workers, prefetch=cfg.prefetch) as batches:
        for batch in batches.run(warm):
            train_step(wrapped, model, optimizer, batch, device, cfg)
        sync(device)
        reset_peak(device)
        steps, budget = 0, clock.left()
        with Busy(device, unavailable) as busy:
            start = time.perf_counter()
            stream = batches.run(timed)
            try:
                for batch in stream:
                    loss = train_step(wrapped, model, optimizer, batch, device, cfg)
                    steps += 1
                    if time.perf_counter() - start > budget:
                        break
            finally:
                stream.close()
            sync(device)
            seconds = time.perf_counter() - start
    out = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "inputs": sorted(model_inputs(name, model_cfg)),
        "steps": steps,
        "seconds": round(seconds, 3),
        "samples_per_s": round(steps * cfg.batch_size / seconds, 1),
        "busy_share": busy.share,
        "peak_memory_mib": peak_mib(device),
        "loss": round(float(loss), 4),
    }
    if steps < len(timed):
        out["capped"] = f"{steps} of {len(timed)} timed steps: time cap of {cap:.0f} s reached"
    return out


def training_part(plan, device, cap, store: Path, unavailable) -> dict:
    clock = Clock(cap)
    start = time.perf_counter()
    paths = generate(store, plan.train_images, log=lambda m: None, baselines=False)
    n = plan.train_images
    cfg = TrainConfig(batch_size=plan.batch, device=device.type)
    full_gb = COCO_TRAIN_IMAGES * R * D * 2 / 1e9
    out = {
        "store": {
            "images": n,
            "captions": n * CAPTIONS,
            "regions_per_image": R,
            "region_dim": D,
            "dtype": "float16",
            "region_gb": round(n * R * D * 2 / 1e9, 3),
            "generate_s": round(time.perf_counter() - start, 1),
            "why": STORE_WHY.format(n=n, coco=COCO_TRAIN_IMAGES, gb=full_gb),
        },
        "batch": plan.batch,
        "model_sizes": plan.model_sizes,
        "loop": {"num_workers": cfg.num_workers, "prefetch": cfg.prefetch, "autocast": "bf16"},
        "busy_share_unavailable": unavailable,
        "models": {},
        "skipped": [],
    }
    if device.type != "cuda":
        out["loop"]["autocast"] = None  # full precision off CUDA, as the loop
    log(f"training: store of {n} images ({out['store']['generate_s']} s to generate), {device}")
    for i, name in enumerate(TRAIN_MODELS):
        share = clock.left() / (len(TRAIN_MODELS) - i)
        if share < 5:
            out["skipped"].append(f"{name}: time cap of {cap:.0f} s reached")
            continue
        row = train_model(name, plan, paths, device, share, unavailable)
        out["models"][name] = row
        log(
            f"training {name} batch {plan.batch}: {row['samples_per_s']:.0f} samples/s over "
            f"{row['steps']} steps, busy {percent(row['busy_share'])}, peak "
            f"{row['peak_memory_mib']} MiB"
        )
    return out


# --------------------------------------------------------------------------- DDP


def store_paths(store: Path) -> FeaturePaths:
    return FeaturePaths(
        manifest=store / "manifest.parquet",
        regions=store / "regions.zarr",
        text=store / "text.zarr",
        vocab=store / "vocab.json",
    )


def ddp_part(plan: Plan, device: torch.device, cap: float, store: Path) -> dict:
    """``torchrun --standalone`` of :func:`ddp_worker` on every GPU (one gloo process on
    the CPU)."""
    if not (store / "vocab.json").exists():
        return {"skipped": "no training store: the training part did not make it"}
    world = torch.cuda.device_count() if device.type == "cuda" else 1
    result = store.parent / "ddp.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(world),
        str(Path(__file__).resolve()),
        "--ddp-worker",
        str(store),
        "--out",
        str(result),
    ]
    if plan.dry_run:
        command.append("--dry-run")
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    out = {"command": f"torchrun --standalone --nproc_per_node {world} {Path(__file__).name}"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            command,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": path},
            capture_output=True,
            text=True,
            timeout=cap,
        )
    except subprocess.TimeoutExpired:
        return {**out, "skipped": f"time cap of {cap:.0f} s reached"}
    out["wall_s"] = round(time.perf_counter() - start, 1)
    if proc.returncode != 0 or not result.exists():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-30:]
        error = f"torchrun exited with {proc.returncode}: {one_line(tail[-1] if tail else '')}"
        return {**out, "error": error, "tail": tail}
    out.update(json.loads(result.read_text()))
    log(
        f"ddp: {out['world_size']} rank(s), {out['backend']}, step {out['step_s']:.3f} s, "
        f"parameters agree: {out['params_agree']}"
    )
    return out


def ddp_worker(store: Path, result: Path, plan: Plan) -> None:
    """One rank, under torchrun: two DDP steps of MV-VSE on this rank's batches (the first
    warms up), then the ranks' parameters compared with rank 0's."""
    dist = torch.distributed
    cuda = torch.cuda.is_available() and not plan.dry_run
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = TrainConfig(batch_size=plan.batch, device=device.type)
    model_cfg = model_config(DDP_MODEL, plan.model_sizes)
    data = PairData(store_paths(store), "train", model_inputs(DDP_MODEL, model_cfg))
    torch.manual_seed(cfg.seed)
    model = build_model(DDP_MODEL, model_cfg, data.info).to(device).train()
    ids = [device.index] if cuda else None
    wrapped = nn.parallel.DistributedDataParallel(_LossOf(model), device_ids=ids)
    before = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    order = epoch_batches(len(data), cfg.batch_size, cfg.seed, 0, rank, world)[:2]
    seconds = []
    with Batches(data, device, num_workers=cfg.num_workers, prefetch=cfg.prefetch) as batches:
        for batch in batches.run([("pair", c) for c in order]):
            sync(device)
            start = time.perf_counter()
            train_step(wrapped, model, optimizer, batch, device, cfg)
            sync(device)
            seconds.append(time.perf_counter() - start)
    after = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    reference = after.clone()
    dist.broadcast(reference, 0)
    diff = (after - reference).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    if rank == 0:
        write_json(
            result,
            {
                "world_size": world,
                "backend": dist.get_backend(),
                "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                "model": DDP_MODEL,
                "batch_per_rank": cfg.batch_size,
                "first_step_s": round(seconds[0], 3),
                "step_s": round(seconds[-1], 3),
                "params_agree": bool(diff.item() == 0),
                "max_param_difference": float(diff.item()),
                "params_changed": bool((after != before).any()),
            },
        )
    dist.destroy_process_group()


# --------------------------------------------------------------------------- report


def percent(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.0f}%"


def targets(report: dict, gpu: bool) -> dict:
    """The issue's targets, met or not (None off a GPU: CPU figures say nothing of them)."""
    runs = [r for r in report.get("butd", {}).get("runs", []) if "images_per_s" in r]
    best = max(runs, key=lambda r: r["images_per_s"], default=None)
    mvvse = report.get("training", {}).get("models", {}).get("mvvse", {})
    tests = report.get("cuda_tests", {})
    counts = tests.get("counts", {})
    green = tests.get("returncode") == 0 and not counts.get("failed") and "skipped" not in tests
    busy = mvvse.get("busy_share")
    out = {
        "butd_images_per_s": {
            "target": 25,
            "ambition": 50,
            "value": best and best["images_per_s"],
            "config": best and f"{best['dtype']} batch {best['batch']}",
            "met": best["images_per_s"] >= 25 if best and gpu else None,
        },
        "mvvse_busy_share": {
            "target": 0.9,
            "value": busy,
            "met": busy >= 0.9 if busy is not None and gpu else None,
        },
        "cuda_tests_green": {"met": green if gpu else None},
    }
    return out


def summary(report: dict) -> str:
    """The compact table printed at the end."""
    rows = []
    tests = report.get("cuda_tests", {})
    if "collected" in tests:
        rows.append(("cuda_tests", "collected (dry run)", str(tests["collected"])))
    elif "returncode" in tests:
        counts = "/".join(str(tests["counts"][k]) for k in ("passed", "failed", "skipped"))
        rows.append(
            ("cuda_tests", "passed/failed/skipped, rc", f"{counts}, rc {tests['returncode']}")
        )
    butd = report.get("butd", {})
    for dtype in ("float32", "bfloat16"):
        runs = [r for r in butd.get("runs", []) if r["dtype"] == dtype]
        if runs:
            batches = "/".join(str(r["batch"]) for r in runs)
            rates = " / ".join(
                f"{r['images_per_s']:.1f}" if "error" not in r else "error" for r in runs
            )
            rows.append((f"butd {dtype}", f"images/s at batch {batches}", rates))
    for name, row in report.get("training", {}).get("models", {}).items():
        figure = f"{row['samples_per_s']:.0f}, {percent(row['busy_share'])}"
        rows.append((f"training {name}", "samples/s, GPU busy", figure))
    ddp = report.get("ddp", {})
    if "world_size" in ddp:
        figure = f"{ddp['world_size']}, {ddp['step_s']:.3f}, {ddp['params_agree']}"
        rows.append(("ddp", "ranks, step s, params agree", figure))
    for part in ("cuda_tests", "butd", "training", "ddp"):
        section = report.get(part, {})
        for key in ("error", "skipped"):
            value = section.get(key)
            if value:
                text = value if isinstance(value, str) else "; ".join(value)
                rows.append((part, key, text))
    for name, t in report.get("targets", {}).items():
        met = {True: "met", False: "NOT met", None: "n/a (not a GPU run)"}[t["met"]]
        rows.append(("target", name, met))
    width = max(len(r[1]) for r in rows) if rows else 0
    return "\n".join(f"{a:<18}{b:<{width + 2}}{c}" for a, b, c in rows)


def run_part(report: dict, name: str, out: Path, fn, *args) -> None:
    """``report[name] = fn(*args)``; an exception becomes the part's one-line ``error``;
    the JSON is written after each part."""
    start = time.perf_counter()
    try:
        report[name] = fn(*args)
    except Exception as err:  # noqa: BLE001 - one part's failure is reported, the rest run
        report[name] = {"error": f"{type(err).__name__}: {one_line(err, 300)}"}
        log(f"gpu_check: {name} failed: {report[name]['error']}")
    report[name].setdefault("part_s", round(time.perf_counter() - start, 1))
    write_json(out, report)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "benchmarks/results/gpu_check.json"
    parser.add_argument("--out", default=str(REPO / default), help=f"the JSON (default: {default})")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU at tiny sizes")
    parser.add_argument("--train-images", type=int, help="images in the synthetic store")
    parser.add_argument("--ddp-worker", metavar="STORE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    plan = DRY if args.dry_run else FULL
    if args.train_images:
        plan = replace(plan, train_images=args.train_images)
    out = Path(args.out)
    if args.ddp_worker:
        ddp_worker(Path(args.ddp_worker), out, plan)
        return 0
    gpu = torch.cuda.is_available() and not args.dry_run
    if not gpu and not args.dry_run:
        log("gpu_check: no CUDA device here: run it on a GPU machine, or pass --dry-run")
        return 2
    device = torch.device("cuda" if gpu else "cpu")
    started = time.perf_counter()
    report = {
        "meta": {
            "dry_run": args.dry_run,
            "device": torch.cuda.get_device_name(device) if gpu else "cpu",
            "gpus": torch.cuda.device_count() if gpu else 0,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "caps_s": CAPS,
            "plan": asdict(plan),
        }
    }
    unavailable = busy_unavailable(device)
    if unavailable and gpu:
        log(f"gpu_check: GPU busy share unavailable: {unavailable}")
    log(f"gpu_check on {report['meta']['device']}, torch {torch.__version__}")
    tests = CudaTests(args.dry_run).start()
    if not args.dry_run:  # alone on the machine; a dry run's collection overlaps the rest
        run_part(report, "cuda_tests", out, tests.result, CAPS["cuda_tests"])
        log(f"cuda_tests: rc {report['cuda_tests'].get('returncode')}")
    root = Path(tempfile.mkdtemp(prefix="vse-gpu-check-"))
    try:
        run_part(report, "butd", out, butd_part, plan, device, CAPS["butd"], unavailable)
        store = root / "store"
        args_ = (plan, device, CAPS["training"], store, unavailable)
        run_part(report, "training", out, training_part, *args_)
        run_part(report, "ddp", out, ddp_part, plan, device, CAPS["ddp"], store)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.dry_run:
        run_part(report, "cuda_tests", out, tests.result, CAPS["cuda_tests"])
    report["targets"] = targets(report, gpu)
    report["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    write_json(out, report)
    log(f"\ngpu_check: {report['meta']['wall_s']} s, JSON in {out}")
    log(summary(report))
    failed = [p for p in ("cuda_tests", "butd", "training", "ddp") if "error" in report[p]]
    failed += ["cuda_tests"] if report["cuda_tests"].get("returncode") else []
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
