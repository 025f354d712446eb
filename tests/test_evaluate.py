"""Evaluation: every number it reports against hand-computed values on small known
similarities and naive loops on random ones; non-finite embeddings and similarities are
refused, naming the item."""

import functools
import linecache
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from device_check import made_elsewhere
from model_data import TinyPairs

from infra.finite import NonFiniteError
from models.data.info import DataError
from models.evaluate import (
    EvaluateConfig,
    adversarial_metrics,
    classification_metrics,
    encode_images,
    encode_texts,
    evaluate_model,
    evaluate_split,
    fusion_weight,
)
from models.metrics import fold_metrics, retrieval_metrics, similarity_matrix
from models.train import build_model
from models.vsepp import VSEPPConfig

CFG = EvaluateConfig(batch_size=8, fold_size=4, device="cpu")


@pytest.fixture
def data():
    pairs = TinyPairs(n_images=8)
    pairs.split = "test"
    return pairs


def model_for(data):
    torch.manual_seed(0)
    return build_model("vsepp", VSEPPConfig(embed_size=16, word_dim=8), data.info)


def test_an_image_with_nan_features_is_refused_by_key(data):
    """One NaN image used to rank first everywhere and *raise* rsum; now it is an error."""
    data.image[3, 5] = float("nan")
    with pytest.raises(NonFiniteError, match="image 3 .*NaN or infinite"):
        evaluate_model(model_for(data), data, CFG, torch.device("cpu"))
    data.image_keys = [f"img{i:02d}" for i in range(data.n_images)]
    with pytest.raises(NonFiniteError, match="image 'img03'"):
        evaluate_model(model_for(data), data, CFG, torch.device("cpu"))


def test_a_model_with_infinite_weights_is_refused(data):
    model = model_for(data)
    with torch.no_grad():
        next(model.parameters()).fill_(float("inf"))
    with pytest.raises(NonFiniteError, match="NaN or infinite"):
        evaluate_model(model, data, CFG, torch.device("cpu"))


def not_checkpoints(tmp_path, data):
    """Files that are not checkpoints, each in its own way."""
    import pickle

    state = model_for(data).state_dict()
    good = {"model": "vsepp", "config": {"embed_size": 16, "word_dim": 8}, "state_dict": state}
    good["info"] = data.info.to_dict() if hasattr(data.info, "to_dict") else vars(data.info)
    files = {
        "random.pt": lambda p: p.write_bytes(np.random.default_rng(0).bytes(300)),
        "empty.pt": lambda p: p.write_bytes(b""),
        "text.pt": lambda p: p.write_text("not a checkpoint\n"),
        "list.pt": lambda p: torch.save([1, 2, 3], p),
        "missing.pt": lambda p: torch.save({"model": "vsepp"}, p),
        "unknown.pt": lambda p: torch.save({**good, "model": "nope"}, p),
        "config.pt": lambda p: torch.save({**good, "config": {"embed_size": -1}}, p),
        "weights.pt": lambda p: torch.save({**good, "state_dict": {"x": torch.zeros(1)}}, p),
        "info.pt": lambda p: torch.save({**good, "info": {"bogus": 1}}, p),
        "pickle.pt": lambda p: p.write_bytes(pickle.dumps(Path("/"))),
        "truncated.pt": lambda p: (torch.save(good, p), p.write_bytes(p.read_bytes()[:200])),
        "folder.pt": lambda p: p.mkdir(),
    }
    for name, make in files.items():
        make(tmp_path / name)
    return [tmp_path / name for name in files], good


def test_files_that_are_not_checkpoints_are_one_line_errors(tmp_path, data, repo_root, capsys):
    from flows.cli import main
    from models.train import TrainingError, load_checkpoint

    paths, good = not_checkpoints(tmp_path, data)
    torch.save(good, tmp_path / "good.pt")
    model, _ = load_checkpoint(tmp_path / "good.pt")  # the reference loads
    for path in paths:
        with pytest.raises(TrainingError) as err:
            load_checkpoint(path)
        message = str(err.value)
        assert message.startswith(f"{path}: ") and "\n" not in message, message
    argv = ["--params", str(repo_root / "params.yaml"), "evaluate", "vsepp", "--checkpoint"]
    rest = ["--manifest", str(tmp_path / "m.parquet"), "--out", str(tmp_path / "o.json")]
    assert main([*argv, str(tmp_path / "random.pt"), *rest]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'random.pt'}: ") and err.count("\n") == 1
    assert not (tmp_path / "o.json").exists()


