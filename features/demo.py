"""Synthetic demo dataset: coloured geometric objects with Flickr30K-style captions.

Each image shows 2-4 objects (6 shapes x 6 colours x 2 sizes) on a textured background.
Each image gets five captions written from different views, as Flickr30K annotators did:
one describes all objects, the others focus on one object's attributes, on a spatial
relation between two objects, or on the count and the background. Captions come from a
small grammar, so each caption ships with its gold dependency tree (words, lemmas, POS,
heads, dependency labels in spaCy's English scheme) and its gold scene graph (objects,
attribute-object pairs, relation triples, all as lemmas). The class label of an image is
the shape of its largest object (HUSE needs class labels and class names).

The output is a Karpathy-style ``dataset.json`` (``images[].filename/split/sentences[].raw``)
with demo extras (``label``, ``boxes``, ``box_names``, per-sentence ``tree`` and
``scene_graph``), so ``prepare`` reads it with the Karpathy reader.

Generation is deterministic: image ``i`` of split ``s`` uses the random stream
``(seed, s, i)``, so changing one split's size leaves the other splits' images unchanged.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from pydantic import Field, model_validator

from features.ingest.manifest import SPLITS
from infra.config import Section, Seed

SHAPES = ("circle", "square", "triangle", "star", "hexagon", "diamond")
COLORS = {
    "red": (214, 39, 40),
    "green": (44, 160, 44),
    "blue": (31, 90, 220),
    "yellow": (240, 210, 30),
    "purple": (148, 60, 189),
    "orange": (255, 127, 14),
}
SIZES = ("small", "large")
TEXTURES = ("striped", "checkered", "dotted", "speckled")

# Surface words per concept: the grammar draws one at random, the scene graph keeps its lemma.
SHAPE_WORDS = {
    "circle": ("circle", "disc", "disk"),
    "square": ("square", "block"),
    "triangle": ("triangle",),
    "star": ("star",),
    "hexagon": ("hexagon",),
    "diamond": ("diamond", "rhombus"),
}
COLOR_WORDS = {
    "red": ("red", "crimson"),
    "green": ("green",),
    "blue": ("blue",),
    "yellow": ("yellow",),
    "purple": ("purple", "violet"),
    "orange": ("orange",),
}
SIZE_WORDS = {"small": ("small", "little", "tiny"), "large": ("large", "big", "huge")}
NUMBERS = {2: "two", 3: "three", 4: "four"}
SHAPE_NOUNS = ("shapes", "objects", "figures")
# Spatial relations: each entry is a list of phrasal prepositions, given as words.
RELATION_PREPS = {
    "above": (("above",), ("over",)),
    "below": (("below",), ("under",), ("beneath",)),
    "left": (("to", "the", "left", "of"), ("next", "to"), ("beside",)),
    "right": (("to", "the", "right", "of"), ("next", "to"), ("beside",)),
}
VERBS = {"sit": ("sits", "sitting"), "lie": ("lies", "lying"), "float": ("floats", "floating")}


class DemoConfig(Section):
    """``demo`` section of params.yaml: the synthetic dataset's size and content."""

    seed: Seed = 0
    n_train: int = Field(600, ge=1)
    n_val: int = Field(100, ge=1)
    n_test: int = Field(100, ge=1)
    image_size: int = Field(128, ge=64, le=1024)
    captions_per_image: int = Field(5, ge=1)
    min_objects: int = Field(2, ge=2, le=4)
    max_objects: int = Field(4, ge=2, le=4)

    @model_validator(mode="after")
    def _objects(self) -> DemoConfig:
        if self.min_objects > self.max_objects:
            raise ValueError(f"min_objects ({self.min_objects}) > max_objects ({self.max_objects})")
        return self


