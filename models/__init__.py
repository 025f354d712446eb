"""What is learned: five published models over the feature stores, one file each, all
with the same contract (``encode_image``, ``encode_text``, ``similarity``, ``loss``)."""

from models.vsepp import VSEPP

MODELS = {m.name: m for m in (VSEPP,)}
