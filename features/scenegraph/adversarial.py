"""Text-domain adversarial captions (UniVSE 4.2, following VSE-C): for each real caption,
fake captions that no longer match the image, made by editing its scene graph. Each attack
(object, attribute, relation) replaces one of the caption's by one that none of the image's
captions use, or adds one where the caption has none (:func:`_attack`).

Each fake caption keeps a scene graph edited the same way, so models that read scene
graphs (UniVSE) see a consistent input. Vocabularies are the train split's
(``negatives.json``); choices are seeded per caption key, so the set is reproducible.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path

import numpy as np
from pydantic import Field

from infra.config import Section, Seed

ATTACKS = ("object", "attribute", "relation")
BLOCK = 50_000  # fake captions made and written at a time (the demo's all fit in one)


class AdversarialConfig(Section):
    """``adversarial`` section of params.yaml."""

    per_caption: int = Field(5, ge=1)  # fake captions per real caption and attack (paper: 5)
    splits: list[str] = ["val", "test"]
    seed: Seed = 0
    max_tries: int = Field(50, ge=1)


def _replace_word(text: str, old: str, new: str) -> str | None:
    """``text`` with the first whole-word ``old`` replaced; None if it does not occur."""
    pattern = re.compile(rf"\b{re.escape(old)}\b", re.IGNORECASE)
    out, n = pattern.subn(new, text, count=1)
    return out if n else None


def _image_concepts(graphs: Sequence[dict]) -> dict[str, set[str]]:
    """Everything the image's captions mention: lemmas of objects, attributes, relations."""
    out = {"nouns": set(), "adjectives": set(), "relations": set()}
    for g in graphs:
        out["nouns"].update(o["lemma"] for o in g["objects"])
        out["nouns"].update(o["head"] for o in g["objects"])
        out["adjectives"].update(a["lemma"] for a in g["attributes"])
        out["relations"].update(r["lemma"] for r in g["relations"])
    return out


def _attack(attack: str, row: dict, concepts: dict, vocab: dict, rng) -> tuple[str, dict] | None:
    """One fake caption and its scene graph, or None when this try found no edit: a new
    object noun replaces one (or is appended: "... and a <noun>"), a new attribute replaces
    one (or is put before an object's name), a new relation replaces one written as a phrase
    in the caption (or attaches a new object to one: "... <relation> a <noun>")."""
    graph = {k: copy.deepcopy(row[k]) for k in ("objects", "attributes", "relations")}
    text = row["caption"]

    def pick(pool: str) -> str | None:
        options = [w for w in vocab[pool] if w not in concepts[pool]]
        return options[rng.integers(len(options))] if options else None

    if attack == "object":
        noun = pick("nouns")
        if noun is None:
            return None
        if graph["objects"]:
            i = int(rng.integers(len(graph["objects"])))
            old = graph["objects"][i]
            # the whole name of a compound ("fire hydrant"), else its head word
            text = _replace_word(text, old["span"], noun) or _replace_word(text, old["head"], noun)
            graph["objects"][i] = {"span": noun, "head": noun, "lemma": noun}
        else:
            text = f"{text} and a {noun}"
            graph["objects"].append({"span": noun, "head": noun, "lemma": noun})
    elif attack == "attribute":
        adjective = pick("adjectives")
        if adjective is None or not graph["objects"]:
            return None
        if graph["attributes"]:
            i = int(rng.integers(len(graph["attributes"])))
            text = _replace_word(text, graph["attributes"][i]["attribute"], adjective)
            graph["attributes"][i].update(attribute=adjective, lemma=adjective)
        else:
            o = int(rng.integers(len(graph["objects"])))
            span, head = graph["objects"][o]["span"], graph["objects"][o]["head"]
            # before the whole name: "a green fire hydrant", not "a fire green hydrant"
            text = _replace_word(text, span, f"{adjective} {span}") or _replace_word(
                text, head, f"{adjective} {head}"
            )
            graph["attributes"].append({"object": o, "attribute": adjective, "lemma": adjective})
    else:
        relation = pick("relations")
        if relation is None or not graph["objects"]:
            return None
        # relations written as one phrase in the caption ("sitting on", not "sitting alone
        # on" nor a possessive's "have") can be replaced; otherwise one is attached
        replaceable = [
            i
            for i, r in enumerate(graph["relations"])
            if _replace_word(text, r["relation"], relation) is not None
        ]
        if replaceable:
            i = replaceable[int(rng.integers(len(replaceable)))]
            text = _replace_word(text, graph["relations"][i]["relation"], relation)
            graph["relations"][i].update(relation=relation, lemma=relation)
        else:
            noun = pick("nouns")
            if noun is None:
                return None
            s, o = int(rng.integers(len(graph["objects"]))), len(graph["objects"])
            text = f"{text} {relation} a {noun}"
            graph["objects"].append({"span": noun, "head": noun, "lemma": noun})
            graph["relations"].append(
                {"subject": s, "relation": relation, "lemma": relation, "object": o}
            )
    if text is None or text == row["caption"]:
        return None
    return text, graph


