"""Rows as arrays: a ``RowBlock`` is any number of tokenised rows of any tasks in a few flat numpy arrays (token
ids, token types, lengths, each row's patch as an index into a short list, what each row asks for), and
``RowOutputs`` their answers as one float32 array and one size per row.

This is the form rows take on the engine's hot path: a front end's message arrives as one block, the batcher cuts
batches out of blocks with array slicing, the packed backend lays a batch out for the device with array operations,
and the answers go back as one array per message. Python work grows with messages and batches, not with rows.
``Row`` (``protocol.py``) stays the form of one row where a single row is handled (tokenising, tests).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from patchserve.patches.format import Patch
from patchserve.server.engine.protocol import BASE_KEY, Requests, Results, Row


@dataclass
class RowBlock:
    """``len(lengths)`` rows: row ``i`` has tokens ``tokens[starts[i]:starts[i + 1]]`` (and their ``types``), runs
    with ``patches[keys[i]]`` (``keys[i] == -1``: the base encoder) and asks for its pooled embedding where
    ``embed[i]``, else its head's logits."""

    tokens: np.ndarray  # int32 [N]
    types: np.ndarray  # int32 [N]
    lengths: np.ndarray  # int64 [R]
    keys: np.ndarray  # int64 [R]: index into patches, -1 for the base encoder
    patches: list[Patch]
    embed: np.ndarray  # bool [R]
    starts: np.ndarray = field(init=False)  # int64 [R + 1]

    def __post_init__(self) -> None:
        self.starts = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.starts[1:])

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def n_tokens(self) -> int:
        return int(self.starts[-1])

    @classmethod
    def from_rows(cls, rows: Sequence[Row]) -> RowBlock:
        """The block of ``rows`` (in their order)."""
        lengths = np.fromiter(map(len, (r.input_ids for r in rows)), dtype=np.int64, count=len(rows))
        n = int(lengths.sum())
        index: dict[str, int] = {}
        patches: list[Patch] = []
        keys = np.empty(len(rows), dtype=np.int64)
        for i, r in enumerate(rows):
            if r.patch is None:
                keys[i] = -1
                continue
            k = index.get(r.patch.patch_id)
            if k is None:
                k = index[r.patch.patch_id] = len(patches)
                patches.append(r.patch)
            keys[i] = k
        return cls(
            tokens=np.fromiter(itertools.chain.from_iterable(r.input_ids for r in rows), dtype=np.int32, count=n),
            types=np.fromiter(itertools.chain.from_iterable(r.token_type_ids for r in rows), dtype=np.int32, count=n),
            lengths=lengths,
            keys=keys,
            patches=patches,
            embed=np.fromiter((r.output == "embedding" for r in rows), dtype=bool, count=len(rows)),
        )

    def token_mask(self, rows: np.ndarray) -> np.ndarray:
        """Which tokens belong to the rows where ``rows`` (bool [R]) is set."""
        return np.repeat(rows, self.lengths)

    def take(self, index: np.ndarray) -> RowBlock:
        """The rows at ``index`` (increasing), with only the patches they use."""
        if len(index) == len(self):
            return self
        lo, hi = int(index[0]), int(index[-1]) + 1
        if hi - lo == len(index):  # contiguous: slices, no copies
            a, b = int(self.starts[lo]), int(self.starts[hi])
            tokens, types = self.tokens[a:b], self.types[a:b]
        else:
            picked = np.zeros(len(self), dtype=bool)
            picked[index] = True
            mask = self.token_mask(picked)
            tokens, types = self.tokens[mask], self.types[mask]
        return RowBlock(tokens, types, self.lengths[index], self.keys[index], self.patches, self.embed[index])

    @staticmethod
    def concat(blocks: Sequence[RowBlock]) -> RowBlock:
        """The rows of ``blocks`` one after the other; their patch lists are merged (each patch once)."""
        if len(blocks) == 1:
            return blocks[0]
        index: dict[str, int] = {}
        patches: list[Patch] = []
        keys = []
        for b in blocks:
            remap = np.empty(len(b.patches) + 1, dtype=np.int64)
            remap[-1] = -1  # the base encoder stays -1
            for j, p in enumerate(b.patches):
                k = index.get(p.patch_id)
                if k is None:
                    k = index[p.patch_id] = len(patches)
                    patches.append(p)
                remap[j] = k
            keys.append(remap[b.keys])
        return RowBlock(
            tokens=np.concatenate([b.tokens for b in blocks]),
            types=np.concatenate([b.types for b in blocks]),
            lengths=np.concatenate([b.lengths for b in blocks]),
            keys=np.concatenate(keys),
            patches=patches,
            embed=np.concatenate([b.embed for b in blocks]),
        )

    def used_patches(self) -> tuple[list[Patch], np.ndarray]:
        """The patches the rows use (each once) and every row's index into that list (-1: base)."""
        used = np.unique(self.keys[self.keys >= 0])
        if len(used) == len(self.patches):
            return self.patches, self.keys
        remap = np.full(len(self.patches) + 1, -1, dtype=np.int64)
        remap[used] = np.arange(len(used))
        return [self.patches[int(k)] for k in used], remap[self.keys]

    def per_patch(self, values: Sequence[int], base: int) -> np.ndarray:
        """Every row's entry of ``values`` (one per patch; ``base`` for rows without a patch)."""
        table = np.asarray([*values, base], dtype=np.int64)
        return table[self.keys]

    def tags(self) -> np.ndarray:
        """bool [R]: the rows whose answer is per-token logits (a tagging patch asked for logits)."""
        tagging = self.per_patch([p.meta.kind == "token-classification" for p in self.patches], 0).astype(bool)
        return tagging & ~self.embed

    def rows(self) -> list[Row]:
        """The block as ``Row`` objects (for a backend that works row by row)."""
        ids, types = self.tokens.tolist(), self.types.tolist()
        s = self.starts.tolist()
        return [
            Row(
                ids[s[i] : s[i + 1]],
                types[s[i] : s[i + 1]],
                None if k < 0 else self.patches[k],
                "embedding" if e else "logits",
            )
            for i, (k, e) in enumerate(zip(self.keys.tolist(), self.embed.tolist(), strict=True))
        ]


