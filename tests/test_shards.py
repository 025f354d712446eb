"""WebDataset shards: packed from the manifest and the stores, standard tars, checked
against their sources, streamed as training pairs (shuffled, split over ranks and
workers, from a folder or S3) with the batch contract of the stores."""

import hashlib
import io
import json
import tarfile

import numpy as np
import pytest
import torch
from local_s3 import local_s3
from store_data import make_stores

from features.ingest.manifest import read_manifest
from features.shards.reader import read_groups, read_sizes
from features.shards.writer import ShardsConfig, build_shards
from features.store.reader import Store
from features.store.spec import FieldSpec, Provenance, StoreError
from features.store.writer import StoreWriter
from models.common import TrainConfig
from models.data.batches import Batches
from models.data.pairs import PairData
from models.data.shards import ShardData
from models.mvvse import MVVSEConfig
from models.train import train

INPUTS = frozenset({"regions", "words", "tokens", "labels"})
LAYOUT = ShardsConfig(samples_per_shard=8, images_per_group=3)
CFG = TrainConfig(batch_size=4, shuffle_buffer=10, epochs=2, device="cpu", prefetch=1)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    paths = make_stores(root)
    manifest = read_manifest(paths.manifest)
    stores = {"regions": Store.open(paths.regions), "grid": Store.open(paths.grid)}
    sizes = build_shards(manifest, stores, root / "out", LAYOUT, text=Store.open(paths.text))
    return root, paths, manifest, sizes


def test_sizes_record_sources_and_counts(packed):
    root, paths, manifest, sizes = packed
    assert sizes == read_sizes(root / "out")
    assert sizes["manifest_digest"] == manifest.digest
    assert sizes["stores"]["regions"]["fingerprint"] == Store.open(paths.regions).fingerprint
    train = {k: v for k, v in sizes["shards"].items() if v["split"] == "train"}
    assert sum(v["images"] for v in train.values()) == 30 and len(train) == 4
    last = train["train-000003.tar"]
    assert {k: last[k] for k in ("split", "images", "captions", "groups")} == {
        "split": "train",
        "images": 6,
        "captions": 13,
        "groups": 2,
    }
    # every member in tar order with its size and CRC-32C (a naive bitwise CRC here)
    path = root / "out" / "train-000003.tar"
    with tarfile.open(path) as tar:
        want = [[m.name, m.size, crc32c(tar.extractfile(m).read())] for m in tar]
    assert last["members"] == want and last["bytes"] == path.stat().st_size
    assert want[0][0] == "train-000000024.meta.json" and len(want) > 20


def crc32c(data: bytes) -> str:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return f"crc32c:{crc ^ 0xFFFFFFFF:08x}"


def test_shards_are_standard_tars_that_webdataset_reads(packed):
    """The format's own reader (webdataset) opens them and finds, member for member, what
    our reader gives; members are plain .npy / .json."""
    import webdataset as wds

    root, paths, manifest, sizes = packed
    regions = Store.open(paths.regions)
    for name, recorded in sizes["shards"].items():
        url = str(root / "out" / name)
        samples = list(wds.WebDataset(url, shardshuffle=False))
        groups = list(read_groups(url, recorded))
        keys = [f"{recorded['split']}-{g.meta['index'][0]:09d}" for g in groups]
        assert [s["__key__"] for s in samples] == keys
        for sample, group in zip(samples, groups, strict=True):
            assert json.loads(sample["meta.json"]) == group.meta
            npy = {k[: -len(".npy")]: v for k, v in sample.items() if k.endswith(".npy")}
            assert npy.keys() == group.arrays.keys()
            for key, data in npy.items():
                want = np.load(io.BytesIO(data), allow_pickle=False)
                assert want.dtype == group.arrays[key].dtype, key
                np.testing.assert_array_equal(group.arrays[key], want)
            rows = [regions.index(k) for k in group.meta["keys"]]
            features = regions.gather("features", rows)
            np.testing.assert_array_equal(group.arrays["regions.features"], features)
    with tarfile.open(root / "out" / "val-000000.tar") as tar:  # and plain tar tools
        assert "val-000000000.text.word_ids_offsets.npy" in tar.getnames()


