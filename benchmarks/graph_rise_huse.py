"""HUSE with each image input, side by side (issue 26): the pooled trunk feature (what HUSE
read before), the global store's PCA-64 (``graph_rise.output: pca``) and the
Graph-RISE-style embedding (``graph_rise.output: trained``, the default).

Runs ``vse train graph-rise`` once per output (timed: the trained one is what the stage
adds to ``make demo``), then ``vse train huse`` and ``vse evaluate huse`` on each input,
with the demo's params otherwise. Reads the stores that ``dvc repro`` built (paths as in
dvc.yaml); works in a temp folder (removed at the end) or ``--work``, and writes the
figures to ``--out`` when given.

    python benchmarks/graph_rise_huse.py [--work DIR] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

MANIFEST = "data/prepared/manifest.parquet"
GLOBAL = "data/features/global.zarr"
REGIONS = "data/features/regions.zarr"
TEXT = "data/features/text.zarr"
VOCAB = "data/features/text_vocab.json"
SCENEGRAPHS = "data/features/scenegraphs"


def vse(params: Path, *args: str) -> float:
    start = time.perf_counter()
    subprocess.run(["vse", "--params", str(params), *args], check=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", help="keep the stores and models here (default: a temp folder)")
    ap.add_argument("--out", help="JSON of the figures")
    ap.add_argument("--params", default="params.yaml")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        measure(args, work)


def measure(args, work: Path) -> None:
    base = yaml.safe_load(Path(args.params).read_text())
    result: dict = {"stage_seconds": {}, "stage_metrics": None, "huse": {}}
    stores = {"pooled": GLOBAL}
    for output in ("trained", "pca"):
        params = work / f"params_{output}.yaml"
        params.write_text(
            yaml.safe_dump({**base, "graph_rise": {**base["graph_rise"], "output": output}})
        )
        store = work / f"graph_rise_{output}.zarr"
        result["stage_seconds"][output] = round(
            vse(
                params,
                "train",
                "graph-rise",
                "--manifest",
                MANIFEST,
                "--global",
                GLOBAL,
                "--regions",
                REGIONS,
                "--text",
                TEXT,
                "--scenegraphs",
                SCENEGRAPHS,
                "--out",
                str(store),
                "--model",
                str(work / f"model_{output}"),
                "--labels",
                str(work / "labels.json"),
                "--graph",
                str(work / "graph.parquet"),
                "--metrics",
                str(work / f"metrics_{output}.json"),
            ),
            1,
        )
        stores[output] = str(store)
    result["stage_metrics"] = json.loads((work / "metrics_trained.json").read_text())
    params = Path(args.params)
    for name, store in stores.items():
        run = work / f"huse_{name}"
        inputs = ["--manifest", MANIFEST, "--global", store, "--text", TEXT, "--vocab", VOCAB]
        seconds = vse(
            params,
            "train",
            "huse",
            *inputs,
            "--out",
            str(run),
            "--metrics",
            str(run / "train.json"),
            "--plots",
            str(run / "plots.json"),
        )
        vse(
            params,
            "evaluate",
            "huse",
            "--checkpoint",
            str(run / "best.pt"),
            *inputs,
            "--out",
            str(run / "evaluate.json"),
        )
        report = json.loads((run / "evaluate.json").read_text())
        result["huse"][name] = {
            "image_dim": report.get("image_dim"),
            "train_seconds": round(seconds, 1),
            "rsum": report["full"]["rsum"],
            **report["classification"],
        }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    # fused: the image weight w chosen on val (models.evaluate.fusion_weight); equal: w 0.5
    print(
        f"{'input':8} {'acc image':>9} {'acc text':>9} {'acc fused':>9} {'w':>5} "
        f"{'fused eq':>9} {'rsum':>7}"
    )
    for name, r in result["huse"].items():
        print(
            f"{name:8} {r['accuracy_image']:9.1f} {r['accuracy_text']:9.1f} "
            f"{r['accuracy_fused']:9.1f} {r['fusion_weight_image']:5.2f} "
            f"{r['accuracy_fused_equal']:9.1f} {r['rsum']:7.1f}"
        )
    p = result["stage_metrics"]
    for key in (k for k in p if "_label_precision_at_" in k):  # val, test
        print(f"{key}: {json.dumps(p[key])}")
    print(f"stage seconds {result['stage_seconds']}")


if __name__ == "__main__":
    main()
