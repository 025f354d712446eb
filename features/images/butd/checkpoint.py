"""The bottom-up-attention checkpoints people hold, onto :class:`ButdModel`.

Two key layouts, told apart by their keys (never by file names):

- ``detectron2``: py-bottom-up-attention's conversions of the Caffe model
  (``faster_rcnn_from_caffe[_attr][_original].pkl``): one sigmoid objectness logit per
  anchor (12 channels), ``cls_score`` with background last, ``bbox_pred`` without
  background rows, attribute head ``cls_embedding``/``fc_attr``/``attr_score`` with
  "no attribute" last;
- ``milvlg``: bottom-up-attention.pytorch's ``bua-caffe-frcn-r101*.pth``: two softmax
  logits per anchor (24 channels, background then object), background first in
  ``cls_score``, ``bbox_pred`` and the attributes, attribute head
  ``cls_embed``/``attr_linear1``/``attr_linear2``.

Both share detectron2's trunk names (``backbone.stem``, ``backbone.res2..4``,
``roi_heads.res5``, ``<conv>.norm.*`` frozen batch norms, whose running statistics may be
absent: then mean 0 and variance 1, as detectron2 reads them). Known gap: MILVLG's Caffe
box arithmetic (widths ``x2 - x1 + 1``, anchors from Caffe's ``generate_anchors``) is not
reproduced; its checkpoints run with detectron2's, as py-bottom-up-attention runs the
same Caffe weights.
"""

from __future__ import annotations

import re

import torch

from features.detector.weights import WeightsError, load_exact
from features.images.butd.model import ButdModel, ButdSpec

RPN = "proposal_generator.rpn_head."
PREDICTOR = "roi_heads.box_predictor."
REQUIRED = (  # what every BUTD checkpoint has, in either layout
    "backbone.stem.conv1.weight",
    RPN + "conv.weight",
    RPN + "objectness_logits.weight",
    RPN + "anchor_deltas.weight",
    "roi_heads.res5.0.conv1.weight",
    PREDICTOR + "cls_score.weight",
    PREDICTOR + "bbox_pred.weight",
)
MILVLG_NAMES = {  # MILVLG attribute head -> py-bottom-up-attention's names
    "cls_embed.": "cls_embedding.",
    "attr_linear1.": "fc_attr.",
    "attr_linear2.": "attr_score.",
}
IGNORED = ("proposal_generator.anchor_generator.", "pixel_mean", "pixel_std")
PARAM = "regions.weights"  # the param that names these checkpoints


def layout_of(state: dict, source: str) -> str:
    """``detectron2`` or ``milvlg`` from the keys and the objectness width; a checkpoint
    that fits neither is a one-line error naming the keys it lacks."""
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise WeightsError(
            f"{PARAM}: {source} is not a bottom-up-attention checkpoint in either layout "
            f"(py-bottom-up-attention .pkl or MILVLG .pth): missing {', '.join(missing)}"
        )
    channels = state[RPN + "objectness_logits.weight"].shape[0]
    if channels not in (12, 24):
        raise WeightsError(
            f"{PARAM}: {source}: {RPN}objectness_logits.weight has {channels} channels; "
            "a BUTD RPN has 12 anchors (12: py-bottom-up-attention, 24: MILVLG)"
        )
    return "detectron2" if channels == 12 else "milvlg"


def spec_of(state: dict, layout: str) -> ButdSpec:
    """Depth, widths and head sizes read from the shapes in a checkpoint under
    :class:`ButdModel`'s names (:func:`model_state`)."""
    blocks = []
    for prefix in ("backbone.res2", "backbone.res3", "backbone.res4", "roi_heads.res5"):
        pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.")
        blocks.append(len({m.group(1) for k in state if (m := pattern.match(k))}))
    attrs = PREDICTOR + "attr_score.weight" in state
    return ButdSpec(
        blocks=tuple(blocks),
        width=state["backbone.stem.conv1.weight"].shape[0],
        rpn_hidden=state["rpn_head.conv.weight"].shape[0],
        num_classes=state[PREDICTOR + "cls_score.weight"].shape[0],
        layout=layout,
        num_attrs=state[PREDICTOR + "attr_score.weight"].shape[0] if attrs else 0,
        attr_embed=state[PREDICTOR + "cls_embedding.weight"].shape[1] if attrs else 256,
        attr_hidden=state[PREDICTOR + "fc_attr.weight"].shape[0] if attrs else 512,
    )


def model_state(state: dict, layout: str) -> dict[str, torch.Tensor]:
    """The checkpoint under :class:`ButdModel`'s names: the RPN without its
    ``proposal_generator.`` prefix, MILVLG's attribute names mapped, frozen batch norms
    completed (mean 0, variance 1 where absent), anchor buffers dropped (the anchors are
    the model's own)."""
    out = {}
    for key, value in state.items():
        if key.startswith(IGNORED) or key.endswith("num_batches_tracked"):
            continue
        key = key.removeprefix("proposal_generator.")
        if layout == "milvlg":
            for old, new in MILVLG_NAMES.items():
                if key.startswith(PREDICTOR + old):
                    key = PREDICTOR + new + key.removeprefix(PREDICTOR + old)
        out[key] = value.float() if value.is_floating_point() else value
    for key in [k for k in out if k.endswith(".norm.weight")]:
        base = key[: -len("weight")]
        out.setdefault(base + "running_mean", torch.zeros_like(out[key]))
        out.setdefault(base + "running_var", torch.ones_like(out[key]))
    return out


def butd_from_state(state: dict, source: str, proposals: int = 300) -> ButdModel:
    """A :class:`ButdModel` holding ``state`` (either layout), in eval mode with its frozen
    norms folded into the convolutions; every key must fit, or one line says what
    differs."""
    layout = layout_of(state, source)
    state = model_state(state, layout)
    model = ButdModel(spec_of(state, layout), proposals=proposals)
    what = f"the bottom-up-attention model ({layout} layout)"
    load_exact(model, state, PARAM, what, source)
    return model.fold_norms().eval()
