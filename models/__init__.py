"""What is learned: five published models over the feature stores, one file each, all
with the same contract (``encode_image``, ``encode_text``, ``similarity``, ``loss``);
:mod:`models.registry` finds them by name."""
