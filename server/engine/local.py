"""The engine in this process: the runner (the device) and the batcher (the queue) built from the server's settings.

The server runs it in its own process with ``--workers 0``; with ``--workers N`` the engine process
(``server/engine/process.py``) runs it and the front ends reach it through ``server/engine/remote.py``. Both expose
``run(rows)``, so a route does not know where the device is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import numpy as np

from patchserve.patches.encoder import Encoder, resolve_device
from patchserve.patches.format import Patch
from patchserve.server.engine.batcher import Batcher, BatchStats
from patchserve.server.engine.protocol import Row
from patchserve.server.engine.rows import RowBlock
from patchserve.server.engine.runner import Runner
from patchserve.server.metrics import Metrics
from patchserve.server.settings import ServerSettings

log = logging.getLogger(__name__)


def max_batch_rows(settings: ServerSettings) -> int:
    """The most rows of one batch on the device ``settings`` resolve to (``auto``, ``mps``): ``max_batch_rows``, or
    the default for that device."""
    return settings.batch_rows(resolve_device(settings.device).type != "cpu")


class LocalEngine:
    def __init__(self, encoder: Encoder, settings: ServerSettings, metrics: Metrics, *, inline: bool = False) -> None:
        """Move ``encoder`` to the device (the runner owns it from now on) and set up the batcher; ``start`` it
        inside the event loop that will submit rows. ``inline``: run the device on the loop's thread (the engine
        process, whose loop has nothing else to do; see ``Batcher``)."""
        self.metrics = metrics
        max_rows = max_batch_rows(settings)
        self.runner = Runner(
            encoder,
            device=settings.device,
            dtype=settings.dtype,
            slots=settings.slots,
            engine=settings.engine,
            drop_key_bias=settings.drop_key_bias,
            fold_value_bias=settings.fold_value_bias,
            fold_ln_bias=settings.fold_ln_bias,
            cuda_graphs=settings.cuda_graphs,
            overlap_batches=settings.overlap_batches,
            max_rows=max_rows,
            max_tokens=settings.max_batch_tokens,
            on_load=metrics.patch_load.labels(source="slot").observe,
        )
        self.batcher = Batcher(
            self.runner,
            max_rows=max_rows,
            max_tokens=settings.max_batch_tokens,
            max_wait_ms=settings.max_wait_ms,
            max_queue_rows=settings.max_queue_rows,
            on_batch=self._observe,
            inline=inline,
        )

    @property
    def device(self) -> str:
        return str(self.runner.device)

    def problem(self) -> str | None:
        """Why the engine cannot take rows now (None: it can). In this process it always can."""
        return None

    def preload(self, patches: Iterable[Patch]) -> int:
        return self.runner.preload(patches)

    def start(self) -> None:
        self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()

    async def run(self, rows: Sequence[Row]) -> list[np.ndarray]:
        """Each row's output (float32: logits, per-token logits or an embedding). Cancelling the call drops the rows
        that have not reached the device."""
        outputs = await self.batcher.submit(RowBlock.from_rows(rows)).future
        return outputs.split([len(r.input_ids) for r in rows], [r.tags for r in rows])

    def _observe(self, stats: BatchStats) -> None:
        self.metrics.observe_batch(stats)
        self.metrics.queue_rows.set(self.batcher.queued_rows)
        self.metrics.sync_slots(self.runner.slots.stats)
        self.metrics.sync_host_caches()