@dataclass
class RowOutputs:
    """The answers of a block's rows: row ``i``'s float32 values are ``data[offsets[i]:offsets[i + 1]]``; a tagging
    row's are ``[its tokens, n_labels]`` in row-major order, any other row's one vector."""

    data: np.ndarray  # float32 [sum sizes]
    sizes: np.ndarray  # int64 [R]

    @property
    def offsets(self) -> np.ndarray:
        out = np.zeros(len(self.sizes) + 1, dtype=np.int64)
        np.cumsum(self.sizes, out=out[1:])
        return out

    def split(self, lengths: Sequence[int], tags: Sequence[bool]) -> list[np.ndarray]:
        """One array per row: ``[n]``, or ``[length, n]`` for a tagging row."""
        parts = np.split(self.data, self.offsets[1:-1]) if len(self.sizes) else []
        return [p.reshape(k, -1) if t else p for p, k, t in zip(parts, lengths, tags, strict=True)]

    @staticmethod
    def concat(parts: Sequence[RowOutputs]) -> RowOutputs:
        if len(parts) == 1:
            return parts[0]
        return RowOutputs(np.concatenate([p.data for p in parts]), np.concatenate([p.sizes for p in parts]))


def gather_rows(
    flat: np.ndarray, base: np.ndarray, n_lines: np.ndarray, width: np.ndarray, stride: np.ndarray
) -> RowOutputs:
    """``RowOutputs`` read out of ``flat``: row ``i`` is ``n_lines[i]`` lines of ``width[i]`` values, the first at
    ``base[i]`` and each ``stride[i]`` after the last (one vectorised gather for every row)."""
    sizes = n_lines * width
    total = int(sizes.sum())
    first = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=first[1:])
    t = np.arange(total, dtype=np.int64) - np.repeat(first, sizes)  # position inside its row
    w = np.repeat(width, sizes)
    index = np.repeat(base, sizes) + (t // w) * np.repeat(stride, sizes) + t % w
    return RowOutputs(flat[index], sizes)


def pack_requests(first_id: int, requests: Sequence[Sequence[Row]], patch_bytes: dict[str, bytes]) -> Requests:
    """One ``Requests`` message for ``requests`` (request ``i`` gets the id ``first_id + i``), carrying
    ``patch_bytes`` for the patches the engine may not hold."""
    block = RowBlock.from_rows(list(itertools.chain.from_iterable(requests)))
    base = len(block.patches)  # rows without a patch name BASE_KEY, listed after the patches
    return Requests(
        id=first_id,
        counts=np.fromiter(map(len, requests), dtype="<i4", count=len(requests)).tobytes(),
        lengths=block.lengths.astype("<i4").tobytes(),
        tokens=block.tokens.astype("<i4").tobytes(),
        types=block.types.astype("<i4").tobytes(),
        keys=[p.patch_id for p in block.patches] + [BASE_KEY],
        row_keys=np.where(block.keys < 0, base, block.keys).astype("<i4").tobytes(),
        embed=block.embed.astype(np.uint8).tobytes(),
        patches=patch_bytes,
    )


def _run_sums(values: np.ndarray, runs: np.ndarray) -> np.ndarray:
    """The sum of each run of ``runs[i]`` consecutive ``values`` (an empty run sums to 0)."""
    at = np.zeros(len(runs) + 1, dtype=np.int64)
    np.cumsum(runs, out=at[1:])
    total = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values, out=total[1:])
    return total[at[1:]] - total[at[:-1]]


