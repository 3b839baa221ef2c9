"""The engine's message types: a ``Row`` (one tokenised input for one task, what the batcher queues and the runner
runs), and the contract between the HTTP front ends and the engine process: msgspec structs, sent as MessagePack
over a ZeroMQ DEALER (each front end) / ROUTER (the engine) pair. Never pickle: every message is one of the structs
below, decoded strictly.

Front end -> engine: ``Hello`` (answered by ``Info``), ``Infer`` (answered by ``Outputs``, ``Missing`` or
``Failed``, with the same ``id``) and ``Cancel`` (the client went away or timed out: its rows are dropped before
they reach the device). A row names its patch by id; the engine keeps the patches it was sent in a cache of its own,
so a front end sends a patch's bytes once, with the first request that needs it, and again only when the engine
answers ``Missing`` (it restarted, or evicted the patch).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from patchserve.patches.format import Patch


class EngineUnavailableError(RuntimeError):
    """The engine process is not there (restarting, or stopped while the request was in flight): HTTP 503 with
    Retry-After."""


class EngineError(RuntimeError):
    """The engine answered a request with a failure: ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


BASE_KEY = "base"  # a row without a patch runs on the base encoder (embeddings); patch ids are "sha256:..."


@dataclass
class Row:
    """One tokenised input for one task (``patch``, resolved when the request arrives: hot swap semantics), or for
    the base encoder (``patch`` None, embeddings only). ``output``: the head's ``logits`` or the pooled
    ``embedding``."""

    input_ids: list[int]
    token_type_ids: list[int]
    patch: Patch | None
    output: str = "logits"

    @property
    def key(self) -> str:
        """Which biases the row runs with: its patch id, or BASE_KEY."""
        return BASE_KEY if self.patch is None else self.patch.patch_id

    @property
    def tags(self) -> bool:
        """True when the row's answer is per-token logits (a tagging patch asked for logits)."""
        return self.output == "logits" and self.patch is not None and self.patch.meta.kind == "token-classification"


class RowIn(msgspec.Struct, array_like=True, frozen=True):
    """One tokenised input: its ids, token types, the patch it runs with (``BASE_KEY``: none) and what it asks
    for (``logits`` or ``embedding``)."""

    input_ids: list[int]
    token_type_ids: list[int]
    key: str
    output: str = "logits"


class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    """A front end (re)connected: the engine answers with ``Info``."""


class Infer(msgspec.Struct, tag="infer", array_like=True, frozen=True):
    id: int
    rows: list[RowIn]
    patches: dict[str, bytes] = {}  # patch id -> canonical patch bytes, for patches the engine may not hold


class Cancel(msgspec.Struct, tag="cancel", array_like=True, frozen=True):
    id: int


class Info(msgspec.Struct, tag="info", array_like=True, frozen=True):
    """Who the engine is: what a front end needs to tokenise, check patches and answer /readyz without loading the
    model. ``engine_id`` changes with every engine process, so a front end knows when to re-send patches."""

    engine_id: str
    pid: int
    name: str
    source: str
    fingerprint: str
    hidden_size: int
    bias_shapes: dict[str, list[int]]
    max_positions: int
    default_pooling: str
    device: str
    dtype: str
    slots: int
    scale_shapes: dict[str, list[int]] = msgspec.field(default_factory=dict)  # the (IA)^3 sites
    lora_shapes: dict[str, list[int]] = msgspec.field(default_factory=dict)  # the LoRA sites: [out, in]


class Outputs(msgspec.Struct, tag="outputs", array_like=True, frozen=True):
    """One float32 array per row, concatenated (little-endian) in ``data``, each of its ``shapes`` entry."""

    id: int
    data: bytes
    shapes: list[list[int]]


class Missing(msgspec.Struct, tag="missing", array_like=True, frozen=True):
    """The engine holds none of these patches: send the request again with their bytes."""

    id: int
    patch_ids: list[str]


class Failed(msgspec.Struct, tag="failed", array_like=True, frozen=True):
    """The request failed: the HTTP status it should be answered with and a message that says what to do."""

    id: int
    status: int
    message: str


ToEngine = Hello | Infer | Cancel
FromEngine = Info | Outputs | Missing | Failed

encode = msgspec.msgpack.Encoder().encode
to_engine = msgspec.msgpack.Decoder(ToEngine)
from_engine = msgspec.msgpack.Decoder(FromEngine)
