"""The data path of training and evaluation: raw batches from the stores, finished
batches, built ahead by a thread or worker processes, in order, without device syncs."""

import os
import sys

import numpy as np
import pytest
import torch
from model_data import TinyPairs
from store_data import make_stores

from features.store.reader import Store
from models.common import TrainConfig, host_lengths
from models.data.arena import Arena
from models.data.arrays import as_tensors, finish, to_device
from models.data.batches import Batches, DataWorkerError
from models.data.info import DataError
from models.data.pairs import PairData
from models.data.staging import one_ahead
from models.train import epoch_batches, train
from models.vsepp import VSEPPConfig

ALL = frozenset(
    {"image", "regions", "boxes", "grid", "words", "tokens", "document", "tfidf", "labels"}
)
# (num_workers, prefetch): in the loop, a thread, processes
MODES = [(0, 0), (0, 2), (1, 2), (2, 1)]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return make_stores(tmp_path_factory.mktemp("stores"))


def naive_pairs(paths, data, captions):
    """What a pair batch must hold, one sample at a time through the stores' readers."""
    regions, grid, image = (Store.open(p) for p in (paths.regions, paths.grid, paths.global_))
    text = Store.open(paths.text)
    rows = []
    for c in captions:
        key = data.image_keys[data.caption_image[c]]
        r, t = regions[key], text[data.caption_keys[c]]
        h, w = r["image_hw"]
        rows.append(
            {
                "image": image[key]["features"],
                "regions": r["features"],
                "region_lengths": max(int(r["n_regions"]), 1),
                "boxes": r["boxes"] / np.maximum([w, h, w, h], 1),
                "grid": grid[key]["features"].reshape(-1, grid.fields["features"].shape[-1]),
                "words": t["word_ids"],
                "tokens": t["features"],
                "document": t["document"],
                "tfidf": (t["tfidf_indices"], t["tfidf_values"]),
                "labels": data.labels[data.caption_image[c]],
            }
        )
    return rows


def test_another_split_holds_its_images_standardised_as_this_one(paths):
    train = PairData(paths, "train", ALL)
    stats = train.feature_stats()
    train.standardize(stats)
    val = train.other_split("val")
    direct = PairData(paths, "val", ALL)  # the reference: built and standardised by hand
    direct.standardize(stats)
    assert val.split == "val" and val.image_keys == direct.image_keys
    assert not set(val.image_keys) & set(train.image_keys)
    got, want = val.image_batch(np.arange(3)), direct.image_batch(np.arange(3))
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k])
    raw = PairData(paths, "val", ALL).image_batch(np.arange(3))
    assert not torch.allclose(got["image"], raw["image"])  # standardised, not raw


def test_pair_batches_equal_the_stores_read_one_sample_at_a_time(paths):
    data = PairData(paths, "train", ALL)
    captions = np.array([5, 0, 17, 17, 3, len(data) - 1, 40])
    batch = data.build("pair", captions)
    assert batch["regions"].dtype == np.float16 and batch["tokens"].dtype == np.float16
    assert batch["words"].dtype == np.int64 and batch["word_lengths"].dtype == np.int64
    for b, want in enumerate(naive_pairs(paths, data, captions)):
        for key in ("image", "regions", "grid", "document"):
            np.testing.assert_array_equal(batch[key][b], want[key])
        assert batch["region_lengths"][b] == want["region_lengths"]
        np.testing.assert_allclose(batch["boxes"][b], want["boxes"], rtol=1e-6)
        for key, ragged in (("words", "word_lengths"), ("tokens", "token_lengths")):
            n = batch[ragged][b]
            np.testing.assert_array_equal(batch[key][b, :n], want[key])
            assert not batch[key][b, n:].any()
        dense = np.zeros(batch["tfidf"].shape[1], np.float32)
        dense[want["tfidf"][0]] = want["tfidf"][1]
        np.testing.assert_array_equal(batch["tfidf"][b], dense)
        assert batch["labels"][b] == batch["text_labels"][b] == want["labels"]
    assert batch["caption_image"].tolist() == data.caption_image[captions].tolist()


