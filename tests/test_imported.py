"""Imported features feed every model, end to end through the CLI: a SCAN/VSE++ precomp
folder trains MV-VSE (regions) and VSE++ (global features derived from the regions);
CAMERA, which reads region boxes, says precomp has none, and trains from
bottom-up-attention TSVs, which have them."""

import numpy as np
import yaml
from test_precomp import make_precomp, write_tsv

from flows.cli import main

SPLITS = {"train": 24, "dev": 6, "test": 6}


def test_precomp_and_tsv_features_train_every_model(tmp_path, repo_root, capsys):
    src = tmp_path / "f30k_precomp"
    src.mkdir()
    for split, n in SPLITS.items():
        make_precomp(src, split, n, ids=False, regions=12, dim=16)
    params = yaml.safe_load((repo_root / "params.yaml").read_text())
    params["store"] = {"samples_per_shard": 8, "samples_per_chunk": 4}
    params["global"] = {"projection_dim": 8}
    params["text"].update(model="all-MiniLM-L6-v2", word_min_count=1)
    params["train"].update(epochs=1, batch_size=8, standardize=False)
    params["evaluate"].update(fold_size=3)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))

    def vse(*argv) -> int:
        code = main(["--params", str(tmp_path / "params.yaml"), *map(str, argv)])
        return code

    m, r, t, v = (tmp_path / n for n in ("m.parquet", "r.zarr", "t.zarr", "v.json"))
    assert vse("store", "import-precomp", src, "--manifest", m, "--out", r) == 0
    assert vse("extract", "text", "--manifest", m, "--out", t, "--vocab", v) == 0
    g = tmp_path / "g.zarr"
    assert vse("extract", "global", "--regions", r, "--manifest", m, "--out", g) == 0
    common = ["--manifest", m, "--text", t, "--vocab", v]

    def train(model, image, store, name):
        out = tmp_path / name
        files = ["--out", out, "--metrics", out / "m.json", "--plots", out / "p.json"]
        return vse("train", model, *common, f"--{image}", store, *files)

    assert train("mvvse", "regions", r, "mvvse") == 0
    assert train("vsepp", "global", g, "vsepp") == 0
    capsys.readouterr()
    assert train("camera", "regions", r, "camera") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no boxes" in err[0] and "import-tsv" in err[0], err

    keys = [f"{split}_{i:06d}" for split, n in SPLITS.items() for i in range(n)]
    rng = np.random.default_rng(0)
    rows = []
    for key in keys:
        xy = rng.random((12, 2)) * 300
        boxes = np.concatenate([xy, xy + 20 + rng.random((12, 2)) * 200], axis=1)
        rows.append((key, boxes, rng.standard_normal((12, 16))))
    write_tsv(tmp_path / "butd.tsv", rows)
    boxed = tmp_path / "boxed.zarr"
    assert (
        vse(
            "store",
            "import-tsv",
            tmp_path / "butd.tsv",
            "--manifest",
            m,
            "--out",
            boxed,
            "--max-regions",
            12,
        )
        == 0
    )
    assert train("camera", "regions", boxed, "camera") == 0
    assert (tmp_path / "camera" / "best.pt").is_file()
