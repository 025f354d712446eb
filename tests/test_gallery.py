"""The retrieval gallery: top-5 per sampled query with the ground truth, view attention of
multi-view models, and a self-contained page that headless Chromium renders offline."""

import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

from models.data.info import DataInfo
from models.report.gallery import TOP_K, retrievals, view_regions
from models.report.gallery_page import write_gallery


def test_retrievals_mark_the_ground_truth_and_rank_by_score():
    n_img, per = 6, 2
    caption_image = np.repeat(np.arange(n_img), per)
    sims = np.random.default_rng(0).random((n_img, n_img * per)).astype(np.float32)
    sims[np.arange(n_img), np.arange(n_img) * per] += 2.0  # each image's first caption wins
    image_keys = [f"im{i}" for i in range(n_img)]
    caption_keys = [f"im{i}#{j}" for i in range(n_img) for j in range(per)]
    captions = [f"caption {k}" for k in caption_keys]
    out = retrievals(sims, caption_image, image_keys, caption_keys, captions)
    for query in out["image_to_text"]:
        scores = [r["score"] for r in query["results"]]
        assert len(scores) == TOP_K and scores == sorted(scores, reverse=True)
        assert query["results"][0]["hit"] and query["results"][0]["key"] == query["query"] + "#0"
        hits = [r["hit"] for r in query["results"]]
        assert sum(hits) == sum(r["key"].startswith(query["query"] + "#") for r in query["results"])
    for query in out["text_to_image"]:
        assert query["results"][0]["hit"] and query["query"].startswith(query["results"][0]["key"])


@pytest.mark.parametrize("name", ["mvvse", "camera"])
def test_view_attention_covers_the_kept_regions(name):
    from models.camera import CAMERA, CAMERAConfig
    from models.mvvse import MVVSE, MVVSEConfig

    info = DataInfo(region_dim=8, vocab_size=20, token_dim=8)
    model = (
        MVVSE(MVVSEConfig(embed_size=16, word_dim=8), info)
        if name == "mvvse"
        else CAMERA(CAMERAConfig(embed_size=16, heads=2, channels=[4] * 7), info)
    ).eval()
    lengths = torch.tensor([3, 5])
    batch = {
        "regions": torch.randn(2, 5, 8),
        "region_lengths": lengths,
        "boxes": torch.rand(2, 5, 4).sort(-1).values,
    }
    attention = model.view_attention(batch)
    views = model.encode_image(batch).shape[1]
    assert attention.shape == (2, views, 5)
    assert torch.all(attention[0, :, 3:] == 0)  # padded regions get nothing
    txt = torch.nn.functional.normalize(torch.randn(4, 16), dim=-1)
    keys = ["k0", "k1", "k2", "k3"]
    entries = view_regions(model, batch, txt, ["a", "b", "c", "d"], keys, batch["boxes"])
    assert len(entries[0]["boxes"]) == 3 and len(entries[0]["attention"][0]) == 3
    assert len(entries[1]["best_caption"]) == views


def test_page_is_self_contained_and_renders_in_chromium(tmp_path):
    rng = np.random.default_rng(0)
    paths = {}
    for i in range(4):
        paths[f"im{i}"] = tmp_path / f"im{i}.png"
        Image.fromarray(rng.integers(0, 255, (32, 48, 3), dtype=np.uint8)).save(paths[f"im{i}"])
    sims = rng.random((4, 8)).astype(np.float32)
    keys = [f"im{i}#{j}" for i in range(4) for j in range(2)]
    data = retrievals(sims, np.repeat(np.arange(4), 2), list(paths), keys, keys)
    views = {
        "image": "im1",
        "boxes": [[0.1, 0.1, 0.5, 0.6], [0.4, 0.3, 0.9, 0.9]],
        "attention": [[0.9, 0.1], [0.2, 0.8]],
        "best_caption": [{"key": "im1#0", "caption": "a thing", "score": 0.5}] * 2,
    }
    extremes = {
        "test": {
            "most_consistent": [{"key": "im0", "mean_similarity": 0.9, "captions": ["a", "b"]}],
            "least_consistent": [{"key": "im2", "mean_similarity": 0.1, "captions": ["c", "d"]}],
        }
    }
    page = tmp_path / "gallery.html"
    pngs = write_gallery(
        {"mvvse": {**data, "views": [views]}, "vsepp": data},
        paths,
        extremes,
        page,
        tmp_path / "gallery",
    )
    assert len(pngs) == 3 + 3 + 1 + 1 and all(p.is_file() for p in pngs)
    text = page.read_text()
    assert "http://" not in text and "https://" not in text and 'src="data:image/png' in text
    again = tmp_path / "again.html"
    write_gallery(
        {"mvvse": {**data, "views": [views]}, "vsepp": data},
        paths,
        extremes,
        again,
        tmp_path / "again",
    )
    assert again.read_bytes() == page.read_bytes()  # deterministic: same inputs, same bytes

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium)")
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000"]
    dom = subprocess.run(
        [*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120
    )
    assert re.search(r'data-images-loaded="true"', dom.stdout), dom.stderr[-2000:]
    shot = tmp_path / "shot.png"
    subprocess.run(
        [*flags, f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
        capture_output=True,
        timeout=120,
    )
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float32)
    assert pixels.std() > 10  # not a blank page