def adversarial_captions(
    rows: Sequence[dict], image_keys: Sequence[str], vocab: dict, cfg: AdversarialConfig
) -> Iterator[dict]:
    """Fake captions for each scene-graph row (``rows[i]`` describes a caption of image
    ``image_keys[i]``), made one row at a time: up to ``per_caption`` distinct ones per
    attack, keyed ``<caption key>~<attack>~<j>``."""
    by_image: dict[str, list[dict]] = defaultdict(list)
    for row, image in zip(rows, image_keys, strict=True):
        by_image[image].append(row)
    vocab = {k: list(v) for k, v in vocab.items()}
    for row, image in zip(rows, image_keys, strict=True):
        concepts = _image_concepts(by_image[image])
        seed = int.from_bytes(hashlib.sha256(f"{cfg.seed}:{row['key']}".encode()).digest()[:8])
        rng = np.random.default_rng(seed)
        for attack in ATTACKS:
            made: set[str] = set()
            for _ in range(cfg.max_tries):
                if len(made) == cfg.per_caption:
                    break
                fake = _attack(attack, row, concepts, vocab, rng)
                if fake is None or fake[0] in made:
                    continue
                made.add(fake[0])
                yield {
                    "key": f"{row['key']}~{attack}~{len(made) - 1}",
                    "source": row["key"],
                    "image": image,
                    "attack": attack,
                    "caption": fake[0],
                    **fake[1],
                }


def captions_schema():
    """The columns of the fake captions' parquet: key, source caption, image, attack,
    caption, and its edited graph in ``graphs.parquet``'s types."""
    import pyarrow as pa

    from features.scenegraph.files import schema

    names = ("key", "source", "image", "attack", "caption")
    graph = [schema().field(name) for name in ("objects", "attributes", "relations")]
    return pa.schema([(name, pa.string()) for name in names] + graph)


def _write_captions(fakes: Iterator[dict], path: Path) -> tuple[list, list, Counter]:
    """Write ``fakes`` to the parquet ``path`` (atomically) :data:`BLOCK` at a time; their
    keys, their captions and the count per attack."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from infra.files import atomic_path

    keys, captions, counts = [], [], Counter()
    schema = captions_schema()
    with atomic_path(path) as tmp, pq.ParquetWriter(tmp, schema) as out:
        while block := list(islice(fakes, BLOCK)):
            out.write_table(pa.Table.from_pylist(block, schema=schema))
            keys += [f["key"] for f in block]
            captions += [f["caption"] for f in block]
            counts.update(f["attack"] for f in block)
    return keys, captions, counts


def adversarial_stage(
    manifest,
    scene_graphs: Path,
    vocab: Path,
    cfg: AdversarialConfig,
    encoder,
    text_cfg,
    weights: str,
    captions_out: Path,
    store_out: Path,
    store_cfg,
    progress=None,
) -> dict[str, int]:
    """Stage ``adversarial``: the fake captions of every caption of ``cfg.splits`` (a
    parquet), made from the scene graphs and negative vocabularies of the folder
    ``scene_graphs``, and their text features (a caption-level store encoded like the ``text``
    stage's, with its train vocabularies). Returns the count per attack.

    The fakes are made and written :data:`BLOCK` at a time; only their keys and captions
    stay in memory for the text store (COCO's val and test make up to 750,000)."""
    import json

    from features.ingest.manifest import caption_key
    from features.scenegraph.files import read_graph_rows, read_negatives
    from features.text.stage import write_text_store

    table = manifest.table.select(["key", "split", "captions"]).to_pylist()
    image_of = {  # the captions of cfg.splits' images: the only graphs read
        caption_key(r["key"], i): r["key"]
        for r in table
        if r["split"] in cfg.splits
        for i in range(len(r["captions"]))
    }
    rows = read_graph_rows(scene_graphs, keys=image_of)
    images = [image_of[g["key"]] for g in rows]
    fakes = adversarial_captions(rows, images, read_negatives(scene_graphs), cfg)
    keys, captions, counts = _write_captions(fakes, captions_out)
    del table, image_of, rows, images, fakes  # only the keys and captions are encoded
    write_text_store(
        keys,
        captions,
        json.loads(vocab.read_text()),
        encoder,
        text_cfg,
        weights,
        manifest.digest,
        store_out,
        store_cfg,
        kind="adversarial",
        progress=progress,
    )
    return {a: counts[a] for a in ATTACKS}
