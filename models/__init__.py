"""What is learned: five published models over the feature stores, one file each, all
with the same contract (``encode_image``, ``encode_text``, ``similarity``, ``loss``)."""

from features.config import Section
from models.camera import CAMERA, CAMERAConfig
from models.huse import HUSE, HUSEConfig
from models.mvvse import MVVSE, MVVSEConfig
from models.univse import UniVSE, UniVSEConfig
from models.vsepp import VSEPP, VSEPPConfig

MODELS = {m.name: m for m in (VSEPP, MVVSE, CAMERA, HUSE, UniVSE)}


class ModelsConfig(Section):
    """``models``: one section per model, each validated by that model's own config."""

    vsepp: VSEPPConfig = VSEPPConfig()
    mvvse: MVVSEConfig = MVVSEConfig()
    camera: CAMERAConfig = CAMERAConfig()
    huse: HUSEConfig = HUSEConfig()
    univse: UniVSEConfig = UniVSEConfig()


def model_inputs(name: str, config: dict) -> frozenset[str]:
    """The batch keys model ``name`` reads with ``config`` (``models.<name>``): a class
    attribute ``inputs``, or ``inputs_for(cfg)`` where they depend on the config."""
    cls = MODELS[name]
    if hasattr(cls, "inputs_for"):
        return frozenset(cls.inputs_for(cls.Config.model_validate(config)))
    return frozenset(cls.inputs)
