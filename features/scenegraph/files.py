"""The scene-graph folder that stage ``scenegraph`` writes and UniVSE, the adversarial
stage and the WebDataset shards read::

    scenegraphs/
      graphs.parquet    one row per caption: key, caption, objects, attributes, relations
      negatives.json    UniVSE's negative-sampling vocabularies from train captions:
                        {"nouns" | "adjectives" | "relations": {lemma: count}}

Apart from the parser's rules (:mod:`features.scenegraph`), so that code reading graphs
does not depend on how they are made.
"""

from __future__ import annotations

import json
from pathlib import Path

from infra.config import UserError
from infra.files import atomic_path, write_json

GRAPHS, NEGATIVES = "graphs.parquet", "negatives.json"


def schema():
    """The columns of ``graphs.parquet`` (fixed, so an empty or odd batch of rows writes
    the same schema)."""
    import pyarrow as pa

    s, i = pa.string(), pa.int64()

    def records(**fields):
        return pa.list_(pa.struct(list(fields.items())))

    return pa.schema(
        [
            ("key", s),
            ("caption", s),
            ("objects", records(span=s, head=s, lemma=s)),
            ("attributes", records(object=i, attribute=s, lemma=s)),
            ("relations", records(subject=i, relation=s, lemma=s, object=i)),
        ]
    )


def write_scene_graphs(folder: str | Path, graphs, negatives: dict) -> None:
    """Write the folder atomically: it appears whole or not at all; the same graphs (an
    Arrow table of :func:`schema`, or its rows as dicts) give the same bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not isinstance(graphs, pa.Table):
        graphs = pa.Table.from_pylist(graphs, schema=schema())
    with atomic_path(folder, directory=True) as tmp:
        pq.write_table(graphs.combine_chunks(), tmp / GRAPHS)  # one chunk: the same bytes
        write_json(tmp / NEGATIVES, negatives, indent=1)


def _file(folder: str | Path, name: str) -> Path:
    path = Path(folder) / name
    if not path.is_file():
        raise UserError(
            f"{path}: missing; {folder} is not a scene-graph folder (run `dvc repro scenegraph`)"
        )
    return path


def read_graph_rows(folder: str | Path, keys=None, columns=None) -> list[dict]:
    """The rows of ``graphs.parquet`` in caption order: every row, or those of the caption
    ``keys`` (an iterable), selected in Arrow before any row becomes Python objects;
    ``columns``: the columns read (all by default)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(_file(folder, GRAPHS), columns=columns)
    if keys is not None:
        table = table.filter(pc.is_in(table["key"], value_set=pa.array(list(keys), pa.string())))
    return table.to_pylist()


def read_graph_table(folder: str | Path, keys: list[str]):
    """The graphs (key, objects, attributes, relations) of the captions ``keys``, in that
    order, as an Arrow table (a batch takes its rows: COCO's 616K graphs as Python objects
    would hold GBs)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    columns = ["key", "objects", "attributes", "relations"]
    table = pq.read_table(_file(folder, GRAPHS), columns=columns)
    positions = pc.index_in(pa.array(keys, pa.string()), value_set=table["key"])
    if positions.null_count:
        missing = [k for k, p in zip(keys, positions.is_null().to_pylist(), strict=True) if p]
        raise UserError(
            f"{Path(folder) / GRAPHS}: no scene graph for {len(missing)} captions (first: "
            f"{missing[0]}); rerun `dvc repro scenegraph`"
        )
    return table.take(positions)


def read_negatives(folder: str | Path) -> dict[str, dict[str, int]]:
    return json.loads(_file(folder, NEGATIVES).read_text())
