"""Property-based: every reader of user files (Karpathy JSON, Food-101 CSV, precomp,
bottom-up-attention TSV, params.yaml), fed random and mutated inputs, ends in a result
or a one-line error the CLI prints (``UserError`` / ``ConfigError``), never another
exception. Examples are few and derandomized: the file runs in seconds, the same way
every time."""

import base64
import io
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from features.exchange.butd_tsv import import_butd_tsv
from features.exchange.precomp import import_precomp
from features.ingest.manifest import read_manifest
from features.ingest.prepare import prepare
from features.ingest.readers import PrepareConfig
from features.store.spec import StoreConfig
from flows.params import load_params
from infra.config import ConfigError, UserError

REPO = Path(__file__).parent.parent
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,  # no .hypothesis folder in the repository
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
LAYOUT = StoreConfig(samples_per_shard=4, samples_per_chunk=2)


def one_line(err: BaseException) -> None:
    message = str(err)
    assert message and "\n" not in message.strip() or isinstance(err, ConfigError), message


def mutated(data: bytes):
    """``data`` with a few bytes flipped, deleted, inserted, or cut short."""
    edit = st.tuples(
        st.sampled_from(["flip", "delete", "insert", "cut"]),
        st.integers(0, max(len(data) - 1, 0)),
        st.integers(0, 255),
    )

    def apply(edits):
        out = bytearray(data)
        for op, pos, value in edits:
            pos = min(pos, max(len(out) - 1, 0))
            if op == "flip" and out:
                out[pos] ^= value or 1
            elif op == "delete" and out:
                del out[pos]
            elif op == "insert":
                out.insert(pos, value)
            elif op == "cut":
                del out[pos:]
        return bytes(out)

    return st.lists(edit, min_size=1, max_size=4).map(apply)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    for name in ("a.jpg", "b.jpg", "sub/c.jpg", "d e.jpg"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"\x89PNG fake")
    (root / "adir.jpg").mkdir()
    return root


def run_prepare(annotations: bytes, name: str, images: Path, fmt: str):
    """``vse prepare``'s core on the given file: a summary, or a UserError."""
    folder = Path(tempfile.mkdtemp())
    try:
        path = folder / name
        path.write_bytes(annotations)
        cfg = PrepareConfig(format=fmt, max_error_fraction=1.0, captions_per_image=2)
        out = folder / "out"
        try:
            summary = prepare(
                path, images, cfg, out / "m.parquet", out / "e.csv", out / "j.json", log=str
            )
        except UserError as err:
            one_line(err)
            return None
        assert read_manifest(out / "m.parquet").table.num_rows == summary["records_kept"]
        return summary
    finally:
        shutil.rmtree(folder)


# --------------------------------------------------------------------------- Karpathy JSON

NAMES = st.sampled_from(["a.jpg", "b.jpg", "c.jpg", "adir.jpg", "d e.jpg", "../x.jpg", "", "/a"])
ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=12,
)
FIELD = st.one_of(ANY, st.integers(-(2**40), 2**40))
BOX = st.lists(st.one_of(st.floats(), st.integers(-(2**40), 2**40), st.text(max_size=2)))
IMAGE = st.fixed_dictionaries(
    {},
    optional={
        "filename": NAMES | st.text(max_size=12) | ANY,
        "filepath": st.sampled_from(["", "sub", "..", None]) | ANY,
        "split": st.sampled_from(["train", "val", "test", "restval", "dev"]) | ANY,
        "sentences": st.lists(
            st.fixed_dictionaries({}, optional={"raw": st.text(max_size=20) | ANY}), max_size=3
        )
        | ANY,
        "label": FIELD,
        "boxes": st.lists(BOX, max_size=3) | FIELD,
        "box_names": st.lists(st.text(max_size=4) | FIELD, max_size=3) | FIELD,
    },
)
KARPATHY = st.fixed_dictionaries(
    {"images": st.lists(IMAGE, max_size=6) | ANY},
    optional={"dataset": ANY, "class_names": st.lists(st.text(max_size=4), max_size=4) | ANY},
)


@SETTINGS
@given(data=KARPATHY)
def test_karpathy_json_of_any_shape(images, data):
    run_prepare(json.dumps(data).encode(), "dataset.json", images, "karpathy")


VALID_KARPATHY = json.dumps(
    {
        "dataset": "x",
        "class_names": ["cat", "dog"],
        "images": [
            {
                "filename": name,
                "split": split,
                "label": i % 2,
                "boxes": [[0, 0, 2, 3]],
                "box_names": ["cat"],
                "sentences": [{"raw": f"a cat {i}"}, {"raw": f"a dog {i}"}],
            }
            for i, (name, split) in enumerate([("a.jpg", "train"), ("b.jpg", "test")])
        ],
    }
).encode()


@SETTINGS
@given(data=mutated(VALID_KARPATHY))
def test_karpathy_json_mutated(images, data):
    run_prepare(data, "dataset.json", images, "demo")


# --------------------------------------------------------------------------- Food-101 CSV

VALID_CSV = b'image name,text,class\na.jpg,best pizza,pizza\nb.jpg,"apple, pie",apple_pie\n'


