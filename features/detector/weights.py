"""Checkpoints as people have them: where ``weights`` params point, what a file holds, and
how it maps onto the project's trunks and detectors.

A ``weights`` param is a local file, or a torchvision weights entry such as
``torchvision:ResNet152_Weights.IMAGENET1K_V2``, which resolves to the file torchvision
would download into the local torch hub cache (``torch.hub.get_dir()/checkpoints/<name
from the entry's url>``); nothing is ever downloaded. Files are read with
``weights_only=True``. Recognised contents:

- ``classification``: a torchvision ResNet state dict (``conv1.weight``, ``layer1.0...``,
  ``fc.*``; the classifier is ignored);
- ``detection``: a torchvision Faster R-CNN state dict (``backbone.body.*``, ``rpn.*``,
  ``roi_heads.*``), e.g. ``fasterrcnn_resnet50_fpn(_v2)``, or the project's C4 layout;
- ``vse-detector``: the project's detector checkpoint (:mod:`features.detector`);
- ``butd``: a bottom-up-attention Faster R-CNN in detectron2 names (``backbone.res4...``,
  ``proposal_generator.*``, ``roi_heads.*``): :mod:`features.images.butd`;
- a dict holding a state dict under ``model`` or ``state_dict`` (training checkpoints).

A file that does not fit is reported in one line: the param, the architecture and a
summary of the keys (counts per prefix and a few examples).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from infra.config import UserError
from infra.files import sha256_file

TORCHVISION_PREFIX = "torchvision:"
# torchvision BatchNorm buffers that FrozenBatchNorm2d checkpoints (the published
# detection weights) do not have; a module without them keeps its own (unused in eval).
OPTIONAL_SUFFIXES = ("num_batches_tracked",)


class WeightsError(UserError):
    """A ``weights`` param names a file that is missing or does not fit."""


def resolve_weights(spec: str, param: str) -> Path:
    """The local file a ``weights`` param names (a path, or a torchvision entry in the hub
    cache); a missing file is a one-line error that says where to put it."""
    if spec.startswith(TORCHVISION_PREFIX):
        import torchvision

        name = spec[len(TORCHVISION_PREFIX) :]
        try:
            entry = torchvision.models.get_weight(name)
        except (ValueError, KeyError, AttributeError):
            raise WeightsError(
                f"{param}: {spec!r} is not a torchvision weights entry (e.g. "
                "torchvision:ResNet152_Weights.IMAGENET1K_V2)"
            ) from None
        file = Path(torch.hub.get_dir()) / "checkpoints" / Path(entry.url).name
        if not file.is_file():
            raise WeightsError(
                f"{param}: {spec} is not in the local torch hub cache; nothing is downloaded "
                f"here: fetch {entry.url} elsewhere and put it at {file}"
            )
        return file
    file = Path(spec)
    if not file.is_file():
        raise WeightsError(
            f"{param}: {spec}: no such file; give a local checkpoint path or a "
            "torchvision:<Weights.ENTRY> in the local hub cache (nothing is downloaded), or "
            "weights: null for random initialisation"
        )
    return file


def weights_digest(spec: str | None, seed: int, param: str = "weights") -> str:
    """SHA-256 of the checkpoint file, or a distinct tag for random initialisation."""
    if spec is None:
        return f"random-init-seed-{seed}"
    return sha256_file(resolve_weights(spec, param))


def read_checkpoint(spec: str, param: str, allow_pickle: bool = False) -> dict:
    """The file's content (``weights_only=True``): a ``vse-detector`` checkpoint as it is,
    otherwise the state dict (unwrapped from ``model`` / ``state_dict``). A ``.pkl`` file
    (detectron2's format: numpy arrays in a pickle) is read only with ``allow_pickle``,
    and then by an unpickler that builds nothing but numpy arrays, dicts and lists."""
    file = resolve_weights(spec, param)
    try:
        if file.suffix == ".pkl":
            obj = _read_pickle(file, spec, param, allow_pickle)
        else:
            obj = torch.load(file, map_location="cpu", weights_only=True)
    except WeightsError:
        raise
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user error
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise WeightsError(
            f"{param}: {spec}: not a weights-only PyTorch checkpoint ({first[:200]})"
        ) from None
    if isinstance(obj, dict) and obj.get("format") == "vse-detector":
        return obj
    obj = _unwrap(obj)
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise WeightsError(f"{param}: {spec}: holds no state dict (a mapping of tensors)")
    return obj


def _unwrap(obj):
    """The state dict of a training checkpoint (under ``model`` / ``state_dict``)."""
    for key in ("model", "state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    return obj


# what a detectron2 .pkl checkpoint's pickle may build: numpy arrays and their parts
PICKLE_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("collections", "OrderedDict"),
    ("_codecs", "encode"),
}


def pickle_refused(param: str, spec: str) -> WeightsError:
    """The error for a ``.pkl`` checkpoint without ``regions.allow_pickle_weights``."""
    return WeightsError(
        f"{param}: {spec}: a .pkl checkpoint is a pickle, which can run code when "
        "loaded; set regions.allow_pickle_weights: true if you trust its source, or "
        "convert it to .pth"
    )


def _read_pickle(file: Path, spec: str, param: str, allow_pickle: bool) -> dict:
    """A detectron2 ``.pkl`` (``{"model": {name: ndarray}, ...}``) as tensors."""
    import pickle

    import numpy as np

    if not allow_pickle:
        raise pickle_refused(param, spec)

    class Arrays(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if (module, name) not in PICKLE_GLOBALS:
                raise WeightsError(
                    f"{param}: {spec}: the pickle wants {module}.{name}, which a checkpoint "
                    "of numpy arrays never needs; not loaded"
                )
            module = module.replace("numpy.core.", "numpy._core.")  # numpy 1.x pickles
            return super().find_class(module, name)

    with open(file, "rb") as f:
        obj = _unwrap(Arrays(f, encoding="latin1").load())
    if not isinstance(obj, dict):
        return obj
    return {
        k: torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
        for k, v in obj.items()
    }


def checkpoint_format(obj: dict) -> str:
    """``vse-detector``, ``detection``, ``butd``, ``classification`` or ``unknown``."""
    if obj.get("format") == "vse-detector":
        return "vse-detector"
    keys = list(obj)
    if any(k.startswith("backbone.body.") for k in keys):
        return "detection"
    if any(k.startswith(("proposal_generator.", "roi_heads.box_predictor.")) for k in keys):
        return "butd"  # detectron2 names: py-bottom-up-attention's or MILVLG's
    if any(k.startswith("layer1.") for k in keys) and "conv1.weight" in obj:
        return "classification"
    return "unknown"


RESNET_BLOCKS = {  # (blocks per stage, bottleneck) -> depth
    ((2, 2, 2, 2), False): 18,
    ((3, 4, 6, 3), False): 34,
    ((3, 4, 6, 3), True): 50,
    ((3, 4, 23, 3), True): 101,
    ((3, 8, 36, 3), True): 152,
}


def guess_resnet(keys: Iterable[str], prefix: str = "") -> str | None:
    """``resnet50`` etc. from the block counts of a ResNet's keys under ``prefix``."""
    blocks = {k: set() for k in range(1, 5)}
    bottleneck = False
    for key in keys:
        if not key.startswith(prefix + "layer"):
            continue
        parts = key[len(prefix) :].split(".")
        if len(parts) > 2 and parts[0][5:].isdigit() and parts[1].isdigit():
            stage = int(parts[0][5:])
            if stage in blocks:
                blocks[stage].add(int(parts[1]))
                bottleneck |= parts[2] == "conv3"
    counts = tuple(len(blocks[k]) for k in range(1, 5))
    depth = RESNET_BLOCKS.get((counts, bottleneck))
    if depth is None and counts[:3] != (0, 0, 0):
        return f"a ResNet with {counts} blocks per stage"
    return f"resnet{depth}" if depth else None


def describe(obj: dict) -> str:
    """What a checkpoint looks like, for error messages."""
    fmt = checkpoint_format(obj)
    if fmt == "vse-detector":
        return f"a vse-detector checkpoint ({obj['config']['architecture']})"
    if fmt == "classification":
        return f"a {guess_resnet(obj) or 'ResNet'} classification state dict"
    if fmt == "butd":
        return "a bottom-up-attention (detectron2-named) state dict"
    if fmt == "detection":
        trunk = guess_resnet(obj, "backbone.body.") or "ResNet"
        if any(k.startswith("backbone.fpn.") for k in obj):
            v2 = "_v2" if any(k.startswith("rpn.head.conv.1.") for k in obj) else ""
            return f"a {trunk} FPN{v2} detection state dict"
        return f"a {trunk} detection state dict"
    return "a state dict of an unknown layout"


def load_exact(module: nn.Module, state: dict, param: str, what: str, obj_desc: str) -> None:
    """Load ``state`` into ``module``: every key must match (BatchNorm's
    ``num_batches_tracked`` may be absent), or one line says what differs (``N missing
    keys (prefix counts; e.g. ...), M unexpected keys (...); shape mismatches``)."""
    own = module.state_dict()
    missing = [k for k in own if k not in state and not k.endswith(OPTIONAL_SUFFIXES)]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    if missing or unexpected or shapes:
        parts = []
        for kind, keys in (("missing", missing), ("unexpected", unexpected)):
            if keys:
                counts = Counter(k.split(".")[0] + ".*" for k in keys).most_common(4)
                prefixes = ", ".join(f"{p} {n}" for p, n in counts)
                parts.append(f"{len(keys)} {kind} keys ({prefixes}; e.g. {', '.join(keys[:2])})")
        detail = ", ".join(parts) or "no key differences"
        if shapes:
            detail += f"; {len(shapes)} shape mismatches (e.g. {shapes[0]})"
        raise WeightsError(f"{param}: {obj_desc} does not fit {what}: {detail}")
    module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)


