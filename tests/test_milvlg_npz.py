"""MILVLG ``.npz`` files damaged the ways real files get damaged, and written by the numpy
versions people have: each damage is refused in one line naming the file and what is
wrong (:func:`read_npz`); nothing in a file is ever run; an import records where it came
from."""

import io
import pickle
import zipfile

import numpy as np
import pytest
from test_feature_files import Payload, detections, save_milvlg
from test_precomp import CFG, tsv_manifest

from features.exchange.butd_tsv import MalformedRow
from features.exchange.milvlg_npz import import_npz, read_npz
from features.ingest.manifest import IngestError
from features.store.reader import Store

N = 3


def arrays(**overrides) -> dict:
    """What MILVLG's extraction script saves for one image of ``N`` regions."""
    rng = np.random.default_rng(0)
    out = {
        "x": rng.random((N, 8)).astype(np.float32),
        "bbox": rng.random((N, 4)).astype(np.float32) * 10,
        "num_bbox": N,
        "image_h": 20,
        "image_w": 30,
        "info": {
            "objects_id": np.array([4, 0, 7]),
            "objects_conf": np.float32([0.9, 0.5, 0.3]),
            "attrs_id": np.array([1, 2, 3]),
            "attrs_conf": np.float32([0.8, 0.6, 0.2]),
        },
    }
    out.update(overrides)
    return {k: v for k, v in out.items() if v is not None}


def saved(tmp_path, name="a.npz", **overrides):
    path = tmp_path / name
    np.savez_compressed(path, **arrays(**overrides))
    return path


def refused(path) -> str:
    with pytest.raises(MalformedRow) as err:
        read_npz(path)
    return str(err.value)


def test_a_good_file_reads_as_its_arrays(tmp_path):
    row = read_npz(saved(tmp_path))
    expected = arrays()
    np.testing.assert_array_equal(row["features"], expected["x"])
    np.testing.assert_array_equal(row["boxes"], expected["bbox"])
    assert row["image_hw"] == (20, 30)
    for name in ("objects_id", "objects_conf", "attrs_id", "attrs_conf"):
        np.testing.assert_array_equal(row[name], expected["info"][name])


def test_no_info_and_no_attributes_give_the_labels_there_are(tmp_path):
    assert set(read_npz(saved(tmp_path, info=None))) == {"features", "boxes", "image_hw"}
    objects_only = {k: v for k, v in arrays()["info"].items() if k.startswith("objects")}
    row = read_npz(saved(tmp_path, "b.npz", info=objects_only))
    assert set(row) == {"features", "boxes", "image_hw", "objects_id", "objects_conf"}
    attrs_only = {k: v for k, v in arrays()["info"].items() if k.startswith("attrs")}
    row = read_npz(saved(tmp_path, "c.npz", info=attrs_only))
    assert set(row) == {"features", "boxes", "image_hw", "attrs_id", "attrs_conf"}


def test_an_image_of_one_region_reads(tmp_path):
    one = {"objects_id": np.array([5]), "objects_conf": np.float32([0.5])}
    one |= {"attrs_id": np.array([0]), "attrs_conf": np.float32([0.25])}
    path = saved(tmp_path, x=np.ones((1, 8), np.float32), bbox=np.ones((1, 4), np.float32),
                 num_bbox=1, info=one)  # fmt: skip
    row = read_npz(path)
    assert row["objects_id"].tolist() == [5] and row["attrs_id"].tolist() == [0]


def test_an_image_without_regions_and_the_largest_sizes_read(tmp_path):
    path = saved(
        tmp_path,
        x=np.zeros((0, 8), np.float32),
        bbox=np.zeros((0, 4), np.float32),
        num_bbox=0,
        image_h=np.int64(2**31 - 1),
        info={"objects_id": np.zeros(0, np.int64), "objects_conf": np.zeros(0, np.float32)},
    )
    row = read_npz(path)
    assert row["features"].shape == (0, 8) and row["image_hw"] == (2**31 - 1, 30)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"x": None, "bbox": None},
            "no x, bbox; expected x, bbox, num_bbox, image_h, image_w "
            "and info, as MILVLG's extraction script saves them",
        ),
        ({"x": np.ones((N, 8), np.int64)}, "x is int64 of shape (3, 8); expected (3, dim) floats"),
        (
            {"x": np.ones((2, 8), np.float32)},
            "x is float32 of shape (2, 8); expected (3, dim) floats",
        ),
        ({"x": np.ones(N, np.float32)}, "x is float32 of shape (3,); expected (3, dim) floats"),
        ({"bbox": np.ones((N, 5), np.float32)}, "bbox is float32 of shape (3, 5); expected (3, 4)"),
        ({"bbox": np.ones((N, 4), np.int32)}, "bbox is int32 of shape (3, 4); expected (3, 4)"),
        ({"num_bbox": np.float32(3)}, "num_bbox: float32 of shape (); expected an integer"),
        ({"num_bbox": np.array([3])}, "num_bbox: int64 of shape (1,); expected an integer"),
        ({"num_bbox": -1}, "num_bbox: int64 of shape (); expected an integer"),
        ({"image_h": np.int64(2**31)}, "image_h: int64 of shape (); expected an integer"),
        ({"image_w": 30.0}, "image_w: float64 of shape (); expected an integer"),
    ],
    ids=lambda v: "" if isinstance(v, dict) else None,
)
def test_each_damaged_array_is_one_line_naming_the_file_and_the_array(tmp_path, overrides, message):
    path = saved(tmp_path, **overrides)
    assert refused(path) == f"{path}: {message}"


