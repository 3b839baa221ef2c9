"""CUDA graphs of the packed forward: one per token-count bucket, over one static input buffer.

The task mix is data (each token's slot index, each row's slot and pooling mode live in the static buffer), so one
graph serves any mix of tasks, and a batch costs one host-to-device copy (from pinned memory, not blocking), one
graph replay and one device-to-host copy, instead of hundreds of kernel launches. A graph is captured the first
time its bucket is used; growing the head bank (a task with more labels than any before) or adding the (IA)^3
scale banks (the first ``bitfit-ia3`` patch) drops them all.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from patchserve.patches.packed import HeadBank, PackedBert
from patchserve.patches.packed_layout import batch_views, layout_size

log = logging.getLogger(__name__)


def token_buckets(max_tokens: int, smallest: int = 64) -> list[int]:
    """Powers of two from ``smallest`` up to the first that holds ``max_tokens``."""
    out = [smallest]
    while out[-1] < max_tokens:
        out.append(out[-1] * 2)
    return out


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [N, H] static output: the token states
    pooled: torch.Tensor  # [R, H + C] static output: pooled vectors and logits


class GraphSet:
    def __init__(
        self, packed: PackedBert, heads: HeadBank, *, max_rows: int, max_tokens: int, max_positions: int
    ) -> None:
        self.packed, self.heads = packed, heads
        self.rows = max_rows
        self.buckets = token_buckets(max_tokens)
        self.max_positions = max_positions
        size = layout_size(self.buckets[-1], max_rows)
        self.static = torch.zeros(size, dtype=torch.int32, device=packed.device)
        self._graphs: dict[int, _Graph] = {}
        self._generation = self.generation
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def generation(self) -> tuple[int, int]:
        """Changes when the tensors the graphs read are replaced: the head bank grew, or scale banks were added."""
        return self.heads.generation, self.packed.generation

    def bucket(self, n_tokens: int, n_rows: int) -> int | None:
        """The smallest bucket that holds the batch, or None (run it eagerly)."""
        if n_rows > self.rows:
            return None
        return next((b for b in self.buckets if b >= n_tokens), None)

    def _capture(self, n: int) -> _Graph:
        t0 = time.perf_counter()
        self.static.zero_()  # a valid empty batch: every row has no tokens
        batch = batch_views(self.static, n, self.rows, min(n, self.max_positions))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (cuBLAS workspaces, lazy inits)
            for _ in range(2):
                self.packed.pool(self.packed.encode(batch, "flash"), batch, self.heads)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self.packed.encode(batch, "flash")
            pooled = self.packed.pool(hidden, batch, self.heads)
        log.debug("captured the forward for %d tokens x %d rows in %.2f s", n, self.rows, time.perf_counter() - t0)
        return _Graph(graph, hidden, pooled)

    def warm(self) -> None:
        """Capture every bucket now (at start-up), so that no request waits for a capture."""
        t0 = time.perf_counter()
        for n in self.buckets:
            if n not in self._graphs:
                self._graphs[n] = self._capture(n)
        log.info(
            "CUDA graphs: %d buckets up to %d tokens in %.1f s",
            len(self.buckets),
            self.buckets[-1],
            time.perf_counter() - t0,
        )

    def staging(self, n: int) -> torch.Tensor:
        """A pinned host buffer for an n-token layout. PyTorch's pinned-memory cache hands a buffer out again only
        after the copies that read it have run, so the next batch can be prepared while this one is in flight."""
        return torch.empty(layout_size(n, self.rows), dtype=torch.int32, pin_memory=True)

    def run(self, n: int, staging: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy ``staging`` (an n-token layout) into the static inputs, without blocking, and replay bucket ``n``.
        Returns its static outputs: read them (on the stream) before the next replay."""
        if self.generation != self._generation:
            # a fresh memory pool for the new captures: the old graphs' pool is released with them, but it lives
            # on while a tensor from it does (the last batch's outputs), and capturing into a released pool trips
            # PyTorch's allocator ("use_count > 0 INTERNAL ASSERT FAILED"; seen on an H200, torch 2.11), which
            # turned the graphs off
            self._graphs.clear()
            self._pool = torch.cuda.graph_pool_handle()
            self._generation = self.generation
        g = self._graphs.get(n)
        if g is None:
            g = self._graphs[n] = self._capture(n)
        self.static[: staging.numel()].copy_(staging, non_blocking=True)
        g.graph.replay()
        return g.hidden, g.pooled