def load_trunk(model: nn.Module, state: dict, c4: bool, param: str, what: str, source: str):
    """A ResNet trunk's weights (:func:`trunk_state`) into a detector's ``backbone.body``;
    for C4 its ``layer4`` goes to the res5 box head."""
    if c4:
        head = {k.removeprefix("layer4."): v for k, v in state.items() if k.startswith("layer4.")}
        load_exact(model.roi_heads.box_head.layer4, head, param, what, source)
        state = {k: v for k, v in state.items() if not k.startswith("layer4.")}
    load_exact(model.backbone.body, state, param, what, source)


def trunk_state(obj: dict, param: str) -> dict:
    """The ResNet trunk's weights (torchvision classification names, no ``fc``) of any
    recognised checkpoint: classification, detection (``backbone.body.*`` plus a C4
    ``roi_heads.box_head.layer4.*``) or vse-detector."""
    fmt = checkpoint_format(obj)
    state = obj["state_dict"] if fmt == "vse-detector" else obj
    if fmt == "classification":
        return {k: v for k, v in state.items() if not k.startswith("fc.")}
    if fmt in ("detection", "vse-detector"):
        return {
            k.removeprefix("backbone.body.").removeprefix("roi_heads.box_head."): v
            for k, v in state.items()
            if k.startswith(("backbone.body.", "roi_heads.box_head.layer4."))
        }
    raise WeightsError(
        f"{param}: {describe(obj)} (e.g. keys {', '.join(list(obj)[:3])}); expected a "
        "torchvision ResNet classification or detection state dict, or a vse-detector "
        "checkpoint"
    )
