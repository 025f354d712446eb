"""Rule-based scene graphs of captions from a spaCy dependency parse, after Schuster et al.
2015 and SceneGraphParser: objects, attribute-object pairs and relation triples, the three
kinds of components UniVSE (Wu et al. 2019, sec. 3.2) encodes. The conventions, and where
they differ from SceneGraphParser: docs/explanation/language.md ("Conventions of the
rules"). The stage: :mod:`features.scenegraph.stage`; its folder:
:mod:`features.scenegraph.files`.
"""
