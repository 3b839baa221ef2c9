"""Prometheus metrics, in a registry of the app's own (two apps in one process never clash).

With ``--workers N`` every process of the server (the engine and each front end) writes its figures to files in
one folder (prometheus_client's multiprocess mode: the supervisor sets ``PROMETHEUS_MULTIPROC_DIR`` for its
children), and any front end's /metrics adds them up: counters and histograms are summed over the processes,
``patchserve_queue_rows`` is the engine's, ``patchserve_tasks`` and ``patchserve_jobs`` the latest a live front end
saw.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector

from patchserve.patches.api import JOB_STATUSES
from patchserve.server.engine.batcher import BatchStats
from patchserve.server.engine.patch_cache import PatchCache
from patchserve.server.engine.slots import TierStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


OTHER_TASKS = "_other"  # the task label of every request of a task without series of its own


class Metrics:
    def __init__(self, task_labels: int = 0) -> None:
        self.task_labels = task_labels  # tasks with series of their own: the first this process serves
        self._labelled: set[str] = set()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "patchserve_requests",
            "Inference requests (predict, infer, embed) by task and HTTP status (task '_other': every task without "
            "series of its own, --metrics-task-labels).",
            ["task", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "patchserve_request_latency_seconds",
            "Inference latency by task (successful requests; task '_other' as for patchserve_requests).",
            ["task"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_rows = Histogram(
            "patchserve_batch_rows", "Inputs per forward pass.", buckets=_ROW_BUCKETS, registry=r
        )
        self.batch_tasks = Histogram(
            "patchserve_batch_tasks", "Distinct tasks per forward pass.", buckets=_ROW_BUCKETS, registry=r
        )
        self.batch_seconds = Histogram(
            "patchserve_batch_seconds", "Time of one forward pass.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_rows = Gauge(
            "patchserve_queue_rows", "Inputs waiting for a batch.", registry=r, multiprocess_mode="livesum"
        )
        self.slot_events = Counter(
            "patchserve_slot_events", "Device slot hits, misses and evictions.", ["event"], registry=r
        )
        self.host_cache_events = Counter(
            "patchserve_host_cache_events",
            "The host tier's hits (a patch found in host memory), misses (read from the registry by a front end, "
            "parsed from the bytes a front end sent by the engine) and evictions, by process ('front_end', 'engine').",
            ["process", "event"],
            registry=r,
        )
        self.host_cache_bytes = Gauge(
            "patchserve_host_cache_bytes",
            "Bytes of patches held in host memory, by process (summed over the front ends).",
            ["process"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.patch_load = Histogram(
            "patchserve_patch_load_seconds",
            "Time to load a patch into a device slot, or from the registry ('source').",
            ["source"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tasks = Gauge(
            "patchserve_tasks",
            "Tasks registered (as this replica sees it).",
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.encoder = Gauge(
            "patchserve_encoder_info",
            "The encoder served (always 1): its family (model_type), engine path (packed or slotted), compute dtype, "
            "device, longest input in tokens and the patch types it serves.",
            ["family", "engine", "dtype", "device", "max_seq_length", "patch_types"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.jobs = Gauge(
            "patchserve_jobs",
            "Training jobs by status among the most recent 500.",
            ["status"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self._slots_seen = TierStats()
        self._host_caches: list[tuple[str, PatchCache, TierStats]] = []  # (process, cache, its totals last folded)
        self._counted: tuple[float, dict[str, float]] | None = None  # (when, requests per task) at the last rate
        self._rates: dict[str, float] = {}

    def exposed(self) -> CollectorRegistry:
        """What /metrics shows: this registry, or every process's figures in multiprocess mode."""
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            return self.registry
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return registry

    def task_label(self, task: str) -> str:
        """``task`` while fewer than ``task_labels`` tasks have series of their own (or it has), else '_other':
        the series in /metrics stay bounded however many tasks there are."""
        if task in self._labelled or task.startswith("_"):  # '_unknown', '_base': not task names, a few labels
            return task
        if len(self._labelled) < self.task_labels:
            self._labelled.add(task)
            return task
        return OTHER_TASKS

    def observe_request(self, task: str, status: int, seconds: float) -> None:
        label = self.task_label(task)
        self.requests.labels(task=label, status=str(status)).inc()
        if status == 200:
            self.latency.labels(task=label).observe(seconds)
        self.sync_host_caches()

    def observe_batch(self, stats: BatchStats) -> None:
        self.batch_rows.observe(stats.rows)
        self.batch_tasks.observe(stats.tasks)
        self.batch_seconds.observe(stats.seconds)

    def request_rates(self) -> dict[str, float]:
        """Requests per second per task, from the request counter, over the time since the last call that was at
        least a second ago (callers in between get that answer again)."""
        now = time.monotonic()
        counts: dict[str, float] = {}
        for metric in self.exposed().collect():
            for sample in metric.samples:
                if sample.name == "patchserve_requests_total":
                    counts[sample.labels["task"]] = counts.get(sample.labels["task"], 0.0) + sample.value
        if self._counted is None:
            self._counted = (now, counts)
        elif now - self._counted[0] >= 1.0:
            since, before = self._counted
            self._rates = {task: (n - before.get(task, 0.0)) / (now - since) for task, n in counts.items()}
            self._counted = (now, counts)
        return self._rates

    def set_encoder(self, described: dict[str, object]) -> None:
        """``patchserve_encoder_info``: ``described`` (``EncoderInfo.describe`` and the device) as labels."""
        labels = {k: ",".join(v) if isinstance(v, list) else str(v) for k, v in described.items()}
        self.encoder.labels(**labels).set(1)

    def set_jobs(self, statuses: list[str]) -> None:
        for status in JOB_STATUSES:
            self.jobs.labels(status=status).set(statuses.count(status))

    def sync_slots(self, stats: TierStats) -> None:
        """Fold the slot manager's running totals into the counters."""
        _fold(stats, self._slots_seen, lambda event: self.slot_events.labels(event=event))

    def add_host_cache(self, cache: PatchCache, process: str) -> None:
        """Count ``cache``'s events under ``process`` from now on (``sync_host_caches`` folds them in)."""
        self._host_caches.append((process, cache, TierStats(**vars(cache.stats))))
        self.host_cache_bytes.labels(process=process).set(cache.bytes)

    def sync_host_caches(self) -> None:
        """Fold the host caches' running totals into the counters (cheap when nothing changed: a few compares)."""
        for process, cache, seen in self._host_caches:
            if _fold(cache.stats, seen, functools.partial(self._host_cache_counter, process)):
                self.host_cache_bytes.labels(process=process).set(cache.bytes)

    def _host_cache_counter(self, process: str, event: str) -> Counter:
        return self.host_cache_events.labels(process=process, event=event)


def _fold(totals: TierStats, seen: TierStats, counter: Callable[[str], Counter]) -> bool:
    """Add what ``totals`` (hits, misses, evictions) grew by since ``seen`` to ``counter(event)``; whether they grew."""
    grew = False
    for field, event in (("hits", "hit"), ("misses", "miss"), ("evictions", "eviction")):
        delta = getattr(totals, field) - getattr(seen, field)
        if delta > 0:
            counter(event).inc(delta)
            setattr(seen, field, getattr(totals, field))
            grew = True
    return grew