def test_finish_converts_once_and_standardises_with_padding_kept_zero(paths):
    data = PairData(paths, "train", ALL)
    stats = data.feature_stats()
    raw = data.build("image", np.arange(data.n_images))
    regions = raw["regions"].astype(np.float64)
    valid = np.arange(regions.shape[1])[None, :] < raw["region_lengths"][:, None]
    np.testing.assert_allclose(stats["regions"][0], regions[valid].mean(0), rtol=1e-5)
    np.testing.assert_allclose(stats["regions"][1], regions[valid].std(0, ddof=1), rtol=1e-5)
    data.standardize(stats)
    ready = data.image_batch(np.arange(6))
    for key in ("image", "regions", "grid", "boxes"):
        assert ready[key].dtype == torch.float32
    mean, std = (torch.tensor(v) for v in stats["regions"])
    expected = (torch.from_numpy(raw["regions"][:6]).float() - mean) / std
    mask = torch.from_numpy(valid[:6])
    torch.testing.assert_close(ready["regions"][mask], expected[mask], rtol=0, atol=0)
    assert not ready["regions"][~mask].any()


@pytest.mark.parametrize(("workers", "prefetch"), MODES)
def test_batches_come_in_order_ready_and_equal_to_a_direct_build(paths, workers, prefetch):
    data = PairData(paths, "train", ALL)
    data.standardize(data.feature_stats())
    tasks = [("pair", c) for c in epoch_batches(len(data), 8, 0, 0, 0, 1)]
    tasks += [("image", np.arange(5)), ("text", np.arange(3, 12))]
    with Batches(data, "cpu", num_workers=workers, prefetch=prefetch) as batches:
        for _ in range(2):  # the arenas (and workers) serve every pass
            got = [{k: v.clone() for k, v in b.items()} for b in batches.run(tasks)]
            assert len(got) == len(tasks)
            for (kind, index), batch in zip(tasks, got, strict=True):
                want = finish(as_tensors(data.build(kind, index)), data.stats)
                assert batch.keys() == want.keys()
                for key, value in want.items():
                    assert batch[key].dtype == value.dtype, key
                    assert torch.equal(batch[key], value), (kind, key)
        stopped = batches.run(tasks)  # a pass left early, then a whole one
        next(stopped), next(stopped)
        stopped.close()
        assert len(list(batches.run(tasks))) == len(tasks)


class Growing:
    """A source whose batches outgrow the arenas (workers send their new buffers)."""

    stats: dict = {}

    def build(self, kind, index, alloc):
        x = alloc((len(index), 100_000), np.float32)  # 400 KB per row
        x[...] = index[:, None]
        if kind == "fail":
            raise DataError("bad.zarr: field 'x' is broken; rebuild it")
        if kind == "die":
            os._exit(3)
        return {"x": x, "n": np.asarray(index)}


@pytest.mark.parametrize(("workers", "prefetch"), MODES)
def test_growing_batches_and_failures(workers, prefetch):
    tasks = [("x", np.arange(k, 2 * k + 1)) for k in (1, 6, 2, 9, 3)]
    with Batches(Growing(), "cpu", num_workers=workers, prefetch=prefetch) as batches:
        for _ in range(2):
            for (_, index), batch in zip(tasks, batches.run(tasks), strict=True):
                assert batch["x"].shape == (len(index), 100_000)
                assert torch.equal(batch["x"][:, -1], torch.from_numpy(index).float())
        with pytest.raises(DataError, match="bad.zarr: field 'x' is broken"):
            list(batches.run([*tasks[:2], ("fail", np.arange(2)), *tasks]))
        assert len(list(batches.run(tasks))) == len(tasks)
        if workers:
            with pytest.raises(DataWorkerError, match="exited unexpectedly"):
                list(batches.run([("die", np.arange(2))]))
            assert len(list(batches.run(tasks))) == len(tasks)  # fresh workers


