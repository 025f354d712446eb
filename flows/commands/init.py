"""``vse init``: params.yaml and dvc.yaml for a real dataset, in place of the demo's."""

from __future__ import annotations

from pathlib import Path

from flows.commands import command
from flows.init import PROTOCOLS


def arguments(p) -> None:
    p.add_argument("--dataset", required=True, choices=list(PROTOCOLS), help="which dataset")
    p.add_argument(
        "--annotations",
        required=True,
        type=Path,
        help="Karpathy's dataset_*.json; for flickr8k also the original Flickr8k_text folder "
        "(Flickr8k.token.txt and the Flickr_8k.*Images.txt split lists)",
    )
    p.add_argument("--images", required=True, type=Path, help="the images root folder")
    p.add_argument(
        "--boxes",
        nargs="+",
        metavar="KIND FILE",
        help="boxes to train the detector stage on: coco INSTANCES.json [VAL.json] or vg "
        "objects.json [attributes.json] (else the annotations' own boxes, if any)",
    )
    p.add_argument("--root", type=Path, default=Path("."), help="the repository (default: .)")


@command(
    "init",
    help="write params.yaml and dvc.yaml for a real dataset (papers' settings)",
    description="Replaces the demo's params.yaml and dvc.yaml: every section at the "
    "papers' defaults except what this dataset needs (each choice commented with its "
    "reason), no demo stage, the detector stage only when the annotations have boxes, "
    "HUSE only when they have class labels. `git checkout params.yaml dvc.yaml` returns "
    "to the demo.",
    arguments=arguments,
    sections=None,
)
def run(args, params) -> None:
    from flows.init import init

    for line in init(args.dataset, args.annotations, args.images, args.root, args.boxes):
        print(f"vse init: {line}")
    print("vse init: wrote params.yaml and dvc.yaml; next: dvc repro")