def test_each_checkpoint_failure_says_what_the_file_is_and_what_to_do(tmp_path, data):
    """The exact lines: what is wrong with the file, the error torch or pydantic gave where
    there is one, then the same hint."""
    from models.train import TrainingError, load_checkpoint

    hint = "; give best.pt or last.pt as `vse train` writes them (dvc repro train@MODEL)"
    not_checkpoints(tmp_path, data)

    def message(name: str) -> str:
        with pytest.raises(TrainingError) as err:
            load_checkpoint(tmp_path / name)
        return str(err.value)

    assert message("none.pt") == (
        f"{tmp_path / 'none.pt'}: no checkpoint; run `vse train` (dvc repro train@MODEL)"
    )
    assert message("missing.pt") == (
        f"{tmp_path / 'missing.pt'}: not a checkpoint of this trainer (no config, info, "
        f"state_dict){hint}"
    )
    assert (
        message("unknown.pt")
        == f"{tmp_path / 'unknown.pt'}: a checkpoint of unknown model 'nope'{hint}"
    )
    loads = "a vsepp checkpoint whose config or weights do not load"
    for name, error in (("config.pt", "ValidationError"), ("weights.pt", "RuntimeError")):
        text = message(name)
        head = f"{tmp_path / name}: {loads} ({error}: "
        assert text.startswith(head) and text.endswith(f"){hint}"), text
        assert len(text) > len(head) + len(hint) + 20  # the error's own words are there
    assert message("text.pt").endswith(hint)


def test_a_checkpoint_loads_onto_the_device_asked_in_eval_mode(tmp_path, data):
    from models.train import load_checkpoint

    _, good = not_checkpoints(tmp_path, data)
    torch.save(good, tmp_path / "good.pt")
    model, info = load_checkpoint(tmp_path / "good.pt", device="meta")
    assert {p.device.type for p in model.parameters()} == {"meta"} and not model.training
    assert (
        info.to_dict() == good["info"] if hasattr(info, "to_dict") else vars(info) == good["info"]
    )


# ----------------------------------------------------------------------------- the numbers
# Independent references: R@K written by hand on small known similarities, and naive
# per-query loops on random ones.


class Embeddings(torch.nn.Module):
    """A fake model whose encoders return the batch's ready embeddings ("image", "text");
    its similarity is the inner product."""

    def encode_image(self, batch):
        return batch["image"]

    def encode_text(self, batch):
        return batch["text"]

    def similarity(self, img, txt):
        return img @ txt.t()


class Classifying(Embeddings):
    """... that classifies by looking each embedding up among the images' and captions'
    and returning the log of its row of ``probabilities`` (so its softmax is that row,
    exactly); images must come with ``side`` "image", captions with "text"."""

    def __init__(self, img, txt, probabilities):
        super().__init__()
        self.vectors, self.n_images = torch.cat([img, txt]), len(img)
        self.log_p = torch.log(torch.as_tensor(probabilities))

    def classify(self, emb, side):
        match = (emb[:, None, :] == self.vectors[None]).all(-1)  # (n, N)
        assert match.sum(1).eq(1).all(), "an embedding that is not in the table"
        index = match.float().argmax(1)
        assert side in ("image", "text") and (index < self.n_images).all() == (side == "image")
        return self.log_p[index]


class Linear(Embeddings):
    """... that classifies with one linear layer."""

    def __init__(self, dim, n_classes):
        super().__init__()
        self.layer = torch.nn.Linear(dim, n_classes)

    def classify(self, emb, side):
        return self.layer(emb)


class Split:
    """A split of ready embeddings, with ``PairData``'s interface."""

    def __init__(self, img, txt, caption_image, labels=None, attacks=None, val=None):
        self.img, self.txt = torch.as_tensor(img).float(), torch.as_tensor(txt).float()
        self.caption_image = np.asarray(caption_image, dtype=np.int64)
        self.n_images, self.split = len(self.img), "test"
        self.labels = None if labels is None else np.asarray(labels, dtype=np.int64)
        self.attacks = None if attacks is None else np.asarray(attacks)
        self.val = val  # the Split that other_split("val") gives

    def other_split(self, split):
        assert split == "val"
        if self.val is None:  # as PairData says it
            raise DataError(f"manifest.parquet: split {split!r} has no images")
        return self.val

    def __len__(self):
        return len(self.txt)

    def image_batch(self, index):
        return {"image": self.img[index]}

    def text_batch(self, index):
        return {"text": self.txt[index]}


# S[i][c] x 10, caption c of image c // 2 (two per image); one tie: S[0][0] = S[3][0]
S = [
    [9.0, 7, 3, 2, 1, 8, 6, 4],  # GT 9, 7: nothing above 9              -> rank 0
    [5.0, 4, 8, 3, 2, 1, 9, 0],  # GT 8, 3: 9 above 8                     -> rank 1
    [8.0, 3, 9, 2, 6, 1, 7, 5],  # GT 6, 1: 8, 9, 7 above 6               -> rank 3
    [9.0, 6, 7, 8, 5, 0, 4, 2],  # GT 4, 2: 9, 6, 7, 8, 5 above 4         -> rank 5
]
# fake captions: their attack and scores x 10 with images 0-3 (the fakes of one attack
# are candidates of that attack's retrieval only)
FAKES = [
    ("relation", [0.0, 0, 7, 4.5]),  # beats image 2's 6 and image 3's 4: ranks 0 1 4 6
    ("object", [9.5, 0, 0, 0]),  # beats image 0's 9; with the next one: ranks 1 2 3 5
    ("attribute", [0.0, 0, 6.5, 0]),  # beats image 2's 6: ranks 0 1 4 5
    ("object", [0.0, 8.5, 5, 0]),  # beats image 1's 8, not image 2's 6
]