@dataclass(frozen=True)
class DemoObject:
    shape: str
    color: str
    size: str
    box: tuple[float, float, float, float]  # x1, y1, x2, y2 in pixels

    @property
    def area(self) -> float:
        x1, y1, x2, y2 = self.box
        return (x2 - x1) * (y2 - y1)

    @property
    def center(self) -> tuple[float, float]:
        x1, y1, x2, y2 = self.box
        return (x1 + x2) / 2, (y1 + y2) / 2


# --------------------------------------------------------------------------- captions


@dataclass
class Caption:
    """A caption built token by token, with its dependency tree and scene graph.

    ``heads`` are absolute token indices (the root points to itself), as ``spacy.tokens.Doc``
    takes them. Scene-graph entries refer to objects by their index in ``objects``.
    """

    view: str
    words: list[str] = field(default_factory=list)
    lemmas: list[str] = field(default_factory=list)
    pos: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    heads: list[int] = field(default_factory=list)
    deps: list[str] = field(default_factory=list)
    spaces: list[bool] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)
    attributes: list[tuple[int, str]] = field(default_factory=list)
    relations: list[tuple[int, str, int]] = field(default_factory=list)

    def add(self, word: str, pos: str, tag: str, lemma: str | None = None) -> int:
        self.words.append(word)
        self.lemmas.append(lemma or word)
        self.pos.append(pos)
        self.tags.append(tag)
        self.heads.append(len(self.heads))  # attached later; a root points to itself
        self.deps.append("ROOT")
        self.spaces.append(True)
        return len(self.words) - 1

    def attach(self, child: int, head: int, dep: str) -> None:
        self.heads[child] = head
        self.deps[child] = dep

    @property
    def raw(self) -> str:
        pairs = zip(self.words, self.spaces, strict=True)
        return "".join(w + (" " if s else "") for w, s in pairs).strip()

    def to_json(self) -> dict:
        spaces = list(self.spaces)
        spaces[-1] = False
        return {
            "raw": self.raw,
            "tokens": [w.lower() for w in self.words if w != ","],
            "view": self.view,
            "tree": {
                "words": self.words,
                "spaces": spaces,
                "lemmas": self.lemmas,
                "pos": self.pos,
                "tags": self.tags,
                "heads": self.heads,
                "deps": self.deps,
            },
            "scene_graph": {
                "objects": self.objects,
                "attributes": [list(a) for a in self.attributes],
                "relations": [list(r) for r in self.relations],
            },
        }


