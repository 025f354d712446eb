"""The tiny detector and the 12/4/2 demo at 64px that the detector's tests train on
(seconds on a CPU)."""

from demo_data import demo_manifest

from features.detector.config import DetectorConfig
from features.detector.data import read_manifest_boxes

TINY = DetectorConfig(
    architecture="resnet18_fpn",
    anchor_sizes=[8, 16, 32],
    fpn_levels=3,
    fpn_channels=16,
    representation_size=32,
    class_embedding=8,
    attribute_hidden=16,
    min_side=64,
    max_side=64,
    rpn_pre_nms_train=100,
    rpn_post_nms_train=50,
    rpn_pre_nms_test=100,
    rpn_post_nms_test=30,
    rpn_batch_size=32,
    box_batch_size=16,
    epochs=2,
    batch_size=4,
    lr=0.01,
    warmup_steps=2,
    schedule="cosine",
    trainable_layers=5,
    freeze_bn=False,
    device="cpu",
)
QUIET = {"log": lambda m: None}


def make_demo(root):
    """A 12/4/2 demo at 64px in ``root``: its manifest and detection dataset."""
    manifest = demo_manifest(root, n_train=12, n_val=4, n_test=2, image_size=64)
    return manifest, read_manifest_boxes(manifest, TINY)