def unpack_requests(msgs: Sequence[Requests], patches: Mapping[str, Patch]) -> tuple[RowBlock, np.ndarray] | None:
    """The rows of ``msgs`` (one message or several, taken together) as one block in their order (``patches``: those
    their keys name, BASE_KEY aside) and each request's row count: array operations for all of them, Python only per
    message and patch id. None when a message's arrays do not agree with each other (a bug or a stranger on the
    socket; unpack each alone to learn which)."""
    n_rows, n_requests, n_keys, n_tokens = [], [], [], []
    for m in msgs:
        q, r, t = len(m.counts), len(m.lengths), len(m.tokens)
        if (q | r | t) % 4 or len(m.row_keys) != r or 4 * len(m.embed) != r or len(m.types) != t:
            return None
        n_rows.append(r // 4)
        n_requests.append(q // 4)
        n_keys.append(len(m.keys))
        n_tokens.append(t // 4)
    counts = np.frombuffer(b"".join(m.counts for m in msgs), dtype="<i4").astype(np.int64)
    lengths = np.frombuffer(b"".join(m.lengths for m in msgs), dtype="<i4").astype(np.int64)
    row_keys = np.frombuffer(b"".join(m.row_keys for m in msgs), dtype="<i4").astype(np.int64)
    rows_of = np.asarray(n_rows, dtype=np.int64)
    key_limit = np.repeat(np.asarray(n_keys, dtype=np.int64), rows_of)
    if (
        (len(counts) and int(counts.min()) < 0)
        or (len(lengths) and (int(lengths.min()) < 1 or int(row_keys.min()) < 0))
        or bool((row_keys >= key_limit).any())
        or not np.array_equal(_run_sums(counts, np.asarray(n_requests)), rows_of)
        or not np.array_equal(_run_sums(lengths, rows_of), n_tokens)
    ):
        return None
    index: dict[str, int] = {}
    listed: list[Patch] = []
    remap: list[int] = []  # every message's keys in turn -> the block's patch index (-1: the base encoder)
    for m in msgs:
        for k in m.keys:
            if k == BASE_KEY:
                remap.append(-1)
                continue
            i = index.get(k)
            if i is None:
                i = index[k] = len(listed)
                listed.append(patches[k])
            remap.append(i)
    key_starts = np.repeat(np.cumsum(n_keys) - np.asarray(n_keys), rows_of)
    block = RowBlock(
        np.frombuffer(b"".join(m.tokens for m in msgs), dtype="<i4").astype(np.int32),
        np.frombuffer(b"".join(m.types for m in msgs), dtype="<i4").astype(np.int32),
        lengths,
        np.asarray(remap, dtype=np.int64)[row_keys + key_starts],
        listed,
        np.frombuffer(b"".join(m.embed for m in msgs), dtype=np.uint8).astype(bool),
    )
    return block, counts


def results_message(rid: int, first: int, count: int, outputs: RowOutputs, refused: int = 0) -> Results:
    data, sizes = outputs.data.astype("<f4").tobytes(), outputs.sizes.astype("<i4").tobytes()
    return Results(rid, first, count, data, sizes, refused)


def unpack_results(msg: Results) -> RowOutputs:
    return RowOutputs(np.frombuffer(msg.data, dtype="<f4"), np.frombuffer(msg.sizes, dtype="<i4").astype(np.int64))