def test_rebuild_is_bitwise_identical(packed, tmp_path):
    root, paths, manifest, _ = packed
    stores = {"regions": Store.open(paths.regions)}
    digests = []
    for run in ("a", "b"):
        build_shards(manifest, stores, tmp_path / run, LAYOUT)
        digests.append(
            {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / run).iterdir()}
        )
    assert digests[0] == digests[1]


def test_refuses_stores_of_another_manifest(packed, tmp_path):
    root, paths, manifest, _ = packed
    keys = manifest.table["key"].to_pylist()
    other = Provenance("test", "1", {}, None, "0" * 64)
    with StoreWriter(
        tmp_path / "o.zarr", "global", {"x": FieldSpec((), "int32")}, keys, other
    ) as w:
        w.write_shard(0, {"x": np.zeros(len(keys))})
    with pytest.raises(StoreError, match="not from this one"):
        build_shards(manifest, {"o": Store.open(tmp_path / "o.zarr")}, tmp_path / "s")


def test_training_refuses_shards_of_other_stores(packed):
    root, paths, _, _ = packed
    data = PairData(paths, "train", frozenset({"image", "words"}))  # the global store: not packed
    with pytest.raises(StoreError, match="no packed store has the fingerprint .*global.zarr"):
        ShardData(str(root / "out"), data, CFG)
    (root / "old").mkdir()
    (root / "old" / "sizes.json").write_text(json.dumps({"train-000000.tar": 3}))
    with pytest.raises(StoreError, match="format 1, this code reads format 3; rebuild"):
        ShardData(str(root / "old"), data, CFG)
    # shards built before members were checksummed are refused, not read unchecked
    sizes = json.loads((root / "out" / "sizes.json").read_text())
    (root / "old" / "sizes.json").write_text(json.dumps({**sizes, "format": 2}))
    with pytest.raises(
        StoreError, match="format 2, this code reads format 3; rebuild .*shards build"
    ):
        ShardData(str(root / "old"), data, CFG)


def epoch(source, cfg, epoch_index, rank=0, world=1, workers=0):
    """The batches of one epoch, as the training loop gets them."""
    with Batches(source, "cpu", num_workers=workers, prefetch=1) as batches:
        stream = source.epoch_stream(epoch_index, rank, world)
        return [{k: v.clone() for k, v in b.items()} for b in batches.run(stream)]


def identify(data, batch):
    """Each row's caption position in the split, found by its image and word ids."""
    found = []
    for b, image in enumerate(batch["caption_image"].tolist()):
        words = batch["words"][b, : batch["word_lengths"][b]]
        candidates = np.flatnonzero(data.caption_image == image)
        raw = data.build("text", candidates)
        match = [
            c
            for c, w, n in zip(candidates, raw["words"], raw["word_lengths"], strict=True)
            if torch.equal(torch.from_numpy(w[:n]), words)
        ]
        found.append(int(match[0]))
    return found


def test_an_epoch_streams_each_caption_at_most_once_with_the_stores_values(packed):
    root, paths, _, _ = packed
    data = PairData(paths, "train", INPUTS)
    source = ShardData(str(root / "out"), data, CFG)
    batches = epoch(source, CFG, 0)
    assert len(batches) == source.steps(1) == len(data) // 4  # one stream: one partial batch
    seen = [c for b in batches for c in identify(data, b)]
    assert len(seen) == len(set(seen)) >= len(data) - 2 * 4
    assert seen != sorted(seen)
    # every value equals the store path's batch of the same captions
    for batch in batches[:3]:
        want = data.pair_batch(np.array(identify(data, batch)))
        assert batch.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(batch[key], value), key
    again = epoch(source, CFG, 0)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(batches, again, strict=True))
    other = epoch(source, CFG, 1)
    assert [identify(data, b) for b in other] != [identify(data, b) for b in batches]


