"""Stores opened read-only from S3, against a local S3 endpoint (moto) on 127.0.0.1."""

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest

from features.store.integrity import verify_store
from features.store.reader import Store
from flows.cli import main

sys.path.insert(0, str(Path(__file__).parent))
import store_writer_job as job  # noqa: E402
from local_s3 import local_s3  # noqa: E402


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    import s3fs

    with local_s3("stores") as options:
        fs = s3fs.S3FileSystem(**options)
        local = tmp_path_factory.mktemp("local") / "regions.zarr"
        job.run(local, "regions", 30, 8)
        fs.put(str(local), "stores/regions.zarr", recursive=True)
        yield fs, options, local


def test_open_read_and_verify_from_s3(s3):
    fs, options, local = s3
    remote = Store.open("s3://stores/regions.zarr", storage_options=options)
    here = Store.open(local)
    assert len(remote) == 30 and remote.fingerprint == here.fingerprint
    np.testing.assert_array_equal(remote["img0017"]["features"], here["img0017"]["features"])
    np.testing.assert_array_equal(remote.read(3, 20)["boxes"], here.read(3, 20)["boxes"])
    assert remote.verify() == []


def test_verify_names_a_corrupt_shard_on_s3(s3, capsys):
    fs, options, local = s3
    fs.put(str(local), "stores/broken.zarr", recursive=True)
    fs.pipe("stores/broken.zarr/features/c.1.0.0", b"garbage")
    url = "s3://stores/broken.zarr"
    assert Store.open(url, storage_options=options).verify() == [
        "features/c.1.0.0: corrupt (checksum mismatch)"
    ]
    import json

    assert main(["store", "verify", url, "--storage-options", json.dumps(options)]) == 1
    assert "features/c.1.0.0: corrupt" in capsys.readouterr().out
    assert main(["store", "info", url, "--json", "--storage-options", json.dumps(options)]) == 0
    assert '"kind": "regions"' in capsys.readouterr().out


