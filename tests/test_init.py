"""`vse init`: from the demo to a real dataset in one step, nothing of the demo in it.

The generated params.yaml is compared with the code defaults section by section against
this file's own list of the differences a dataset must bring (each with its reason); the
generated DAG is run end to end on six CC BY COCO photographs (tests/data/photos)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import run

from flows.init import init, text_model_local
from flows.params import params_model

PHOTOS = Path(__file__).parent / "data/photos"  # CC BY 2.0, see ATTRIBUTION.md
REPO = Path(__file__).resolve().parents[1]
SPLITS = ["train", "train", "val", "val", "test", "test"]


def flat(node, prefix="") -> dict:
    """``{"a.b": value}`` of nested mappings (lists and model mappings as values)."""
    if isinstance(node, dict) and not prefix.endswith(("enabled", "ablations", "per_model")):
        out = {}
        for key, value in node.items():
            out |= flat(value, f"{prefix}.{key}" if prefix else key)
        return out
    return {prefix: node}


def karpathy_json(folder: Path, labels: bool = False, boxes: bool = False) -> Path:
    """The photos as a Karpathy split JSON (COCO's captions), optionally with labels and
    boxes (as the Karpathy reader takes them)."""
    images = []
    for meta, split in zip(json.loads((PHOTOS / "images.json").read_text()), SPLITS, strict=True):
        image = {
            "filename": meta["file_name"],
            "split": split,
            "sentences": [{"raw": c} for c in meta["captions"]],
        }
        if labels:
            image["label"] = len(images) % 2
        if boxes:
            image["boxes"] = [[10, 10, 200, 200]]
            image["box_names"] = ["thing"]
        images.append(image)
    data = {"dataset": "coco", "images": images}
    if labels:
        data["class_names"] = ["indoor", "outdoor"]
    (folder / "images").mkdir(parents=True, exist_ok=True)
    for meta in images:
        shutil.copy(PHOTOS / meta["filename"], folder / "images" / meta["filename"])
    path = folder / "dataset.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def root(tmp_path):
    """A folder with the repository's (demo) params.yaml and dvc.yaml."""
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def generated(root: Path, dataset: str, **kw) -> tuple[dict, list[str]]:
    annotations = karpathy_json(root / "raw", **kw)
    lines = init(dataset, annotations, root / "raw/images", root)
    return yaml.safe_load((root / "params.yaml").read_text()), lines


# What a COCO dataset without labels or boxes must differ in from the code defaults (the
# papers'), written here by hand, with the reason; nothing else may differ.
COCO_DIFFERENCES = {
    "prepare.format": "karpathy",  # Karpathy's dataset_coco.json (the demo's: demo)
    # HUSE needs class labels; these annotations have none
    "models.enabled": {
        "vsepp": "global",
        "mvvse": "regions",
        "camera": "regions",
        "univse": "grid",
    },
    "regions.architecture": "resnet101_c4",  # written out (default null: "from weights")
    "grid.architecture": "resnet152",  # written out
    # CAMERA's schedule on MS-COCO (its Sec. 4.2) and GPO's for MV-VSE
    "train.per_model": {
        "camera": {"lr": 1e-4, "epochs": 40, "lr_decay_epochs": [20]},
        "mvvse": {"lr": 5e-4, "epochs": 25, "lr_decay_epochs": [15]},
    },
}
OFFLINE_TEXT = {"text.model": "all-MiniLM-L6-v2"}  # bert-base-uncased not cached here


def test_generated_params_are_the_defaults_but_for_the_datasets_choices(root):
    params, lines = generated(root, "coco")
    defaults = params_model()().model_dump(mode="json", by_alias=True)
    assert "demo" not in params and "detector" not in params  # no boxes: no detector
    got, want = flat(params), flat({k: v for k, v in defaults.items() if k in params})
    assert got.keys() == want.keys()  # every other section written out, key by key
    differences = {k: got[k] for k in got if got[k] != want[k]}
    expected = dict(COCO_DIFFERENCES)
    if "text.model" in differences:
        expected |= OFFLINE_TEXT
    assert differences == expected
    assert got["evaluate.fold_size"] == 1000  # COCO 1K, the default
    text = (root / "params.yaml").read_text()
    for key in differences:  # each said, in the file and to the user, with its reason
        assert any(line.startswith(f"{key}: ") and "(" in line for line in lines), key
        section, _, name = key.rpartition(".")
        above = text.split(f"\n{'  ' * key.count('.')}{name}:")[0].rsplit("\n", 1)[-1]
        assert above.strip().startswith("#"), f"{key}: no reason above it in params.yaml"


def test_no_demo_value_reaches_a_real_params_yaml(root):
    """Every key where the demo's params.yaml differs from the code defaults takes another
    value in the generated one (COCO), but one: the shipped text model when the papers'
    BERT is not available offline on this machine (said, with that reason)."""
    demo = flat(yaml.safe_load((REPO / "params.yaml").read_text()))
    defaults = flat(params_model()().model_dump(mode="json", by_alias=True))
    demo_only = {k: v for k, v in demo.items() if not k.startswith("demo.") and v != defaults[k]}
    assert len(demo_only) > 30  # the demo shrinks a lot; this test would see it
    params, _ = generated(root, "coco")
    got = flat(params)
    leaked = {k: v for k, v in demo_only.items() if k in got and got[k] == v}
    if not text_model_local(defaults["text.model"]):
        assert leaked.pop("text.model") == "all-MiniLM-L6-v2"
    assert not leaked, f"demo values in a real params.yaml: {leaked}"


def test_flickr_reports_the_whole_test_split(root):
    params, lines = generated(root, "flickr30k")
    assert params["evaluate"]["fold_size"] is None
    assert any(line.startswith("evaluate.fold_size: null  (Flickr30K") for line in lines)


def test_labels_keep_huse_and_boxes_keep_the_detector(root):
    from ruamel.yaml import YAML

    params, lines = generated(root, "coco", labels=True, boxes=True)
    assert "huse" in params["models"]["enabled"] and "detector" in params
    pca = {"model": "huse", "store": "global"}  # HUSE's input ablation, with its reason
    assert params["models"]["ablations"] == {"huse-pooled": pca}
    assert any(line.startswith("models.ablations: ") and "pooled" in line for line in lines)
    assert params["regions"]["architecture"] == params["detector"]["architecture"]
    assert params["grid"]["architecture"] == "resnet101"  # the detector's trunk
    dag = YAML(typ="safe").load((root / "dvc.yaml").read_text())
    assert "detector" in dag["stages"] and "demo-data" not in dag["stages"]
    assert "--weights ${paths.detector}/detector.pt" in dag["stages"]["regions"]["cmd"]
    assert dag["vars"][0]["dataset"] == {"annotations": "raw/dataset.json", "images": "raw/images"}


def test_without_boxes_no_stage_names_the_detector(root):
    generated(root, "karpathy")
    dag = (root / "dvc.yaml").read_text()
    assert "paths.detector" not in dag and "demo" not in dag.split("stages:")[1]
    with pytest.raises(Exception, match="not the demo's"):  # a second init: restore first
        init("karpathy", root / "raw/dataset.json", root / "raw/images", root)


def test_flickr8k_original_release(tmp_path):
    """Flickr8k.token.txt and the split lists (as the release names them) -> records in
    the lists' splits with their captions in #N order; unlisted images are not read."""
    from features.ingest.readers import PrepareConfig, read_flickr8k

    text = tmp_path / "Flickr8k_text"
    text.mkdir()
    names = [p.name for p in sorted(PHOTOS.glob("*.jpg"))]
    lines = [f"{n}#{i}\t{n[:4]} caption {i}" for n in names for i in (1, 0, 2, 4, 3)]
    lines.append("1000268201_693b08cb0e.jpg#0\tan image in no split list")
    (text / "Flickr8k.token.txt").write_text("\n".join(lines) + "\n")
    for name, chunk in (("train", names[:2]), ("dev", names[2:4]), ("test", names[4:])):
        (text / f"Flickr_8k.{name}Images.txt").write_text("\n".join(chunk) + "\n")
    dataset = read_flickr8k(text, PHOTOS, PrepareConfig(format="flickr8k"))
    got = [(r.key, r.path, r.split, r.captions, r.problem) for r in dataset.records]
    splits = ["train"] * 2 + ["val"] * 2 + ["test"] * 2
    assert got == [
        (Path(n).stem, n, s, [f"{n[:4]} caption {i}" for i in range(5)], None)
        for n, s in zip(names, splits, strict=True)
    ]
    (text / "Flickr_8k.devImages.txt").unlink()
    with pytest.raises(Exception, match="Flickr_8k.devImages.txt"):
        read_flickr8k(text, PHOTOS, PrepareConfig(format="flickr8k"))


# Test-only overrides: the sizes of a CPU test (1 epoch, small trunks and widths); every
# other value is what `vse init` wrote for users.
TINY = {
    "regions": {"architecture": "resnet18_c4", "min_side": 128, "max_side": 128},
    "grid": {"architecture": "resnet18", "image_size": 64},
    "train": {"epochs": 1, "batch_size": 4, "lr_decay_epochs": []},
    "text": {"word_min_count": 1},
    "models": {
        "vsepp": {"embed_size": 32, "word_dim": 16},
        "mvvse": {"embed_size": 32, "word_dim": 16},
        "camera": {"embed_size": 32, "heads": 2, "channels": [8] * 7},
        "univse": {"embed_size": 32, "d_basic": 16, "d_modif": 16},
    },
}


def test_the_generated_dag_runs_end_to_end_on_real_photos(project):
    """`vse init` on a Karpathy JSON of six CC BY COCO photos, then `dvc repro`: every
    stage of the generated DAG runs to the report, with no edit of dvc.yaml."""
    annotations = karpathy_json(project / "raw")
    run(["vse", "init", "--dataset", "flickr30k", "--annotations", str(annotations),
         "--images", "raw/images"], project)  # fmt: skip
    params = yaml.safe_load((project / "params.yaml").read_text())
    for section, values in TINY.items():
        for key, value in values.items():
            if isinstance(value, dict):
                params[section][key].update(value)
            else:
                params[section][key] = value
    for schedule in params["train"]["per_model"].values():  # the papers' schedules, shortened
        schedule.update(epochs=1, lr_decay_epochs=[])
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    result = run(["dvc", "repro"], project)
    assert "Running stage 'demo-data'" not in result.stdout
    assert "Running stage 'detector'" not in result.stdout
    for stage in ("prepare", "regions", "grid", "train@univse", "evaluate@camera", "report"):
        assert f"Running stage '{stage}'" in result.stdout, stage
    assert "read 6 records, kept 6" in result.stdout
    report = (project / "reports/models.md").read_text()
    assert all(f"| {m} |" in report for m in ("vsepp", "mvvse", "camera", "univse"))
    assert "| huse |" not in report and "Folds rsum" not in report
    assert json.loads((project / "metrics/regions.json").read_text())


def test_boxes_from_coco_instances_train_the_detector(root):
    instances = root / "instances_train2017.json"
    instances.write_text(json.dumps({"images": [], "annotations": [], "categories": []}))
    annotations = karpathy_json(root / "raw")
    init("coco", annotations, root / "raw/images", root, ["coco", str(instances)])
    from ruamel.yaml import YAML

    detector = YAML(typ="safe").load((root / "dvc.yaml").read_text())["stages"]["detector"]
    assert "--coco instances_train2017.json" in detector["cmd"]
    assert "--manifest" not in detector["cmd"]
    assert "instances_train2017.json" in detector["deps"]
    assert "${paths.manifest}" not in detector["deps"]