def test_ranks_and_workers_take_disjoint_equal_streams(packed):
    root, paths, _, _ = packed
    data = PairData(paths, "train", INPUTS)
    cfg = CFG.model_copy(update={"num_workers": 2})
    source = ShardData(str(root / "out"), data, cfg)
    per_rank = [epoch(source, cfg, 3, rank, 2, workers=2) for rank in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == source.steps(2) > 0
    seen = [[c for b in r for c in identify(data, b)] for r in per_rank]
    assert not set(seen[0]) & set(seen[1])
    again = epoch(source, cfg, 3, 1, 2, workers=2)
    assert [identify(data, b) for b in again] == [identify(data, b) for b in per_rank[1]]


def test_training_from_shards_resumes_exactly(packed, tmp_path):
    root, paths, _, _ = packed
    inputs = frozenset({"regions", "words"})
    model_cfg = MVVSEConfig(embed_size=16, word_dim=8, gpo_hidden=8, gpo_pe_dim=8)
    cfg = CFG.model_copy(update={"epochs": 2, "standardize": True})

    def run(out, epochs, resume=False):
        data = PairData(paths, "train", inputs)
        source = ShardData(str(root / "out"), data, cfg)
        val = PairData(paths, "val", inputs)
        run_cfg = cfg.model_copy(update={"epochs": epochs})
        return train("mvvse", model_cfg, run_cfg, source, val, out, resume=resume, log=print)

    full = run(tmp_path / "full", 2)
    run(tmp_path / "split", 1)
    resumed = run(tmp_path / "split", 2, resume=True)
    assert [r["loss"] for r in resumed["history"]] == [r["loss"] for r in full["history"]]
    a = torch.load(tmp_path / "full" / "last.pt", weights_only=True)["state_dict"]
    b = torch.load(tmp_path / "split" / "last.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_streams_from_s3(packed):
    """Shards built straight to a local S3 endpoint (moto) stream the same batches."""
    root, paths, manifest, _ = packed
    with local_s3("shards") as options:
        stores = {"regions": Store.open(paths.regions), "grid": Store.open(paths.grid)}
        build_shards(
            manifest,
            stores,
            "s3://shards/demo",
            LAYOUT,
            text=Store.open(paths.text),
            storage_options=options,
        )
        data = PairData(paths, "train", INPUTS)
        remote = ShardData("s3://shards/demo", data, CFG, storage_options=options)
        local = ShardData(str(root / "out"), data, CFG)
        for a, b in zip(epoch(remote, CFG, 0), epoch(local, CFG, 0), strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_scene_graphs_stream_with_the_shards_and_are_checked(packed, tmp_path):
    """UniVSE's inputs (grid, words, scene graphs) from shards equal the store path's;
    shards without the graphs in use are refused."""
    from dataclasses import replace

    from features.scenegraph.files import GRAPHS, write_scene_graphs
    from features.shards.writer import read_scene_graphs
    from infra.files import sha256_file

    root, paths, manifest, _ = packed
    keys, texts, _ = manifest.caption_rows()
    rows = [
        {
            "key": k,
            "caption": t,
            "objects": [{"span": f"w{i % 20}", "head": "x", "lemma": "x"}],
            "attributes": [{"object": 0, "attribute": f"w{i % 7}", "lemma": "y"}] * (i % 2),
            "relations": [],
        }
        for i, (k, t) in enumerate(zip(keys, texts, strict=True))
    ]
    write_scene_graphs(tmp_path / "graphs", rows, {"nouns": {"w1": 2}})
    paths = replace(paths, scenegraphs=tmp_path / "graphs")
    inputs = frozenset({"grid", "words", "scene_graph"})
    data = PairData(paths, "train", inputs)
    with pytest.raises(StoreError, match="the shards hold no scene graphs"):
        ShardData(str(root / "out"), data, CFG)
    stores = {"grid": Store.open(paths.grid)}
    build_shards(
        manifest,
        stores,
        tmp_path / "s",
        LAYOUT,
        text=Store.open(paths.text),
        scene_graphs=read_scene_graphs(tmp_path / "graphs"),
        scene_graphs_digest=sha256_file(tmp_path / "graphs" / GRAPHS),
    )
    source = ShardData(str(tmp_path / "s"), data, CFG)
    for batch in epoch(source, CFG, 0)[:3]:
        want = data.pair_batch(np.array(identify(data, batch)))
        assert batch.keys() == want.keys() and "object_mask" in batch
        for key, value in want.items():
            assert torch.equal(batch[key], value), key


def test_the_command_builds_shards_that_training_reads(packed, tmp_path, capsys):
    from flows.cli import main

    root, paths, _, _ = packed
    args = ["shards", "build", "--manifest", str(paths.manifest), "--out", str(tmp_path / "s")]
    assert main([*args, "--store", f"regions={paths.regions}", "--text", str(paths.text)]) == 0
    assert "41 images in 3 shards (regions, text)" in capsys.readouterr().out
    data = PairData(paths, "train", frozenset({"regions", "words"}))
    assert ShardData(str(tmp_path / "s"), data, CFG).shards == ["train-000000.tar"]
    assert main([*args, "--store", f"text={paths.regions}"]) == 1
    assert "'text' names the caption-level store; use --text" in capsys.readouterr().err


def _damage(tar_path, how: str) -> str:
    """Damage the shard as files get damaged; returns the member a reader must name."""
    with tarfile.open(tar_path) as tar:
        found = tar.getmembers()
    target = next(m for m in found if m.name.endswith(".regions.features.npy") and m.offset)
    data = bytearray(tar_path.read_bytes())
    if how == "data":  # one bit of a float16 feature, as in the issue (21.97 -> -0.343)
        data[target.offset_data + target.size - 7] ^= 0x40
    elif how == "cut in half":
        cut = len(data) // 2
        target = [m for m in found if m.offset <= cut][-1]
        del data[cut:]
    elif how == "cut at a member":
        del data[target.offset :]
    elif how in ("size field", "size field, checksum fixed"):
        data[target.offset + 134] ^= 0x01  # the size's last octal digit: one byte more or less
        if how.endswith("fixed"):  # a consistent header: only sizes.json can tell
            header = data[target.offset : target.offset + 512]
            header[148:156] = b" " * 8
            data[target.offset + 148 : target.offset + 156] = b"%06o\0 " % sum(header)
    elif how == "name":
        data[target.offset + 3] ^= 0x01
    elif how == "deleted":
        tar_path.unlink()
        return ""
    tar_path.write_bytes(bytes(data))
    return target.name


DAMAGE = ["data", "cut in half", "cut at a member", "size field", "size field, checksum fixed"]
DAMAGE += ["name", "deleted"]


@pytest.fixture
def damaged(packed, tmp_path, request):
    """A copy of the shards with train-000001.tar damaged (``request.param``) after it
    was read whole (mapped and checked: a changed file is mapped and checked anew)."""
    import shutil

    root = packed[0]
    shutil.copytree(root / "out", tmp_path / "s")
    recorded = read_sizes(tmp_path / "s")["shards"]["train-000001.tar"]
    assert len(list(read_groups(str(tmp_path / "s" / "train-000001.tar"), recorded))) == 3
    member = _damage(tmp_path / "s" / "train-000001.tar", request.param)
    return tmp_path / "s", member


def one_line(err, shards, member: str) -> str:
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    assert f"{shards / 'train-000001.tar'}: " in message and "`vse shards build`" in message
    assert f"member {member}: " in message if member else "missing" in message
    return message


@pytest.mark.parametrize("damaged", DAMAGE, indirect=True)
def test_a_damaged_shard_is_one_line_naming_shard_and_member(packed, damaged):
    shards, member = damaged
    sizes = read_sizes(shards)
    url = str(shards / "train-000001.tar")
    with pytest.raises(StoreError) as err:
        list(read_groups(url, sizes["shards"]["train-000001.tar"]))
    one_line(err, shards, member)
    # training stops on it with the same line, before a batch of that shard is built
    data = PairData(packed[1], "train", INPUTS)
    with pytest.raises(StoreError) as err:
        epoch(ShardData(str(shards), data, CFG), CFG, 0)
    one_line(err, shards, member)


@pytest.mark.parametrize("damaged", ["data"], indirect=True)
def test_training_never_trains_on_a_flipped_byte(packed, damaged, tmp_path):
    """The issue's case: unchecked, the flipped byte is a wrong feature and nothing fails;
    checked, training stops in one line, in the loop or from worker processes, and
    writes no checkpoint."""
    root, paths = packed[0], packed[1]
    shards, member = damaged
    name = "train-000001.tar"
    unchecked = list(read_groups(str(shards / name), None))
    intact = list(read_groups(str(root / "out" / name), read_sizes(root / "out")["shards"][name]))
    key = member.split(".", 1)[1][: -len(".npy")]
    assert any(
        not np.array_equal(a.arrays[key], b.arrays[key])
        for a, b in zip(unchecked, intact, strict=True)
    )
    inputs = frozenset({"regions", "words"})
    cfg = CFG.model_copy(update={"num_workers": 2, "epochs": 1})
    model_cfg = MVVSEConfig(embed_size=16, word_dim=8, gpo_hidden=8, gpo_pe_dim=8)
    source = ShardData(str(shards), PairData(paths, "train", inputs), cfg)
    val = PairData(paths, "val", inputs)
    with pytest.raises(StoreError) as err:
        train("mvvse", model_cfg, cfg, source, val, tmp_path / "run", log=print)
    assert "damaged data" in one_line(err, shards, member)
    assert not (tmp_path / "run" / "last.pt").exists()


@pytest.mark.parametrize("how", ["data", "cut in half", "cut at a member", "deleted"])
def test_damaged_remote_shards_are_one_line(packed, tmp_path, how):
    """Shards read in sequence through fsspec (memory://, as s3:// is) are checked alike."""
    import fsspec

    root = packed[0]
    local = tmp_path / "train-000001.tar"
    local.write_bytes((root / "out" / local.name).read_bytes())
    member = _damage(local, how)
    fs = fsspec.filesystem("memory")
    url = f"memory://damaged-{how.replace(' ', '-')}/{local.name}"
    if how != "deleted":
        fs.pipe(url, local.read_bytes())
    recorded = read_sizes(root / "out")["shards"][local.name]
    with pytest.raises(StoreError) as err:
        list(read_groups(url, recorded))
    message = str(err.value)
    assert message.startswith(f"{url}: ") and "\n" not in message and "shards build" in message
    assert f"member {member}: " in message if member else "missing" in message


def test_the_shards_own_checks_name_the_file_and_what_to_run(tmp_path):
    """The manifest, each store's fingerprint (the flag that packs it) and the scene graphs
    the shards were built from, against what training uses; a missing sizes.json."""
    from types import SimpleNamespace

    from features.shards.reader import check_sources, read_sizes

    sizes = {"manifest_digest": "m" * 64, "stores": {"regions": {"fingerprint": "f" * 64}}}
    where = f"{tmp_path}/sizes.json"
    regions = SimpleNamespace(fingerprint="f" * 64, url="r.zarr")
    assert check_sources(tmp_path, sizes, "m" * 64, {"regions": regions}) == {"regions": "regions"}
    with pytest.raises(StoreError) as err:
        check_sources(tmp_path, sizes, "n" * 64, {"regions": regions})
    assert str(err.value) == (
        f"{where}: built from manifest mmmmmmmmmmmm, training uses nnnnnnnnnnnn; rebuild the "
        "shards (vse shards build) from these stores"
    )
    for role, flag in (("global", "--store global=g.zarr"), ("text", "--text g.zarr")):
        other = SimpleNamespace(fingerprint="g" * 64, url="g.zarr")
        with pytest.raises(StoreError) as err:
            check_sources(tmp_path, sizes, "m" * 64, {role: other})
        assert str(err.value) == (
            f"{where}: no packed store has the fingerprint gggggggggggg of g.zarr ({role}); "
            f"rebuild the shards with `vse shards build` and {flag}"
        )
    for held, word in ((None, "no"), ("s" * 64, "other")):
        with pytest.raises(StoreError) as err:
            check_sources(tmp_path, sizes | {"scene_graphs": held}, "m" * 64, {}, "t" * 64)
        assert str(err.value) == (
            f"{where}: the shards hold {word} scene graphs than the scene-graph folder in "
            "use; rebuild them with --scenegraphs"
        )
    with pytest.raises(StoreError) as err:
        read_sizes(tmp_path / "none")
    assert str(err.value) == (
        f"{tmp_path / 'none'}/sizes.json: missing; build the shards with `vse shards build`"
    )