@SETTINGS
@given(data=mutated(VALID_CSV) | st.binary(max_size=200))
def test_food101_csv_mutated(images, data):
    run_prepare(data, "train_titles.csv", images, "food101")


@SETTINGS
@given(rows=st.lists(st.lists(st.text(max_size=10) | NAMES, max_size=4), max_size=5))
def test_food101_csv_of_any_rows(images, rows):
    import csv

    text = io.StringIO()
    csv.writer(text).writerows(rows)
    run_prepare(text.getvalue().encode("utf-8", "surrogatepass"), "test.csv", images, "food101")


# --------------------------------------------------------------------------- precomp


def npy_bytes(array) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


VALID_NPY = npy_bytes(np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4))
ARRAYS = st.one_of(
    st.just(VALID_NPY),
    mutated(VALID_NPY),
    st.tuples(
        st.sampled_from(["f4", "f2", "f8", "i4", "u1", "c8", "?", "S3", "U2", "O"]),
        st.lists(st.integers(0, 3), max_size=4),
        st.sampled_from([0.0, 1.0, np.nan, np.inf, 1e30]),
    ).map(
        lambda t: npy_bytes(
            np.full(t[1], t[2] if t[0][0] in "fc" else 1, dtype=t[0])
            if t[0] != "O"
            else np.array([{"x": 1}], dtype=object)
        )
    ),
)


@SETTINGS
@given(
    ims=ARRAYS,
    caps=mutated(b"one\ntwo\nthree\nfour\n") | st.just(b"one\ntwo\nthree\nfour\n"),
    ids=st.none() | mutated(b"11\n22\n") | st.just(b"11\n22\n"),
)
def test_precomp_folders_mutated(ims, caps, ids):
    folder = Path(tempfile.mkdtemp())
    try:
        (folder / "test_ims.npy").write_bytes(ims)
        (folder / "test_caps.txt").write_bytes(caps)
        if ids is not None:
            (folder / "test_ids.txt").write_bytes(ids)
        out = folder / "out"
        try:
            manifest = import_precomp(
                folder, ["test"], out / "m.parquet", out / "r.zarr", LAYOUT, log=str
            )
        except UserError as err:
            one_line(err)
            assert not (out / "m.parquet").exists() and not (out / "r.zarr").exists()
            return
        assert len(manifest) >= 1 and (out / "r.zarr").is_dir()
    finally:
        shutil.rmtree(folder)


# --------------------------------------------------------------------------- TSV


def tsv_row(image_id, n, dim=4) -> bytes:
    boxes = base64.b64encode(np.ones((n, 4), np.float32).tobytes())
    feats = base64.b64encode(np.ones((n, dim), np.float32).tobytes())
    return b"\t".join([image_id.encode(), b"640", b"480", str(n).encode(), boxes, feats]) + b"\n"


VALID_TSV = tsv_row("1", 2) + tsv_row("2", 3)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    folder = tmp_path_factory.mktemp("manifest")
    np.save(folder / "test_ims.npy", np.zeros((3, 1, 2), np.float32))
    (folder / "test_caps.txt").write_text("a\nb\nc\n")
    (folder / "test_ids.txt").write_text("1\n2\n3\n")
    return import_precomp(
        folder, ["test"], folder / "m.parquet", folder / "x.zarr", LAYOUT, log=str
    )


@SETTINGS
@given(data=mutated(VALID_TSV) | st.binary(max_size=300))
def test_tsv_mutated(manifest, data):
    folder = Path(tempfile.mkdtemp())
    try:
        (folder / "a.tsv").write_bytes(data)
        try:
            missing = import_butd_tsv(
                [folder / "a.tsv"], manifest, folder / "r.zarr", LAYOUT, 4, log=str
            )
        except UserError as err:
            one_line(err)
            assert not (folder / "r.zarr").exists()
            return
        assert set(missing) <= {"1", "2", "3"}
    finally:
        shutil.rmtree(folder)


# --------------------------------------------------------------------------- params

VALID_PARAMS = (REPO / "params.yaml").read_bytes()
SECTIONS = ["demo", "prepare", "store", "shards", "train", "text", "models", "evaluate"]
PARAMS = st.dictionaries(
    st.sampled_from(SECTIONS) | st.text(max_size=6),
    st.dictionaries(
        st.sampled_from(["seed", "lr", "device", "samples_per_shard", "format", "mvvse", "x"]),
        ANY | st.sampled_from([".inf", "-1", "banana", "cuda:0"]),
        max_size=4,
    )
    | ANY,
    max_size=4,
)


@SETTINGS
@given(data=mutated(VALID_PARAMS) | PARAMS.map(lambda d: yaml.safe_dump(d).encode()))
def test_params_mutated(data):
    folder = Path(tempfile.mkdtemp())
    try:
        (folder / "params.yaml").write_bytes(data)
        try:
            load_params(folder / "params.yaml")
        except ConfigError as err:
            assert all(
                line.startswith(f"{folder / 'params.yaml'}:") for line in str(err).split("\n")
            )
    finally:
        shutil.rmtree(folder)