def test_verify_names_damaged_metadata_keys_and_markers_on_s3(s3, capsys):
    import json

    fs, options, local = s3
    url = "s3://stores/meta.zarr"
    fs.put(str(local), "stores/meta.zarr", recursive=True)
    for rel in ("zarr.json", "keys/c.0", "_commits/c.1", "boxes/zarr.json"):
        data = fs.cat_file(f"stores/meta.zarr/{rel}")
        fs.pipe(f"stores/meta.zarr/{rel}", data[: len(data) // 2])
    assert main(["store", "verify", url, "--storage-options", json.dumps(options)]) == 1
    out, err = capsys.readouterr()
    for rel in ("zarr.json", "keys/c.0", "_commits/c.1", "boxes/zarr.json"):
        assert f"{url}: {rel}: corrupt" in out
    assert "Traceback" not in out + err
    assert main(["store", "info", url, "--storage-options", json.dumps(options)]) == 1
    assert capsys.readouterr().err.startswith(f"error: {url}: its metadata")


def test_verify_of_an_incomplete_store_on_s3_reads_its_commit_markers(s3, tmp_path):
    """A store a killed run left on S3: its commit markers are read with the storage
    options (the URL given with a trailing slash, as shells complete it)."""
    from test_store import half_written

    fs, options, _ = s3
    root = half_written(tmp_path / "s.zarr")
    fs.put(str(root), "stores/half.zarr", recursive=True)
    fs.pipe("stores/half.zarr/features/c.0.0.0", b"garbage")
    assert verify_store("s3://stores/half.zarr/", options) == [
        "shard 1: not committed (store incomplete)",
        "features/c.0.0.0: corrupt (checksum mismatch)",
    ]


# -- vse evaluate reading its stores from S3

N_IMAGES, N_TEST, CAPTIONS, TOKENS = 40, 8, 2, 8  # the test split: the last 8 images
REGIONS, REGION_DIM, TOKEN_DIM = 16, 1024, 1024  # each features array over the kept bound


def eval_stores(root: Path):
    """A manifest (24 train, 8 val, 8 test images, 2 captions each), a region store and a
    text store (8 tokens a caption) in shards of 8 samples, chunks of 4: the test split is
    the last whole shard of each store's samples."""
    from store_data import _write

    from features.ingest.manifest import Dataset, Record, read_manifest, write_manifest
    from features.store.spec import FieldSpec

    rng = np.random.default_rng(0)
    splits = ["train"] * 24 + ["val"] * 8 + ["test"] * N_TEST
    records = [
        Record(f"img{i:03d}", f"img{i:03d}.jpg", s, [f"caption {i} {j}" for j in range(CAPTIONS)])
        for i, s in enumerate(splits)
    ]
    write_manifest(records, Dataset("s3", records, []), CAPTIONS, root / "manifest.parquet")
    manifest = read_manifest(root / "manifest.parquet")
    keys = manifest.table["key"].to_pylist()
    regions = rng.standard_normal((N_IMAGES, REGIONS, REGION_DIM)).astype(np.float16)
    n_regions = rng.integers(1, REGIONS + 1, N_IMAGES).astype(np.int32)
    fields = {
        "features": FieldSpec((REGIONS, REGION_DIM), "float16"),
        "n_regions": FieldSpec((), "int32"),
    }
    _write(
        root / "regions.zarr",
        "regions",
        fields,
        keys,
        manifest.digest,
        lambda a, b: {"features": regions[a:b], "n_regions": n_regions[a:b]},
    )
    caption_keys, _, _ = manifest.caption_rows()
    tokens = rng.standard_normal((len(caption_keys), TOKENS, TOKEN_DIM)).astype(np.float16)
    _write(
        root / "text.zarr",
        "text",
        {"features": FieldSpec((TOKEN_DIM,), "float16", ragged=True)},
        caption_keys,
        manifest.digest,
        lambda a, b: {"features": list(tokens[a:b])},
    )
    return manifest


def mvvse_checkpoint(path: Path) -> None:
    """An MV-VSE (BERT tokens) checkpoint for the stores' sizes (untrained: evaluation
    only has to give the same numbers from S3 as from the local stores)."""
    import torch

    from models.data.info import DataInfo
    from models.mvvse import MVVSEConfig
    from models.train import build_model

    torch.manual_seed(0)
    cfg = MVVSEConfig(embed_size=16, text_encoder="bert", views=2, gpo_pe_dim=8, gpo_hidden=8)
    info = DataInfo(region_dim=REGION_DIM, token_dim=TOKEN_DIM)
    model = build_model("mvvse", cfg, info)
    state = {"model": "mvvse", "config": cfg.model_dump(), "info": info.to_dict()}
    torch.save({**state, "state_dict": model.state_dict()}, path)


def store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def on_s3(s3, tmp_path_factory, repo_root):
    """The stores written locally and uploaded; a checkpoint; params with batches of 4."""
    import yaml

    fs, options, _ = s3
    root = tmp_path_factory.mktemp("eval")
    eval_stores(root)
    for name in ("regions.zarr", "text.zarr"):
        fs.put(str(root / name), f"stores/eval/{name}", recursive=True)
    mvvse_checkpoint(root / "best.pt")
    params = yaml.safe_load((repo_root / "params.yaml").read_text())
    params["evaluate"].update(batch_size=4, fold_size=None, device="cpu")
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root, options


@pytest.fixture
def s3_env(on_s3, monkeypatch):
    """Credentials and endpoint the standard way, from the environment (no storage
    options), and a fresh s3fs client to read them."""
    import s3fs

    _, options = on_s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def evaluate_argv(root: Path, regions: str, text: str, out: Path) -> list[str]:
    return [
        *("--params", str(root / "params.yaml"), "evaluate", "mvvse"),
        *("--checkpoint", str(root / "best.pt"), "--manifest", str(root / "manifest.parquet")),
        *("--regions", regions, "--text", text, "--out", str(out)),
    ]


def test_evaluate_reads_its_stores_from_s3_fetching_only_the_split(
    on_s3, s3_env, monkeypatch, tmp_path, capsys
):
    """Same metrics as from the local stores, and only about the test split's share of the
    stores' bytes fetched: arrays over the reader's in-memory limit (as a COCO-sized
    store's are; lowered here to fit a small store) are fetched chunk by chunk."""
    import json
    import time

    import s3fs

    import features.store.reader
    from models.data.pairs import PairData

    root, _ = on_s3
    limit = 1 << 20
    monkeypatch.setattr(features.store.reader, "IN_MEMORY_BYTES", limit)
    assert N_IMAGES * REGIONS * REGION_DIM * 2 > limit  # the features are read by chunks
    local = tmp_path / "local.json"
    argv = evaluate_argv(root, str(root / "regions.zarr"), str(root / "text.zarr"), local)
    assert main(argv) == 0
    fetched = []
    cat_file = s3fs.S3FileSystem._cat_file

    async def counted(self, path, *args, **kwargs):
        data = await cat_file(self, path, *args, **kwargs)
        fetched.append(len(data))
        return data

    monkeypatch.setattr(s3fs.S3FileSystem, "_cat_file", counted)
    first_batch = []
    build = PairData.build

    def timed(self, *args, **kwargs):
        out = build(self, *args, **kwargs)
        first_batch.append(time.perf_counter() - start)
        return out

    monkeypatch.setattr(PairData, "build", timed)
    remote = tmp_path / "remote.json"
    start = time.perf_counter()
    s3 = evaluate_argv(root, "s3://stores/eval/regions.zarr", "s3://stores/eval/text.zarr", remote)
    assert main(s3) == 0, capsys.readouterr().err
    seconds = time.perf_counter() - start
    assert json.loads(remote.read_text()) == json.loads(local.read_text())
    whole = store_bytes(root / "regions.zarr") + store_bytes(root / "text.zarr")
    share = N_TEST / N_IMAGES  # of the images, and of the captions and their tokens
    ratio = sum(fetched) / whole
    print(f"fetched {sum(fetched)} of {whole} bytes ({ratio:.3f}) in {len(fetched)} reads")
    print(f"evaluated from S3 in {seconds:.2f} s, first batch after {first_batch[0]:.2f} s")
    assert sum(fetched) <= 1.1 * share * whole, (sum(fetched), whole, share)


def test_a_missing_store_on_s3_is_a_one_line_error(on_s3, s3_env, tmp_path, capsys):
    root, _ = on_s3
    url = "s3://stores/eval/nothere.zarr"
    argv = evaluate_argv(root, url, "s3://stores/eval/text.zarr", tmp_path / "o.json")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith(f"error: {url}: not found (the region store); upload")
        and err.count("\n") == 1
    ), err
    assert not (tmp_path / "o.json").exists()


def test_store_arguments_keep_urls_as_given():
    """``Path("s3://b/x")`` would be ``s3:/b/x``: URLs stay ``str``, local paths ``Path``."""
    from flows.commands.train import feature_paths

    args = argparse.Namespace(
        manifest="m.parquet",
        global_=None,
        regions="s3://b/x/regions.zarr",
        grid="g.zarr",
        text="memory://t.zarr",
        vocab=None,
        scenegraphs=None,
    )
    paths = feature_paths(args)
    assert paths.regions == "s3://b/x/regions.zarr" and paths.text == "memory://t.zarr"
    assert paths.grid == Path("g.zarr") and paths.global_ is None
