"""The engine's message types: a ``Row`` (one tokenised input for one task, the form a single row takes where it is
handled, tokenised), and the contract between the HTTP front ends and the engine process: msgspec structs, sent as
MessagePack over a ZeroMQ DEALER (each front end) / ROUTER (the engine) pair. Never pickle: every message is one of
the structs below, decoded strictly.

Front end -> engine: ``Hello`` (answered by ``Info``), ``Requests`` (every request a front end has pending in one
turn of its event loop, rows as arrays; answered by ``Results`` as its requests finish, or by one ``Missing`` or
``Failed``, with the same ``id``) and ``Cancel`` (one request's client went away or timed out: its rows are dropped
before they reach the device). A row names its patch by id; the engine keeps the patches it was sent in a cache of
its own, so a front end sends a patch's bytes once, with the first request that needs it, and again only when the
engine answers ``Missing`` (it restarted, or evicted the patch).

Engine -> front end: ``Info``, ``Results``, ``Missing``, ``Failed``, and ``Answers``: the ``Results`` of several
messages at once (a batch's answers for one front end go out as one message).
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


class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    """A front end (re)connected: the engine answers with ``Info``."""


class Requests(msgspec.Struct, tag="requests", array_like=True, frozen=True):
    """Requests of one front end sent together (what it had pending in one turn of its event loop), their rows as
    little-endian arrays (``rows.py`` packs and unpacks them). Request ``i`` has the id ``id + i`` and the next
    ``counts[i]`` rows; row ``j`` has ``lengths[j]`` tokens and runs with ``keys[row_keys[j]]``."""

    id: int
    counts: bytes  # int32 [requests]: rows of each request
    lengths: bytes  # int32 [rows]: tokens of each row
    tokens: bytes  # int32 [tokens]: the rows' input ids, one after the other
    types: bytes  # int32 [tokens]: their token type ids
    keys: list[str]  # the patch ids the rows name (BASE_KEY: the base encoder)
    row_keys: bytes  # int32 [rows]: each row's index into keys
    embed: bytes  # uint8 [rows]: 1 where the row asks for its pooled embedding, 0 for its head's logits
    patches: dict[str, bytes] = {}  # patch id -> canonical patch bytes, for patches the engine may not hold


class Cancel(msgspec.Struct, tag="cancel", array_like=True, frozen=True):
    """The request with this id is no longer waited for: its rows that have not run yet are dropped."""

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
    family: str = ""  # the encoder's family (Encoder.family)
    path: str = ""  # the engine that serves: 'packed' or 'slotted'


class Results(msgspec.Struct, tag="results", array_like=True, frozen=True):
    """Answers to ``count`` requests of a ``Requests`` message (same ``id``), from its request ``first`` on: a message
    is answered batch by batch, as its requests finish (in order). Their rows' float32 values are in ``data``, one
    after the other, ``sizes`` (int32, one per row) of them each; a dropped row (cancelled) has none.
    Little-endian. The last ``refused`` requests of the message were not taken (the engine's queue was full):
    answer them 503."""

    id: int
    first: int
    count: int
    data: bytes
    sizes: bytes
    refused: int = 0


class Answers(msgspec.Struct, tag="answers", array_like=True, frozen=True):
    """Several ``Results`` in one message (a batch's answers for one front end): one encoding and one send for all
    of them, where a frame each cost ~2.4 µs an answer more between the two processes."""

    items: list[Results]


class Missing(msgspec.Struct, tag="missing", array_like=True, frozen=True):
    """The engine holds none of these patches: send the ``Requests`` message again with their bytes."""

    id: int
    patch_ids: list[str]


class Failed(msgspec.Struct, tag="failed", array_like=True, frozen=True):
    """Every request of the ``Requests`` message failed: the HTTP status they should be answered with and a message
    that says what to do."""

    id: int
    status: int
    message: str


ToEngine = Hello | Requests | Cancel
FromEngine = Info | Results | Answers | Missing | Failed

encode = msgspec.msgpack.Encoder().encode
to_engine = msgspec.msgpack.Decoder(ToEngine)
from_engine = msgspec.msgpack.Decoder(FromEngine)
