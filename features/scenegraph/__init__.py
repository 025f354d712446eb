"""Rule-based scene graphs of captions from a spaCy dependency parse: the rules of Schuster
et al. 2015 ("Generating semantically precise scene graphs from textual descriptions") as
the SceneGraphParser package (github.com/vacancy/SceneGraphParser) applies them to spaCy,
with the fixes real COCO/Flickr30K captions need. UniVSE (Wu et al. 2019, sec. 3.2) encodes
the three kinds of components: objects, attribute-object pairs, relation triples.

Every name is kept as its surface form and its lemma; evaluation and the negative
vocabularies use lemmas. Conventions (also the ones of ``tests/data/captions_gold.jsonl``):

Objects
  Nouns heading a noun phrase. Noun modifiers fold into the name at every level ("video
  game controller"), including nouns the parser labels ``amod``/``nmod`` ("living room") and
  a closed list of lexicalised adjective-noun names (:data:`LEXICAL_COMPOUNDS`: "hot dog",
  "polar bear"). Not objects: pronouns (no coreference: relations to them are dropped);
  frame nouns ("a picture of", "a close up of": the object is what the frame shows);
  quantity nouns ("a couple of", "lots of": the noun after "of" is the object); nouns of
  phrasal prepositions ("front" in "in front of"). Collective nouns stay objects ("a group
  of people": (group, of, people)), but what the group does, its members do ("a herd of
  elephants walking": (elephant, walk, ...)).
Attributes
  Adjectives and numbers modifying the noun or any word of its name ("red fire hydrant" ->
  (fire hydrant, red)), adjectival complements of a copula whose subject is the noun, in
  main and relative clauses ("a bus that is red"), and their conjuncts. Colour words are
  attributes even where the tagger reads them as nouns ("an orange rhombus", :data:`COLOURS`).
  Lemmas, except that participles keep their form ("parked", "lit", "smiling"). Quantifiers
  (several, many, other ...) are not attributes.
Relations: (subject, predicate, object), predicate as lemmas
  * noun + preposition, or copula + preposition: the bare preposition, phrasal ones whole:
    (cat, on, mat), (car, in front of, house), (dog, next to, cat), (clock, on the side of,
    building), (man, get off of, train) for chained prepositions;
  * verb + direct object: the verb and its particles: (man, ride, horse), (boy, pick up,
    ball);
  * verb + preposition: verb + particles + preposition when the preposition follows the
    verb directly (only particles and adverbs in between): (man, sit on, bench), (child,
    lay down on, bed), (dog, sit next to, cat). Otherwise the bare preposition, with the
    verb's subject as subject: "playing the piano in the room" -> (woman, play, piano),
    (woman, in, room) -- except where the preposition places the direct object: verbs of
    putting and throwing (:data:`PLACING_VERBS`: "putting a pizza into the oven" ->
    (pizza, into, oven)) and a possessed body part ("holding a phone in his hand" ->
    (phone, in, hand)); "with", "of", "for" and "by" stay on the subject;
  * passive agent: (agent, verb, patient), "a field surrounded by trees" -> (tree,
    surround, field); possessive noun: "a man's hand" -> (man, have, hand);
  * subjects: explicit, else the noun a participle or relative clause describes, else the
    subject of the verb this one is conjoined with or subordinate to ("while walking", "to
    catch"); relative pronouns stand for the noun ("a man who is riding a horse", "the
    pizza that a man is eating");
  * conjunctions fan out: conjoined subjects, objects, and a modifier after the last of
    conjoined nouns ("two zebras and a giraffe in a field") applies to all of them unless
    another conjunct has its own; lists the parser builds with appositions ("a red circle,
    a blue square and ...") count as conjunctions.
Verb lemmas are checked against the verb's spelling: "riding" is "ride", not the rule
lemmatizer's "rid", which would double its consonant (:func:`verb_lemma`).

Parser errors frequent on captions are repaired before the rules run
(:meth:`Parser._repair`). All-capital and Title Case captions are parsed lower-cased
(:func:`normalise_case`), and a caption that starts with a noun without an article ("bear
lies on ground", a region caption) is parsed with "the " before it
(:func:`features.scenegraph.learned.caption_text`). The stage:
:mod:`features.scenegraph.stage`; its folder: :mod:`features.scenegraph.files`.
"""