LABEL_DAMAGE = [
    (
        "objects_id",
        np.float32([4, 0, 7]),
        "info objects_id is float32 of shape (3,); expected 3 class ids",
    ),
    (
        "objects_id",
        np.array([4, -1, 7]),
        "info objects_id is int64 of shape (3,); expected 3 class ids",
    ),
    (
        "objects_id",
        np.array([4, 2**31, 7]),
        "info objects_id is int64 of shape (3,); expected 3 class ids",
    ),
    ("attrs_id", np.array([1, 2]), "info attrs_id is int64 of shape (2,); expected 3 class ids"),
    (
        "objects_conf",
        np.array([1, 0, 0]),
        "info objects_conf is int64 of shape (3,); expected 3 floats",
    ),
    (
        "attrs_conf",
        np.float32([0.5]),
        "info attrs_conf is float32 of shape (1,); expected 3 floats",
    ),
]


@pytest.mark.parametrize(("label", "value", "message"), LABEL_DAMAGE)
def test_each_damaged_label_is_one_line(tmp_path, label, value, message):
    path = saved(tmp_path, info={**arrays()["info"], label: value})
    assert refused(path) == f"{path}: {message}"


def test_a_npy_array_or_a_truncated_archive_is_not_an_npz(tmp_path):
    npy = tmp_path / "a.npz"
    with open(npy, "wb") as f:
        np.save(f, np.zeros(3))
    assert refused(npy) == f"{npy}: a .npy array, not an .npz archive"
    whole = saved(tmp_path, "b.npz").read_bytes()
    cut = tmp_path / "c.npz"
    cut.write_bytes(whole[: len(whole) // 2])
    assert refused(cut) == f"{cut}: not a readable .npz (BadZipFile: File is not a zip file)"


def test_a_long_reason_is_cut_to_one_short_line(tmp_path):
    """An array whose .npy header numpy cannot take: its long complaint is cut to 120
    characters."""
    key = "k" * 150
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': (3, 8), '{key}': 1, }}"
    header += " " * ((64 - (11 + len(header)) % 64) % 64) + "\n"
    npy = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode()
    good = saved(tmp_path)
    path = tmp_path / "long.npz"
    with zipfile.ZipFile(good) as z, zipfile.ZipFile(path, "w") as out:
        for name in z.namelist():
            out.writestr(name, npy if name == "x.npy" else z.read(name))
    message = refused(path)
    prefix = f"{path}: not a readable .npz (ValueError: "
    assert message.startswith(prefix) and message.endswith(")") and "\n" not in message
    detail = message[len(prefix) : -1]
    assert detail.startswith("Header does not contain the correct keys") and len(detail) == 120


class NumpySave:
    """A pickle that asks numpy itself (``numpy.save``) to write a file when loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (np.save, (str(self.marker), np.zeros(1)))


def test_pickled_arrays_are_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    x = np.empty(N, dtype=object)
    x[:] = [Payload(marker)] * N
    path = saved(tmp_path, x=x)
    assert refused(path) == (
        f"{path}: not a readable .npz (ValueError: Object arrays cannot be loaded when "
        "allow_pickle=False)"
    )
    info = saved(tmp_path, "b.npz", info={"objects_id": NumpySave(marker)})
    assert refused(info) == f"{info}: info refused: numpy.save is not part of a numpy array"
    assert not marker.exists() and not marker.with_suffix(".npy").exists()


def with_info(tmp_path, name, info_npy: bytes):
    """A good file whose ``info.npy`` member is replaced by ``info_npy``."""
    path = saved(tmp_path, name)
    members = {}
    with zipfile.ZipFile(path) as z:
        members = {m: z.read(m) for m in z.namelist()}
    members["info.npy"] = info_npy
    with zipfile.ZipFile(path, "w") as z:
        for member, data in members.items():
            z.writestr(member, data)
    return path


def npy_bytes(array, version=None, pickled: bytes | None = None) -> bytes:
    """``array`` as a ``.npy`` file in format ``version``; with ``pickled``, its pickle
    replaced by those bytes (the header kept)."""
    f = io.BytesIO()
    np.lib.format.write_array(f, array, version=version, allow_pickle=True)
    data = f.getvalue()
    if pickled is None:
        return data
    header_end = data.index(b"\n") + 1
    return data[:header_end] + pickled


def one(value) -> np.ndarray:
    out = np.empty((), dtype=object)
    out[()] = value
    return out


def test_info_as_numpy_1_wrote_it_and_in_every_npy_format_reads(tmp_path):
    info = arrays()["info"]
    for version in ((1, 0), (2, 0)):
        path = with_info(tmp_path, f"v{version[0]}.npz", npy_bytes(one(info), version))
        np.testing.assert_array_equal(read_npz(path)["attrs_conf"], info["attrs_conf"])
    # numpy 1.x pickles arrays as numpy.core.multiarray._reconstruct (numpy 2: numpy._core)
    legacy = pickle.dumps(one(info), protocol=3).replace(b"numpy._core.", b"numpy.core.")
    assert b"numpy.core.multiarray" in legacy
    path = with_info(tmp_path, "numpy1.npz", npy_bytes(one(info), (1, 0), pickled=legacy))
    np.testing.assert_array_equal(read_npz(path)["objects_id"], info["objects_id"])


def test_info_that_is_not_one_dict_is_one_line(tmp_path):
    v3 = with_info(tmp_path, "v3.npz", npy_bytes(one(arrays()["info"]), (3, 0)))
    assert refused(v3) == f"{v3}: info: .npy format (3, 0) not supported"
    listed = with_info(tmp_path, "list.npz", npy_bytes(one([1, 2]), (1, 0)))
    assert refused(listed) == f"{listed}: info is a list, not a dict"
    two = np.empty(2, dtype=object)
    two[:] = [{}, {}]
    pair = with_info(tmp_path, "pair.npz", npy_bytes(two, (1, 0)))
    assert refused(pair) == f"{pair}: info: object array of shape (2,), not a dict"
    numbers = with_info(tmp_path, "ints.npz", npy_bytes(np.arange(2), (1, 0)))
    assert refused(numbers) == f"{numbers}: info: int64 array of shape (2,), not a dict"


def test_an_import_takes_the_labels_of_the_first_readable_file_and_records_its_source(
    tmp_path, capsys
):
    manifest = tsv_manifest(tmp_path, 4)
    folder = tmp_path / "npz"
    folder.mkdir()
    rng = np.random.default_rng(1)
    images = {f"test_{i:06d}": detections(rng, 40 + i, h=200, w=300) for i in range(4)}
    for image_id, d in images.items():
        save_milvlg(folder, image_id, d)
    (folder / "test_000000.npz").write_bytes(b"<html>")  # the first file, sorted: a proxy's page
    seen = []

    def progress(items):
        seen.append("progress")
        return items

    messages = []
    missing = import_npz(folder, manifest, tmp_path / "r.zarr", CFG, progress=progress,
                         log=messages.append)  # fmt: skip
    assert missing == [] and seen == ["progress"]
    store = Store.open(tmp_path / "r.zarr")
    assert "attrs_id" in store.fields and store.fields["features"].shape == (36, 8)
    provenance = store.attrs["inputs"]
    assert provenance["extractor"] == "import-milvlg-npz"
    assert provenance["params"] == {"files": ["npz"], "max_regions": 36}
    assert store.notes()["test_000000"] == [
        "malformed_row",
        f"{folder / 'test_000000.npz'}: not an .npz archive (a zip file): it starts b'<html>'",
    ]
    assert any("test_000000" in m for m in messages)
    assert store.samples_per_shard == CFG.samples_per_shard  # the layout asked for
    sample = store["test_000003"]
    np.testing.assert_array_equal(sample["attrs_id"], images["test_000003"]["attrs_id"][:36])
    assert capsys.readouterr().out == ""  # every message went to log


def test_a_folder_of_unreadable_files_fails_in_one_line(tmp_path):
    manifest = tsv_manifest(tmp_path, 2)
    folder = tmp_path / "npz"
    folder.mkdir()
    for i in range(2):
        (folder / f"test_{i:06d}.npz").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(IngestError) as err:
        import_npz(folder, manifest, tmp_path / "r.zarr", CFG, log=lambda m: None)
    assert str(err.value) == (
        f"{folder}: no file of the 2 matched images can be parsed as "
        "x, bbox, num_bbox, image_h, image_w with boxes; is this a bottom-up-attention npz "
        "file?"
    )
    with pytest.raises(IngestError) as err:
        import_npz(tmp_path / "none", manifest, tmp_path / "s.zarr", CFG)
    assert str(err.value) == f"{tmp_path / 'none'}: not a folder; pass the folder of .npz files"


def test_a_key_that_matches_two_files_names_the_file(tmp_path):
    """Manifest key ``test_000000`` ends in 0, the id of both ``0.npz`` and ``00.npz``."""
    manifest = tsv_manifest(tmp_path, 2)
    folder = tmp_path / "npz"
    folder.mkdir()
    d = detections(np.random.default_rng(2), 5, h=50, w=60)
    for image_id in ("0", "00"):
        save_milvlg(folder, image_id, d)
    with pytest.raises(IngestError) as err:
        import_npz(folder, manifest, tmp_path / "r.zarr", CFG, log=lambda m: None)
    assert str(err.value).startswith(
        f"{folder / '0.npz'}: manifest key 'test_000000' matches image ids ['0', '00']"
    )
