"""Scene-graph rules on gold-annotated spaCy Docs: one exact graph per caption pattern."""

import pytest
import spacy
from spacy.tokens import Doc

from features.demo import DemoConfig, generate_image
from features.demo_parser import gold_doc, gold_graph
from features.scenegraph import Parser

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
        "verb object and preposition",
        "a/DET/det/1 man/NOUN/nsubj/2 throws/VERB/ROOT/2/throw a/DET/det/4 frisbee/NOUN/dobj/2 "
        "to/ADP/prep/2 a/DET/det/7 dog/NOUN/pobj/5",
        {"man", "frisbee", "dog"},
        set(),
        {("man", "throw", "frisbee"), ("man", "throw to", "dog")},
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


@pytest.mark.parametrize(
    "name, spec, objects, attributes, relations", CASES, ids=[c[0] for c in CASES]
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


def test_demo_grammar_graphs_are_recovered_from_gold_trees():
    """Every caption template of the demo generator, parsed from its gold tree, gives
    exactly its gold scene graph (what the trained demo parser is scored against)."""
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