def test_training_with_workers_equals_training_in_the_loop(tmp_path):
    data = TinyPairs(n_images=32)
    cfg = TrainConfig(epochs=2, batch_size=8, lr=2e-3, device="cpu", prefetch=0)
    model_cfg = VSEPPConfig(embed_size=32, word_dim=16)
    runs = {}
    for workers in (0, 2):
        run_cfg = cfg.model_copy(update={"num_workers": workers, "prefetch": 1 + workers})
        runs[workers] = train("vsepp", model_cfg, run_cfg, data, data, tmp_path / str(workers))
    assert runs[0]["history"] == runs[2]["history"]
    for key, value in runs[0]["model"].state_dict().items():
        assert torch.equal(value, runs[2]["model"].state_dict()[key])


def test_the_training_step_does_not_wait_for_the_device(tmp_path, monkeypatch):
    """Reads of tensor values by the loop itself (``.item()``, ``float()``, ...) do not grow
    with the number of steps: losses are summed on the device and the non-finite flag is
    read every CHECK_EVERY steps."""
    counts = {"n": 0}
    here = os.path.join("models", "train.py")
    for name in ("item", "__float__", "__int__", "__bool__", "cpu", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            if sys._getframe(1).f_code.co_filename.endswith(here):
                counts["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    data = TinyPairs(n_images=48)
    reads = []
    for batch_size in (12, 2):  # 4 and 24 steps per epoch (4 progress lines each)
        counts["n"] = 0
        cfg = TrainConfig(epochs=1, batch_size=batch_size, device="cpu")
        train("vsepp", VSEPPConfig(embed_size=16, word_dim=8), cfg, data, data, tmp_path)
        reads.append(counts["n"])
    assert reads[0] == reads[1], reads


def test_lengths_keep_a_host_copy_on_the_device():
    batch = {"word_lengths": torch.tensor([3, 1]), "words": torch.zeros(2, 3)}
    moved = to_device(batch, torch.device("meta"))
    assert moved["word_lengths"].device.type == "meta"
    assert host_lengths(moved["word_lengths"]) is batch["word_lengths"]
    assert not hasattr(moved["words"], "host")


def test_arena_reuses_its_memory_and_grows():
    arena = Arena(1000)
    a = arena((10,), np.float32)
    b = arena((3, 2), np.int64)
    assert arena.holds(a) == 0 and arena.holds(b) == 64  # 64-byte aligned
    big = arena((500,), np.float32)  # does not fit: fresh memory, and the arena grows
    assert arena.holds(big) is None
    arena.reset()
    assert arena.holds(arena((10,), np.float32)) == 0
    assert arena.holds(arena((500,), np.float32)) is not None


def test_device_batches_are_finished_on_the_device(paths):
    """The accelerator branch (here the "meta" device): raw batches leave their arenas,
    move without blocking and are finished on the device, lengths keeping a host copy."""
    data = PairData(paths, "train", ALL)
    data.standardize(data.feature_stats())
    tasks = [("pair", np.arange(8)), ("image", np.arange(4))]
    with Batches(data, "meta", prefetch=1) as batches:
        got = list(batches.run(tasks))
    want = data.pair_batch(np.arange(8))
    assert got[0].keys() == want.keys()
    for key, value in want.items():
        assert got[0][key].device.type == "meta" and got[0][key].dtype == value.dtype, key
        assert got[0][key].shape == value.shape, key
    assert torch.equal(host_lengths(got[0]["word_lengths"]), want["word_lengths"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_workers,prefetch", MODES)
def test_cuda_batches_leave_pinned_memory_and_equal_the_host_batches(
    paths, monkeypatch, num_workers, prefetch
):
    """On CUDA every array reaches the device from pinned memory (what makes the
    ``non_blocking`` copy asynchronous), and the batch finished there equals the one
    finished on the host."""
    import models.data.batches

    pinned = []

    def recording(batch, device):
        pinned.extend((k, v.is_pinned()) for k, v in batch.items() if torch.is_tensor(v))
        return to_device(batch, device)

    monkeypatch.setattr(models.data.batches, "to_device", recording)
    data = PairData(paths, "train", ALL)
    data.standardize(data.feature_stats())
    tasks = [("pair", np.arange(8)), ("image", np.arange(4)), ("text", np.arange(5))]
    seen = 0
    with Batches(data, "cuda", num_workers=num_workers, prefetch=prefetch) as batches:
        for (kind, index), batch in zip(tasks, batches.run(tasks), strict=True):
            want = getattr(data, f"{kind}_batch")(index)
            assert batch.keys() == want.keys()
            for key, value in want.items():
                assert batch[key].device.type == "cuda", key
                torch.testing.assert_close(batch[key].cpu(), value, msg=key)
            seen += 1
    assert seen == len(tasks)
    assert pinned and all(is_pinned for _, is_pinned in pinned), pinned


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_steps_do_not_synchronise(tmp_path):
    """On CUDA, with sync debugging on, the training loop's own host-device syncs in an
    epoch do not grow with its number of steps (the models' own are not counted)."""
    import warnings

    data = TinyPairs(n_images=48)
    counts = []
    for batch_size in (12, 2):
        cfg = TrainConfig(epochs=1, batch_size=batch_size, device="cuda", num_workers=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train("vsepp", VSEPPConfig(embed_size=16, word_dim=8), cfg, data, data, tmp_path)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum(w.filename.endswith(os.path.join("models", "train.py")) for w in caught))
    assert counts[0] == counts[1], counts


def test_a_non_finite_input_is_refused_naming_the_store_field_and_key(tmp_path):
    """A store holding NaN (damaged, or made by a broken tool) never trains a model: the
    batch is refused, one line naming the store, the field and the sample."""
    from features.store.reader import Store
    from infra.finite import NonFiniteError

    stores = make_stores(tmp_path)
    regions = Store.open(stores.regions)
    data = PairData(stores, "train", ALL)
    position = data.image_keys.index("img004")
    original = regions.gather("features", np.array([data.image_rows["regions"][position]]))

    def poisoned(field, rows, alloc=np.empty):  # the store's values, one of them NaN
        values = Store.gather(data.stores["regions"], field, rows, alloc)
        if field == "features":
            values = values.copy()
            values[np.asarray(rows) == data.image_rows["regions"][position], 0, 0] = np.nan
        return values

    data.stores["regions"].gather = poisoned
    assert np.isfinite(original).all()
    captions = np.flatnonzero(data.caption_image == position)
    with pytest.raises(NonFiniteError, match=r"regions.zarr: field 'features' of 'img004'"):
        data.build("pair", np.concatenate([[0], captions]))
    data.build("pair", np.array([0, 1]))  # the other samples are fine


def test_a_dimension_dead_on_train_cannot_dominate_a_standardised_test_image():
    """A ReLU unit that never fires on train has std ~0; floored at a tenth of the typical
    std, its value on a test image is scaled like a 10x-quieter dimension, not by 1/eps."""
    from models.data.arrays import floored_std

    rng = np.random.default_rng(0)
    train = np.abs(rng.normal(size=(500, 64)))
    train[:, :5] = 0.0  # dead on train
    std = floored_std(train.std(0, ddof=1))
    typical = np.sqrt(np.mean(np.square(train.std(0, ddof=1))))
    assert np.allclose(std[:5], 0.1 * typical)
    np.testing.assert_array_equal(std[5:], train.std(0, ddof=1)[5:])  # the rest untouched
    test = np.abs(rng.normal(size=64))  # the dead units fire at test time
    z = (test - train.mean(0)) / std
    assert np.abs(z[:5]).max() <= 10 * test[:5].max() / typical + 1e-9


def test_the_next_batch_is_staged_before_this_one_is_handed_out():
    """On CUDA batch i + 1's copy starts before step i gets batch i (models.data.staging)."""
    log = []

    def start(item):
        log.append(f"start {item}")
        return item * 10

    given = []
    for item, begun in one_ahead(iter(range(3)), start):
        log.append(f"give {item}")
        given.append((item, begun))
    assert given == [(0, 0), (1, 10), (2, 20)]
    assert log == ["start 0", "start 1", "give 0", "start 2", "give 1", "give 2"]
    assert list(one_ahead(iter([]), start)) == []