def _pick(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


def _article(next_word: str) -> str:
    return "an" if next_word[0] in "aeiou" else "a"


def _noun_phrase(
    cap: Caption,
    rng: np.random.Generator,
    obj: DemoObject,
    *,
    det: str | None = None,
    size: bool = True,
    color: bool = True,
) -> int:
    """Append ``det (size) (color) shape`` and record the object; returns the noun's index."""
    adjectives = []
    if size:
        adjectives.append(_pick(rng, SIZE_WORDS[obj.size]))
    if color:
        adjectives.append(_pick(rng, COLOR_WORDS[obj.color]))
    noun = _pick(rng, SHAPE_WORDS[obj.shape])
    det = det or _pick(rng, ("a", "the"))
    if det == "a":
        det = _article((adjectives or [noun])[0])
    d = cap.add(det, "DET", "DT", lemma=det.lower())
    adj_ids = [cap.add(a, "ADJ", "JJ") for a in adjectives]
    n = cap.add(noun, "NOUN", "NN")
    cap.attach(d, n, "det")
    object_id = len(cap.objects)
    cap.objects.append(noun)
    for a, word in zip(adj_ids, adjectives, strict=True):
        cap.attach(a, n, "amod")
        cap.attributes.append((object_id, word))
    return n


def _prep_phrase(cap: Caption, head: int, prep_words: tuple[str, ...]) -> int:
    """Append a (phrasal) preposition attached to ``head``; returns the token the object hangs on.

    Trees follow spaCy's English scheme: ``above`` is ``prep``; ``next to`` is ``next``
    (advmod) + ``to`` (prep); ``to the left of`` is ``to`` (prep) + ``the left`` (pobj)
    + ``of`` (prep).
    """
    if prep_words == ("next", "to"):
        nxt = cap.add("next", "ADV", "RB")
        cap.attach(nxt, head, "advmod")
        to = cap.add("to", "ADP", "IN")
        cap.attach(to, nxt, "prep")
        return to
    if len(prep_words) == 4:  # to the left/right of
        to = cap.add("to", "ADP", "IN")
        cap.attach(to, head, "prep")
        the = cap.add("the", "DET", "DT")
        side = cap.add(prep_words[2], "NOUN", "NN")
        cap.attach(the, side, "det")
        cap.attach(side, to, "pobj")
        of = cap.add("of", "ADP", "IN")
        cap.attach(of, side, "prep")
        return of
    (word,) = prep_words
    p = cap.add(word, "ADP", "IN")
    cap.attach(p, head, "prep")
    return p


def _background(cap: Caption, head: int, texture: str, subjects) -> None:
    """Append ``on a <texture> background``; every subject is related to the background."""
    on = cap.add("on", "ADP", "IN")
    cap.attach(on, head, "prep")
    det = cap.add(_article(texture), "DET", "DT")
    adj = cap.add(texture, "ADJ", "JJ")
    noun = cap.add("background", "NOUN", "NN")
    cap.attach(det, noun, "det")
    cap.attach(adj, noun, "amod")
    cap.attach(noun, on, "pobj")
    background = len(cap.objects)
    cap.objects.append("background")
    cap.attributes.append((background, texture))
    cap.relations.extend((s, "on", background) for s in subjects)


def _list_of_objects(cap: Caption, rng: np.random.Generator, objects) -> int:
    """``A, B and C``: the first conjunct heads the list; each conjunct hangs on the previous."""
    heads = []
    for k, obj in enumerate(objects):
        if k > 0:
            if k == len(objects) - 1:
                cc = cap.add("and", "CCONJ", "CC")
                cap.attach(cc, heads[-1], "cc")
            else:
                cap.spaces[-1] = False
                cap.attach(cap.add(",", "PUNCT", ","), heads[-1], "punct")
        n = _noun_phrase(cap, rng, obj, det="a", size=bool(rng.random() < 0.7))
        if heads:
            cap.attach(n, heads[-1], "conj")
        heads.append(n)
    return heads[0]


def caption_all_objects(rng, objects, texture) -> Caption:
    cap = Caption("all_objects")
    template = int(rng.integers(3))
    if template == 2:  # "an image of A, B and C"
        det = cap.add(_pick(rng, ("an", "a")), "DET", "DT")
        frame = cap.add("image" if cap.words[det] == "an" else "picture", "NOUN", "NN")
        cap.attach(det, frame, "det")
        of = cap.add("of", "ADP", "IN")
        cap.attach(of, frame, "prep")
        first = _list_of_objects(cap, rng, objects)
        cap.attach(first, of, "pobj")
        # The frame noun is not a depicted object: keep the graph to what is in the image.
        return cap
    first = _list_of_objects(cap, rng, objects)
    if template == 1:  # "A, B and C on a striped background"
        _background(cap, first, texture, range(len(objects)))
    return cap


def caption_attributes(rng, obj: DemoObject, texture) -> Caption:
    cap = Caption("attributes")
    template = int(rng.integers(4))
    if template in (0, 1):  # "a large red circle (on a dotted background)"
        n = _noun_phrase(cap, rng, obj, det="a")
        if template == 1:
            _background(cap, n, texture, [0])
    elif template == 2:  # "the circle is large and red"
        n = _noun_phrase(cap, rng, obj, det="the", size=False, color=False)
        be = cap.add("is", "AUX", "VBZ", lemma="be")
        cap.attach(n, be, "nsubj")
        first = cap.add(_pick(rng, SIZE_WORDS[obj.size]), "ADJ", "JJ")
        cap.attach(first, be, "acomp")
        cc = cap.add("and", "CCONJ", "CC")
        cap.attach(cc, first, "cc")
        second = cap.add(_pick(rng, COLOR_WORDS[obj.color]), "ADJ", "JJ")
        cap.attach(second, first, "conj")
        cap.attributes += [(0, cap.words[first]), (0, cap.words[second])]
    else:  # "there is a large red circle"
        there = cap.add("there", "PRON", "EX")
        be = cap.add("is", "VERB", "VBZ", lemma="be")
        cap.attach(there, be, "expl")
        n = _noun_phrase(cap, rng, obj, det="a")
        cap.attach(n, be, "attr")
    return cap


def spatial_relation(a: DemoObject, b: DemoObject) -> str:
    """Where ``a`` is relative to ``b``: the dominant axis of the centre offset decides."""
    (ax, ay), (bx, by) = a.center, b.center
    if abs(by - ay) >= abs(bx - ax):
        return "above" if ay < by else "below"
    return "left" if ax < bx else "right"


def caption_relation(rng, a: DemoObject, b: DemoObject) -> Caption:
    cap = Caption("relation")
    prep_words = _pick(rng, RELATION_PREPS[spatial_relation(a, b)])
    template = int(rng.integers(4))
    subj = _noun_phrase(cap, rng, a, size=bool(rng.random() < 0.5))
    if template == 0:  # "a red circle above a blue square"
        head, predicate = subj, []
    elif template == 1:  # "the red circle is above the blue square"
        head = cap.add("is", "AUX", "VBZ", lemma="be")
        cap.attach(subj, head, "nsubj")
        predicate = []
    else:
        verb = _pick(rng, sorted(VERBS))
        finite, participle = VERBS[verb]
        if template == 2:  # "a red circle sitting above a blue square"
            head = cap.add(participle, "VERB", "VBG", lemma=verb)
            cap.attach(head, subj, "acl")
        else:  # "a red circle lies above a blue square"
            head = cap.add(finite, "VERB", "VBZ", lemma=verb)
            cap.attach(subj, head, "nsubj")
        predicate = [verb]
    p = _prep_phrase(cap, head, prep_words)
    obj = _noun_phrase(cap, rng, b, size=bool(rng.random() < 0.5))
    cap.attach(obj, p, "pobj")
    cap.relations.append((0, " ".join(predicate + list(prep_words)), 1))
    return cap


def caption_count(rng, objects, texture) -> Caption:
    """``three shapes on a dotted background``: the numeral is an attribute of the noun."""
    cap = Caption("count")
    num = cap.add(NUMBERS[len(objects)], "NUM", "CD")
    noun = _pick(rng, SHAPE_NOUNS)
    n = cap.add(noun, "NOUN", "NNS", lemma=noun[:-1])
    cap.attach(num, n, "nummod")
    cap.objects.append(noun[:-1])
    cap.attributes.append((0, cap.words[num]))
    _background(cap, n, texture, [0])
    return cap


def write_captions(rng, objects: list[DemoObject], texture: str, n: int) -> list[Caption]:
    """Caption 0 describes all objects; the rest focus on attributes, relations or counts."""
    captions = [caption_all_objects(rng, objects, texture)]
    while len(captions) < n:
        view = rng.random()
        if view < 0.4:
            captions.append(caption_attributes(rng, _pick(rng, objects), texture))
        elif view < 0.85:
            i, j = rng.choice(len(objects), size=2, replace=False)
            captions.append(caption_relation(rng, objects[i], objects[j]))
        else:
            captions.append(caption_count(rng, objects, texture))
    return captions


# --------------------------------------------------------------------------- images


def _outline(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    """Vertices of ``shape`` centred at (cx, cy) inscribed in a circle of radius r; a circle
    is approximated by 64 vertices (only for its box)."""
    if shape == "circle":
        return [
            (cx + r * math.cos(t), cy + r * math.sin(t)) for t in np.linspace(0, 2 * math.pi, 65)
        ]
    if shape == "square":
        s = r / math.sqrt(2) * 1.25
        return [(cx - s, cy - s), (cx + s, cy - s), (cx + s, cy + s), (cx - s, cy + s)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + 0.7 * r, cy), (cx, cy + r), (cx - 0.7 * r, cy)]
    if shape == "triangle":
        angles, radii = [90, 210, 330], [r] * 3
    elif shape == "hexagon":
        angles, radii = list(range(0, 360, 60)), [r] * 6
    elif shape == "star":
        angles, radii = list(range(90, 450, 36)), [r, 0.45 * r] * 5
    else:
        raise ValueError(f"not a polygon shape: {shape}")
    return [
        (cx + rad * math.cos(math.radians(a)), cy - rad * math.sin(math.radians(a)))
        for a, rad in zip(angles, radii, strict=True)
    ]


def _background_image(rng: np.random.Generator, texture: str, size: int) -> np.ndarray:
    """A muted grey texture, so that object colours stay the salient signal."""
    base = rng.uniform(150, 215)
    contrast = rng.uniform(15, 35)
    yy, xx = np.mgrid[0:size, 0:size]
    if texture == "striped":
        period = rng.integers(6, 14)
        pattern = ((xx + yy * rng.choice([0, 1])) // period) % 2
    elif texture == "checkered":
        period = rng.integers(8, 20)
        pattern = (xx // period + yy // period) % 2
    elif texture == "dotted":
        period = int(rng.integers(8, 14))
        d = np.hypot(xx % period - period / 2, yy % period - period / 2)
        pattern = (d < period / 5).astype(float)
    else:  # speckled
        pattern = rng.random((size, size))
    grey = base + contrast * (pattern - 0.5) + rng.normal(0, 4, (size, size))
    tint = rng.uniform(-8, 8, size=3)
    return np.clip(grey[..., None] + tint, 0, 255).astype(np.uint8)


def _place_objects(rng: np.random.Generator, cfg: DemoConfig):
    """Sample 2-4 objects at non-overlapping positions (rejection sampling, retried).

    Returns ``(objects, outlines)``: the drawn polygon of each object beside its record.
    """
    scale = cfg.image_size / 128
    radius = {"small": (9 * scale, 13 * scale), "large": (18 * scale, 24 * scale)}
    while True:
        n = int(rng.integers(cfg.min_objects, cfg.max_objects + 1))
        objects: list[DemoObject] = []
        outlines = []
        for _ in range(n):
            shape = _pick(rng, SHAPES)
            color = _pick(rng, list(COLORS))
            size = _pick(rng, SIZES)
            r = rng.uniform(*radius[size])
            for _attempt in range(100):
                cx, cy = rng.uniform(r + 2, cfg.image_size - r - 2, size=2)
                outline = _outline(shape, cx, cy, r)
                xs, ys = zip(*outline, strict=True)
                box = (min(xs), min(ys), max(xs), max(ys))
                if all(_gap(box, o.box) > 3 * scale for o in objects):
                    objects.append(
                        DemoObject(shape, color, size, tuple(round(float(v), 2) for v in box))
                    )
                    outlines.append(outline)
                    break
            else:
                break  # no room left: draw a new layout
        if len(objects) == n:
            return objects, outlines


def _gap(a, b) -> float:
    """Distance between two boxes along the axis where they are apart (negative if they overlap)."""
    return max(b[0] - a[2], a[0] - b[2], b[1] - a[3], a[1] - b[3])


def render(rng: np.random.Generator, cfg: DemoConfig) -> tuple[Image.Image, list[DemoObject], str]:
    """Draw a textured background, then each object filled with its colour."""
    texture = _pick(rng, TEXTURES)
    image = Image.fromarray(_background_image(rng, texture, cfg.image_size))
    objects, outlines = _place_objects(rng, cfg)
    draw = ImageDraw.Draw(image)
    for obj, outline in zip(objects, outlines, strict=True):
        if obj.shape == "circle":
            draw.ellipse(obj.box, fill=COLORS[obj.color])
        else:
            draw.polygon(outline, fill=COLORS[obj.color])
    return image, objects, texture


# --------------------------------------------------------------------------- dataset


def class_of(objects: list[DemoObject]) -> int:
    """The image's class: the shape of its largest object (first one on ties)."""
    largest = max(objects, key=lambda o: o.area)
    return SHAPES.index(largest.shape)


def generate_image(cfg: DemoConfig, split: str, index: int) -> tuple[Image.Image, dict]:
    """One image and its Karpathy-style record (no ids yet), from the stream (seed, split, i)."""
    rng = np.random.default_rng([cfg.seed, SPLITS.index(split), index])
    image, objects, texture = render(rng, cfg)
    captions = write_captions(rng, objects, texture, cfg.captions_per_image)
    record = {
        "filename": f"{split}_{index:05d}.png",
        "filepath": "",
        "split": split,
        "sentences": [c.to_json() for c in captions],
        "label": class_of(objects),
        "boxes": [list(o.box) for o in objects],
        "box_names": [o.shape for o in objects],
        "objects": [{k: v for k, v in asdict(o).items() if k != "box"} for o in objects],
        "background": texture,
    }
    return image, record


def build_dataset(cfg: DemoConfig, out_dir: Path, progress=None) -> int:
    """Write ``images/*.png`` and ``dataset.json`` under ``out_dir``; returns the number of
    images.

    ``dataset.json`` is written record by record as the images are made, in the bytes
    ``json.dumps(dataset, indent=1)`` gives for the whole dict, so memory stays flat in the
    dataset's size. The folder is built aside and moved into place whole, so ``out_dir``
    is never a partial dataset. ``progress`` wraps the item iterator (e.g. ``tqdm``) to
    show images/s.
    """
    from infra.files import atomic_path

    out_dir = Path(out_dir)
    if out_dir.exists() and not (out_dir / "dataset.json").is_file() and any(out_dir.iterdir()):
        from infra.config import UserError

        raise UserError(
            f"{out_dir} exists and is not a demo dataset (no dataset.json); remove it or "
            "choose another --out"
        )
    sizes = (cfg.n_train, cfg.n_val, cfg.n_test)
    items = [(s, i) for s, n in zip(SPLITS, sizes, strict=True) for i in range(n)]
    header = {"dataset": "demo", "seed": cfg.seed, "class_names": list(SHAPES)}
    sentid = 0
    with atomic_path(out_dir, directory=True) as tmp:
        (tmp / "images").mkdir()
        with open(tmp / "dataset.json", "w", encoding="utf-8") as out:
            # the header's closing "\n}" cut off: the images list is its last key
            out.write(json.dumps(header, indent=1)[:-2] + ',\n "images": [')
            for imgid, (split, index) in enumerate(progress(items) if progress else items):
                image, record = generate_image(cfg, split, index)
                image.save(tmp / "images" / record["filename"], optimize=False, compress_level=6)
                record["imgid"] = imgid
                record["sentids"] = list(range(sentid, sentid + len(record["sentences"])))
                for sentence, sid in zip(record["sentences"], record["sentids"], strict=True):
                    sentence.update(imgid=imgid, sentid=sid)
                sentid += len(record["sentences"])
                # a list item two levels deep: each of its lines indented by two more
                text = json.dumps(record, indent=1).replace("\n", "\n  ")
                out.write(("\n  " if imgid == 0 else ",\n  ") + text)
            out.write("\n ]\n}\n")
    return len(items)