# i2t ranks 0 1 3 5: R@1 1/4, R@5 3/4, R@10 4/4, medr floor(2) + 1, meanr 9/4 + 1.
# t2i, per caption the images above its own: c0 none (S[3][0] = 9 ties: optimistic),
# c1 none, c2 i2, c3 i3, c4 none, c5 i0, c6 i0 i1 i2, c7 i0 i2: ranks 0 0 1 1 0 1 3 2,
# R@1 3/8, R@5 = R@10 = 8/8, medr floor(1) + 1, meanr 8/8 + 1
FULL = {"i2t_r1": 25.0, "i2t_r5": 75.0, "i2t_r10": 100.0, "i2t_medr": 3.0, "i2t_meanr": 3.25}
FULL |= {"t2i_r1": 37.5, "t2i_r5": 100.0, "t2i_r10": 100.0, "t2i_medr": 2.0, "t2i_meanr": 2.0}
FULL |= {"rsum": 437.5}


def hand_split():
    """The split of S (images: the unit vectors, so image i . caption c = S[i][c] / 10)
    and its fake captions."""
    data = Split(torch.eye(4), torch.tensor(S).t() / 10, np.arange(8) // 2)
    fakes = torch.tensor([scores for _, scores in FAKES]) / 10
    adversarial = Split(torch.eye(4), fakes, [2, 0, 2, 1], attacks=[a for a, _ in FAKES])
    return data, adversarial


def test_evaluate_model_by_hand():
    """Whole split, COCO-1K-style folds and adversarial captions on a 4 x 8 similarity
    whose every R@K, medr and meanr is counted by hand in the comments."""
    data, adversarial = hand_split()
    cfg = EvaluateConfig(batch_size=3, fold_size=2, device="cpu")
    with pytest.warns(UserWarning, match="evaluate.fold_size: folds of 2 images are not the COCO"):
        report = evaluate_model(Embeddings(), data, cfg, torch.device("cpu"), adversarial)
    assert (report["split"], report["images"], report["captions"]) == ("test", 4, 8)
    assert "classification" not in report  # the model does not classify
    assert report["full"] == pytest.approx(FULL)  # counted above FULL
    # fold 0 (images 0-1, captions 0-3): every rank 0 -> 100s, medr = meanr = 1, rsum 600.
    # fold 1 (images 2-3, captions 4-7): i2t: image 2 GT 6 under 7, image 3 GT 4 under 5:
    # ranks 1 1 -> R@1 0, medr 2, meanr 2; t2i: c4 0, c5 0, c6 (4 < 7) 1, c7 (2 < 5) 1 ->
    # R@1 50, medr floor(0.5) + 1 = 1, meanr 1.5; rsum 450. The mean of both folds:
    folds = {"fold_size": 2, "n_folds": 2, "i2t_r1": 50.0, "i2t_r5": 100.0}
    folds |= {"i2t_r10": 100.0, "i2t_medr": 1.5, "i2t_meanr": 1.5, "t2i_r1": 75.0}
    folds |= {"t2i_r5": 100.0, "t2i_r10": 100.0, "t2i_medr": 1.0, "t2i_meanr": 1.25}
    folds |= {"rsum": 525.0, "captions": 8, "left_out": 0}
    assert report["folds"] == pytest.approx(folds)
    assert type(report["folds"]["n_folds"]) is int  # a count, also in the JSON

    # adversarial: i2t only; the fakes are candidates, never ground truth
    def i2t(r1, r5, r10, medr, meanr, n):
        return {
            "i2t_r1": r1,
            "i2t_r5": r5,
            "i2t_r10": r10,
            "i2t_medr": medr,
            "i2t_meanr": meanr,
            "fake_captions": n,
        }

    assert report["adversarial"].keys() == {"object", "attribute", "relation"}
    with warnings.catch_warnings(), made_elsewhere():  # every tensor on the embeddings' device
        warnings.simplefilter("ignore")
        again = evaluate_model(Embeddings(), data, cfg, torch.device("cpu"), adversarial)
    assert again["adversarial"] == report["adversarial"]
    assert report["adversarial"]["object"] == pytest.approx(i2t(0, 75, 100, 3, 3.75, 2))
    assert report["adversarial"]["attribute"] == pytest.approx(i2t(25, 75, 100, 3, 3.5, 1))
    assert report["adversarial"]["relation"] == pytest.approx(i2t(25, 75, 100, 3, 3.75, 1))
    # no folds when fewer than two fit
    one = EvaluateConfig(batch_size=3, fold_size=3, device="cpu")
    assert "folds" not in evaluate_model(Embeddings(), data, one, torch.device("cpu"))
    none = EvaluateConfig(batch_size=3, fold_size=None, device="cpu")
    assert "folds" not in evaluate_model(Embeddings(), data, none, torch.device("cpu"))


def test_images_after_the_last_fold_are_counted_and_1k_folds_are_not_warned():
    """5 images in folds of 2: two folds (captions 0-7), image 4 and its 2 captions left
    out; folds of 1000 on 2000 images raise no warning."""
    cpu = torch.device("cpu")
    five = Split(torch.eye(5), torch.eye(5).repeat_interleave(2, dim=0), np.arange(10) // 2)
    with pytest.warns(UserWarning, match="not the COCO 1K protocol") as record:
        report = evaluate_model(Embeddings(), five, EvaluateConfig(fold_size=2, device="cpu"), cpu)
    # the warning names the line that evaluated; under mutmut, the trampoline's line that
    # called the function (two trampoline frames stand between it and its caller)
    line = linecache.getline(record[0].filename, record[0].lineno)
    if Path(__file__).parent.parent.name == "mutants":  # mutmut's copy of the tree
        assert Path(record[0].filename).name == "trampoline.py" and "func(*call_args" in line
    else:
        assert Path(record[0].filename).name == Path(__file__).name
    assert report["folds"]["left_out"] == 1 and report["folds"]["captions"] == 8
    img = torch.eye(2000)[:, :64] + torch.eye(2000)[:, 64:128]  # any 2000 vectors
    coco = Split(img, img.repeat_interleave(2, dim=0), np.arange(4000) // 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = evaluate_model(Embeddings(), coco, EvaluateConfig(device="cpu"), cpu)
    assert report["folds"]["n_folds"] == 2 and report["folds"]["left_out"] == 0


def unit(degrees):
    """2-D unit vectors at these angles: inner products are cos(angle between)."""
    rad = torch.tensor(degrees, dtype=torch.float64) * math.pi / 180
    return torch.stack([rad.cos(), rad.sin()], 1).float()


IMAGE_ANGLES, IMAGE_LABELS = [0, 47, 121, 252], [0, 0, 1, 2]
CAPTION_ANGLES = [9, 311, 63, 174, 113, 258, 237, 86]  # captions 2i and 2i + 1 of image i
P_IMAGE = [[0.7, 0.2, 0.1], [0.3, 0.6, 0.1], [0.1, 0.8, 0.1], [0.5, 0.1, 0.4]]
P_TEXT = [
    [0.4, 0.5, 0.1],  # wrong (1 for 0); fused with image 0: .55 .35 .10 -> 0, right
    [0.6, 0.3, 0.1],  # right; fused .65 .25 .10, right
    [0.55, 0.15, 0.3],  # right; image 1 is wrong; fused .425 .375 .2 -> 0, right
    [0.2, 0.7, 0.1],  # wrong; fused .25 .65 .1 -> 1, wrong
    [0.3, 0.3, 0.4],  # wrong (2 for 1); fused with image 2: .2 .55 .25 -> 1, right
    [0.2, 0.7, 0.1],  # right; fused .15 .75 .1, right
    [0.1, 0.2, 0.7],  # right; fused with image 3: .3 .15 .55 -> 2, right
    [0.4, 0.15, 0.45],  # right; fused .45 .125 .425 -> 0, wrong
]


# a val split of 2 images (classes 0, 1) and their captions whose fused accuracy is 100%
# for image weights w in (3/11, 1/3) only, i.e. w = 0.3 of the grid (50% elsewhere):
# caption 0 (class 0): .9w + .35(1 - w) > .5 iff w > 3/11; caption 1 (class 1):
# .1w + .7(1 - w) > .5 iff w < 1/3
VAL_IMAGE_ANGLES, VAL_CAPTION_ANGLES = [30, 150], [200, 280]
P_VAL_IMAGE = [[0.9, 0.1, 0.0], [0.9, 0.1, 0.0]]
P_VAL_TEXT = [[0.35, 0.65, 0.0], [0.3, 0.7, 0.0]]


def test_classification_by_hand():
    """HUSE's evaluation on 4 images (classes 0 0 1 2) and 8 captions in the plane, with
    softmaxes chosen by hand (P_IMAGE, P_TEXT): accuracy image 2/4 (images 1 and 3 are
    wrong), text 5/8, fused with equal weights 6/8 (see P_TEXT); the image weight chosen
    on val is 0.3 (see P_VAL_IMAGE), with which captions 3 (.23 .67 .10 -> 1) stays wrong
    and 7 (.43 .135 .435 -> 2) turns right: 7/8."""
    img, txt = unit(IMAGE_ANGLES), unit(CAPTION_ANGLES)
    val_img, val_txt = unit(VAL_IMAGE_ANGLES), unit(VAL_CAPTION_ANGLES)
    val = Split(val_img, val_txt, [0, 1], labels=[0, 1])
    data = Split(img, txt, np.arange(8) // 2, labels=IMAGE_LABELS, val=val)
    model = Classifying(
        torch.cat([img, val_img]),
        torch.cat([txt, val_txt]),
        P_IMAGE + P_VAL_IMAGE + P_TEXT + P_VAL_TEXT,
    )
    cfg = EvaluateConfig(batch_size=3, fold_size=4, device="cpu")
    got = evaluate_model(model, data, cfg, torch.device("cpu"))["classification"]
    with made_elsewhere():  # every tensor it makes or moves is on the embeddings' device
        assert evaluate_model(model, data, cfg, torch.device("cpu"))["classification"] == got
    want = {
        "accuracy_image": 50.0,
        "accuracy_text": 62.5,
        "accuracy_fused": 87.5,
        "accuracy_fused_equal": 75.0,
        "fusion_weight_image": 0.3,
    }
    # class-level R@K, the nearest by angle (a hit: the query's class):
    # image -> text: image 0 c0 (9 deg, class 0), image 1 c2 (16), image 2 c4 (8), image 3
    #   c5 (6 deg, class 1: a miss); R@5: each image has its own captions in its top 5
    # text -> image: c0 i0, c1 i0, c2 i1, c3 i2 (miss), c4 i2, c5 i3 (miss), c6 i3,
    #   c7 i2 (miss): 5/8; the 4 images hold every class: R@5 = R@10 = 100
    # image -> image (itself excluded): image 0 i1 (47 deg) and image 1 i0 hit; images 2
    #   and 3 are alone in their class: no hit at any K
    # text -> text (itself excluded): only c0's nearest (c2, 54 deg) shares its class;
    #   at 5: c4 (class 1: c5 is 6th), c6 and c7 (class 2: the other is 6th) miss
    for name, values in {
        "image_to_text": (75.0, 100.0, 100.0),
        "text_to_image": (62.5, 100.0, 100.0),
        "image_to_image": (50.0, 50.0, 50.0),
        "text_to_text": (12.5, 62.5, 100.0),
    }.items():
        want |= {f"class_{name}_r{k}": v for k, v in zip((1, 5, 10), values, strict=True)}
    assert got == pytest.approx(want)


def test_without_a_val_split_the_fusion_weighs_equally_and_says_so():
    img, txt = unit(IMAGE_ANGLES), unit(CAPTION_ANGLES)
    data = Split(img, txt, np.arange(8) // 2, labels=IMAGE_LABELS)
    model = Classifying(img, txt, P_IMAGE + P_TEXT)
    cfg = EvaluateConfig(batch_size=3, fold_size=4, device="cpu")
    with pytest.warns(UserWarning, match="'val' has no images: the fused accuracy weighs") as w:
        got = evaluate_model(model, data, cfg, torch.device("cpu"))["classification"]
    # it names the line that asked for the weight; under mutmut, the trampoline's line that
    # called the function (two trampoline frames stand between it and its caller)
    line = linecache.getline(w[0].filename, w[0].lineno)
    if Path(__file__).parent.parent.name == "mutants":  # mutmut's copy of the tree
        assert Path(w[0].filename).name == "trampoline.py" and "func(*call_args" in line
    else:
        assert "= val_fusion_weight(" in line
    assert got["fusion_weight_image"] == 0.5
    assert got["accuracy_fused"] == got["accuracy_fused_equal"] == 75.0


@pytest.mark.parametrize(
    "text_1, best",
    [
        ([0.2, 0.8, 0.0], 0.4),  # all right for w in (1/3, 3/7): 0.35, 0.4; 0.4 nearest 0.5
        ([0.05, 0.95, 0.0], 0.5),  # (1/3, 9/17): 0.35 .. 0.5 tie; equal weights among them
    ],
)
def test_fusion_weight_ties_go_to_the_weight_nearest_equal(text_1, best):
    """Caption 0 (class 0) is right iff .3 + .6w > .5 (w > 1/3); caption 1 (class 1),
    image [.9 .1], iff .1w + t(1 - w) > .5 with t caption 1's class-1 probability."""
    img, txt = unit([30, 150]), unit([200, 280])
    val = Split(img, txt, [0, 1], labels=[0, 1])
    p = [[0.9, 0.1, 0.0], [0.9, 0.1, 0.0], [0.3, 0.7, 0.0], text_1]
    assert fusion_weight(Classifying(img, txt, p), img, txt, val) == best


def test_when_every_weight_ties_the_fusion_weighs_equally():
    """Both images and both captions classified right alone: every weight of the grid
    gives 100%, and the tie goes to equal weights."""
    img, txt = unit([30, 150]), unit([200, 280])
    val = Split(img, txt, [0, 1], labels=[0, 1])
    p = [[0.9, 0.1, 0.0], [0.1, 0.9, 0.0], [0.8, 0.2, 0.0], [0.2, 0.8, 0.0]]
    assert fusion_weight(Classifying(img, txt, p), img, txt, val) == 0.5


def test_evaluating_the_val_split_chooses_its_weight_on_itself():
    """On the val split, the weight is chosen on the embeddings being evaluated (no second
    pass over another split): P_VAL_IMAGE / P_VAL_TEXT give 0.3 and 100% fused."""
    val_img, val_txt = unit(VAL_IMAGE_ANGLES), unit(VAL_CAPTION_ANGLES)
    val = Split(val_img, val_txt, [0, 1], labels=[0, 1])
    val.split = "val"
    model = Classifying(val_img, val_txt, P_VAL_IMAGE + P_VAL_TEXT)
    cfg = EvaluateConfig(batch_size=3, fold_size=2, device="cpu")
    got = evaluate_model(model, val, cfg, torch.device("cpu"))["classification"]
    assert got["fusion_weight_image"] == 0.3 and got["accuracy_fused"] == 100.0


# naive references on random embeddings


def naive_class_recall(query, gallery, q_labels, g_labels, same_set):
    """Per query: the gallery sorted by inner product (the query itself left out when
    both are the same set); a hit at K when one of the first K has the query's class."""
    hits = {1: 0, 5: 0, 10: 0}
    for q in range(len(query)):
        scored = [
            (float(query[q] @ gallery[g]), g)
            for g in range(len(gallery))
            if not (same_set and g == q)
        ]
        ranked = [g for _, g in sorted(scored, reverse=True)]
        for k in hits:
            hits[k] += any(g_labels[g] == q_labels[q] for g in ranked[:k])
    return {f"r{k}": 100.0 * v / len(query) for k, v in hits.items()}


def softmax(row):
    e = [math.exp(v) for v in row]
    return [v / sum(e) for v in e]


def argmax(row):
    return max(range(len(row)), key=lambda j: row[j])


@pytest.mark.parametrize("n_images, paired", [(5, False), (9, False), (14, False), (8, True)])
def test_classification_metrics_match_loops(n_images, paired):
    """Accuracy of each modality and fused (softmaxes weighted 0.3 : 0.7, and averaged),
    class-level R@K in the four directions, against loops; galleries smaller and larger
    than K = 10, and (paired) caption i of image i close to it: image i and caption i are
    not the same item."""
    rng = np.random.default_rng(n_images)
    n_classes, dim = 4, 6
    c2i = np.sort(rng.integers(0, n_images, size=2 * n_images))
    labels = rng.integers(0, n_classes, size=n_images)
    img = torch.from_numpy(rng.normal(size=(n_images, dim))).float()
    txt = torch.from_numpy(rng.normal(size=(len(c2i), dim))).float()
    if paired:
        c2i = np.arange(n_images)
        txt = img + 0.05 * torch.from_numpy(rng.normal(size=img.shape)).float()
    torch.manual_seed(n_images)
    model = Linear(dim, n_classes)
    linear = model.layer
    data = Split(img, txt, c2i, labels=labels)
    got = classification_metrics(model, img, txt, data, w=0.3)

    with torch.no_grad():
        p_img = [softmax(r) for r in linear(img).tolist()]
        p_txt = [softmax(r) for r in linear(txt).tolist()]
    text_labels = [int(labels[i]) for i in c2i]

    def fused(w):
        return [
            [w * a + (1 - w) * b for a, b in zip(p_img[i], p_txt[c], strict=True)]
            for c, i in enumerate(c2i)
        ]

    def accuracy(probabilities, truth):
        right = [argmax(p) == y for p, y in zip(probabilities, truth, strict=True)]
        return 100.0 * sum(right) / len(right)

    want = {
        "accuracy_image": accuracy(p_img, labels),
        "accuracy_text": accuracy(p_txt, text_labels),
        "accuracy_fused": accuracy(fused(0.3), text_labels),
        "accuracy_fused_equal": accuracy(fused(0.5), text_labels),
        "fusion_weight_image": 0.3,
    }
    directions = {
        "image_to_text": (img, txt, labels, text_labels, False),
        "text_to_image": (txt, img, text_labels, labels, False),
        "image_to_image": (img, img, labels, labels, True),
        "text_to_text": (txt, txt, text_labels, text_labels, True),
    }
    for name, args in directions.items():
        want |= {f"class_{name}_{k}": v for k, v in naive_class_recall(*args).items()}
    assert got == pytest.approx(want)
    # not vacuous: keeping the self-match would give 100
    assert want["class_image_to_image_r1"] < 100 and want["class_text_to_text_r1"] < 100
    assert not paired or want["class_image_to_text_r1"] == 100  # each its own caption


def test_classification_uses_each_modalitys_layer():
    """HUSE without the shared layer classifies images and captions with their own."""
    from models.huse import HUSE, HUSEConfig

    pairs = TinyPairs(n_images=6, captions_per_image=2)
    torch.manual_seed(0)
    model = HUSE(HUSEConfig(hidden=16, shared_classifier=False), pairs.info).eval()
    img = torch.nn.functional.normalize(torch.randn(6, 16), dim=1)
    txt = torch.nn.functional.normalize(torch.randn(12, 16), dim=1)
    got = classification_metrics(model, img, txt, pairs)
    with torch.no_grad():
        right_img = model.classifier(img).argmax(1).numpy() == pairs.labels
        text_labels = pairs.labels[pairs.caption_image]
        right_txt = model.text_classifier(txt).argmax(1).numpy() == text_labels
        wrong_txt = model.classifier(txt).argmax(1).numpy() == text_labels
    assert got["accuracy_image"] == pytest.approx(100 * right_img.mean())
    assert got["accuracy_text"] == pytest.approx(100 * right_txt.mean())
    assert right_txt.mean() != wrong_txt.mean()  # the layers differ on these captions
    assert got["fusion_weight_image"] == 0.5  # without a val-chosen weight: equal fusion


def naive_i2t(sims, c2i):
    """Per image: the candidates scoring above its best caption (ties optimistic); fakes
    (image -1) are candidates, never ground truth."""
    ranks = []
    for i in range(sims.shape[0]):
        best = max(sims[i, c] for c in range(len(c2i)) if c2i[c] == i)
        ranks.append(sum(1 for c in range(len(c2i)) if sims[i, c] > best))
    ranks = np.array(ranks)
    out = {f"i2t_r{k}": 100.0 * np.mean(ranks < k) for k in (1, 5, 10)}
    return out | {"i2t_medr": np.floor(np.median(ranks)) + 1, "i2t_meanr": ranks.mean() + 1}


@pytest.mark.parametrize("seed, scores", [(0, 2**24), (1, 2**24), (2, 1), (3, 100)])
def test_adversarial_metrics_match_loops(seed, scores, monkeypatch):
    """Each attack's fakes join the real captions as candidates of image-to-text
    retrieval (and only that attack's); they are never a hit. The same figures whether
    the scores are made at once or a block of images at a time (here 1 and 2 images)."""
    import models.evaluate
    import models.metrics

    blocks = functools.partial(models.metrics.i2t_metrics, max_elements=scores)
    monkeypatch.setattr(models.evaluate, "i2t_metrics", blocks)
    rng = np.random.default_rng(seed)
    n_images, dim = 12, 5
    c2i = np.repeat(np.arange(n_images), 3)
    img = rng.normal(size=(n_images, dim))
    txt = img[c2i] + 1.2 * rng.normal(size=(len(c2i), dim))
    source = rng.integers(0, n_images, size=20)
    fake = img[source] + 1.2 * rng.normal(size=(20, dim))  # close to the image they attack
    attacks = rng.choice(["object", "attribute", "relation"], size=20)
    data = Split(img, txt, c2i)
    adversarial = Split(img, fake, source, attacks=attacks)
    img, txt = data.img, data.txt
    got = adversarial_metrics(Embeddings(), img, txt, data, adversarial, 7, torch.device("cpu"))
    clean = naive_i2t((img @ txt.t()).numpy(), c2i)
    assert got.keys() == {"object", "attribute", "relation"}
    for attack, metrics in got.items():
        cols = np.flatnonzero(attacks == attack)
        candidates = torch.cat([txt, adversarial.txt[cols]])
        owner = np.concatenate([c2i, -np.ones(len(cols), dtype=np.int64)])
        want = naive_i2t((img @ candidates.t()).numpy(), owner)
        assert metrics == pytest.approx(want | {"fake_captions": len(cols)}), attack
        assert want["i2t_meanr"] > clean["i2t_meanr"]  # the fakes did push real captions down
    with made_elsewhere():  # every tensor it makes is on the embeddings' device
        again = adversarial_metrics(Embeddings(), img, txt, data, adversarial, 7, img.device)
    assert again == got


def test_evaluate_model_of_a_real_model_matches_its_direct_embeddings(data):
    """Batched through the data path, then ranked: the same numbers as the model's own
    encoders on the whole split at once, ranked by the loop."""
    model = model_for(data)
    report = evaluate_model(model, data, CFG, torch.device("cpu"))
    with torch.no_grad():
        img = model.encode_image(data.image_batch(np.arange(data.n_images)))
        txt = model.encode_text(data.text_batch(np.arange(len(data))))
    want = naive_i2t((img @ txt.t()).numpy(), data.caption_image)
    assert {k: v for k, v in report["full"].items() if k.startswith("i2t")} == pytest.approx(want)
    assert report["folds"]["n_folds"] == 2 and report["folds"]["fold_size"] == 4


def test_given_embeddings_are_not_computed_again():
    class Refusing(Embeddings):
        def encode_image(self, batch):
            raise AssertionError("the embeddings were given")

        encode_text = encode_image

    data, _ = hand_split()
    cfg = EvaluateConfig(batch_size=3, fold_size=4, device="cpu")
    cpu = torch.device("cpu")
    report = evaluate_model(Refusing(), data, cfg, cpu, embeddings=(data.img, data.txt))
    assert report["full"] == pytest.approx(FULL)


def test_evaluate_split_and_the_encoders_alone():
    """Without a reader given, each builds its own (``vse train``'s validation passes one)."""
    data, _ = hand_split()
    cpu = torch.device("cpu")
    assert evaluate_split(Embeddings(), data, 3, cpu) == pytest.approx(FULL)
    with made_elsewhere():  # every tensor on the embeddings' device
        assert evaluate_split(Embeddings(), data, 3, cpu) == pytest.approx(FULL)
    torch.testing.assert_close(encode_images(Embeddings(), data, 3, cpu), data.img)
    torch.testing.assert_close(encode_texts(Embeddings(), data, 3, cpu, n=5), data.txt[:5])


def test_each_source_is_read_once_by_the_configured_readers(monkeypatch):
    """The split through one reader with evaluate's num_workers and prefetch, the fake
    captions through another."""
    import models.data.batches

    made = []

    class Counted(models.data.batches.Batches):
        def __init__(self, source, device, **options):
            made.append((source, options))
            super().__init__(source, device, **options)

    monkeypatch.setattr(models.data.batches, "Batches", Counted)
    data, adversarial = hand_split()
    cfg = EvaluateConfig(batch_size=3, fold_size=2, device="cpu", prefetch=3)
    report = evaluate_model(Embeddings(), data, cfg, torch.device("cpu"), adversarial)
    options = {"num_workers": 0, "prefetch": 3}
    assert made == [(data, options), (adversarial, options)]
    assert report["full"] == pytest.approx(FULL)
    # validation during training: the reader it is given, no other
    made.clear()
    with Counted(data, torch.device("cpu")) as batches:
        assert evaluate_split(Embeddings(), data, 3, torch.device("cpu"), batches) == pytest.approx(
            FULL
        )
    assert len(made) == 1


def test_a_caption_with_nan_embedding_is_refused_by_key():
    data, _ = hand_split()
    data.txt[[1, 4, 5], 2] = float("nan")
    cfg = EvaluateConfig(batch_size=3, fold_size=2, device="cpu")
    cpu = torch.device("cpu")
    with pytest.raises(NonFiniteError, match="^the embedding of caption 1 holds NaN or infin"):
        evaluate_model(Embeddings(), data, cfg, cpu)
    data.caption_keys = [f"im{c // 2}#{c % 2}" for c in range(8)]
    with pytest.raises(NonFiniteError) as err:
        evaluate_model(Embeddings(), data, cfg, cpu)
    assert str(err.value) == (
        "the embedding of caption 'im0#1' holds NaN or infinite values (and 2 more); check "
        "that caption's features in its store (vse store verify) and the checkpoint's weights"
    )
    data.txt[4, 2] = 0.0
    with pytest.raises(
        NonFiniteError, match=r"^the embedding of caption 'im0#1' .* \(and 1 more\);"
    ):
        evaluate_model(Embeddings(), data, cfg, cpu)
    data.txt[5, 2] = 0.0  # one left: no "(and ... more)"
    with pytest.raises(NonFiniteError) as err:
        evaluate_model(Embeddings(), data, cfg, cpu)
    assert str(err.value).startswith(
        "the embedding of caption 'im0#1' holds NaN or infinite values; check that caption's"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_evaluation_on_cuda_by_hand():
    """The hand-made cases on the GPU: every index and label moved to the scores' device
    (on the CPU a tensor left behind goes unnoticed)."""
    cuda = torch.device("cuda")
    data, adversarial = hand_split()
    cfg = EvaluateConfig(batch_size=3, fold_size=2, device="cuda")
    report = evaluate_model(Embeddings(), data, cfg, cuda, adversarial)
    assert report["full"] == pytest.approx(FULL) and report["folds"]["rsum"] == 525.0
    assert report["adversarial"]["object"]["i2t_r1"] == 0.0
    sims = torch.tensor(S, device=cuda) / 10
    assert retrieval_metrics(sims, np.arange(8) // 2, chunk=3) == pytest.approx(FULL)
    assert fold_metrics(sims, np.arange(8) // 2, fold_size=2)["rsum"] == 525.0
    assert similarity_matrix(lambda a, b: a @ b.t(), data.img.cuda(), data.txt.cuda(), 9).is_cuda
    img, txt = unit(IMAGE_ANGLES), unit(CAPTION_ANGLES)
    split = Split(img, txt, np.arange(8) // 2, labels=IMAGE_LABELS)
    model = Classifying(img.to(cuda), txt.to(cuda), P_IMAGE + P_TEXT)
    got = classification_metrics(model, img.to(cuda), txt.to(cuda), split)
    assert got["accuracy_fused"] == 75.0 and got["class_text_to_text_r5"] == 62.5
