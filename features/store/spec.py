"""What a store is made of: its layout params (``store`` section), the specs of its fields,
its provenance (whose hash is the fingerprint) and the field sets of the store kinds."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import Field as PydanticField
from pydantic import model_validator

from infra.config import Section, UserError

SCHEMA_VERSION = 1


RAGGED_ROWS_PER_SAMPLE = 16  # expected rows per sample of a ragged field, sizes its chunks


class StoreConfig(Section):
    """``store`` section of params.yaml: the on-disk layout of new stores."""

    samples_per_shard: int = PydanticField(256, ge=1)
    samples_per_chunk: int = PydanticField(64, ge=1)
    compression: Literal["none", "zstd"] = "none"

    @model_validator(mode="after")
    def _chunks_tile_shards(self) -> StoreConfig:
        if self.samples_per_shard % self.samples_per_chunk:
            raise ValueError(
                f"samples_per_shard ({self.samples_per_shard}) must be a multiple of "
                f"samples_per_chunk ({self.samples_per_chunk})"
            )
        return self


class StoreError(UserError):
    """A store is missing, locked, incomplete, corrupt or does not match what was asked."""


@dataclass(frozen=True)
class FieldSpec:
    """One array of a store: per-sample shape (per-row shape if ``ragged``) and dtype."""

    shape: tuple[int, ...]
    dtype: str
    ragged: bool = False


@dataclass(frozen=True)
class Provenance:
    """What made a store; its hash is the store's fingerprint."""

    extractor: str
    version: str
    params: Mapping[str, Any]
    weights_digest: str | None
    manifest_digest: str

    def fingerprint(self, kind: str, fields: Mapping[str, FieldSpec]) -> str:
        payload = {
            "schema_version": SCHEMA_VERSION,
            "kind": kind,
            "fields": {k: asdict(v) for k, v in sorted(fields.items())},
            **asdict(self),
        }
        canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()


# Field sets of the store kinds that extractors write. Shapes are per sample.
def regions_fields(
    max_regions: int, dim: int, *, boxes: bool = True, labels: tuple[str, ...] = ()
) -> dict[str, FieldSpec]:
    """``labels``: ``"objects"`` and/or ``"attrs"``, the detector's class id (-1 past
    ``n_regions``) and confidence of each region (bottom-up-attention's Visual Genome
    1600 objects / 400 attributes), as in LXMERT's obj36 files."""
    fields = {
        "features": FieldSpec((max_regions, dim), "float16"),
        "n_regions": FieldSpec((), "int32"),
        "image_hw": FieldSpec((2,), "int32"),
    }
    if boxes:
        fields["boxes"] = FieldSpec((max_regions, 4), "float32")
    for label in labels:
        fields[f"{label}_id"] = FieldSpec((max_regions,), "int32")
        fields[f"{label}_conf"] = FieldSpec((max_regions,), "float32")
    return fields
