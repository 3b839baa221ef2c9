"""A Python client for a patchserve server, on httpx: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

    from patchserve.client import Client

    with Client("http://localhost:8000", token="...") as ps:
        ps.register("sentiment.safetensors")
        print(ps.predict("sentiment", ["a gripping film", "a tedious mess"]).predictions[0].label)
        job = ps.submit({"task": "trec", "epochs": 5}, train="trec-train.jsonl", dev="trec-dev.jsonl")
        print(ps.wait(job).result["version"])

Requests and answers are the server's own models (``patchserve.patches.api``), so results are typed. An error answer
raises the ``PatchserveError`` subclass of its status (``NotFound``, ``Unauthorized``, ``InvalidRequest``,
``Overloaded``, ...), carrying the status and the server's message, which says what to fix. Both clients share
every request's definition (``_Call``); they differ only in how they send it.
"""

from __future__ import annotations

import asyncio
import io
import os
import sys
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter
from tqdm import tqdm

from patchserve.client_errors import (  # noqa: F401 - the errors are part of this module's interface
    Conflict,
    Forbidden,
    InvalidRequest,
    NotFound,
    NotSupported,
    Overloaded,
    PatchserveError,
    ServerError,
    Timeout,
    TooLarge,
    Unauthorized,
    Unavailable,
    raise_for_status,
)
from patchserve.patches.api import (
    EmbedResponse,
    JobPublic,
    PairInput,
    PredictResponse,
    TaskDeleted,
    TaskDetail,
    TaskRegistered,
    TaskSummary,
    VersionPublic,
)

T = TypeVar("T")
DEFAULT_URL = "http://localhost:8000"
Inputs = str | Sequence[str] | Sequence[tuple[str, str]] | Sequence[PairInput] | Sequence[Mapping[str, str]]
DataFile = str | os.PathLike[str] | tuple[str, bytes]  # a path, or (file name, contents)
Upload = str | os.PathLike[str] | bytes | Any  # a patch (path, bytes, Patch) or a PEFT adapter (folder, archive)
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")  # PEFT's save_pretrained names; what the server reads


# --- what each call sends and how its answer is read -----------------------------------------------------------------
@dataclass
class _Call(Generic[T]):
    method: str
    path: str
    parse: Callable[[Any], T]
    json: Any = None
    files: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    whole: bool = False  # parse reads the httpx.Response (headers too), not only its JSON


def _model(cls: type[BaseModel]) -> Callable[[Any], Any]:
    return cls.model_validate


def _models(cls: type[BaseModel]) -> Callable[[Any], Any]:
    adapter = TypeAdapter(list[cls])  # type: ignore[valid-type]
    return adapter.validate_python


@dataclass
class TasksPage:
    """A page of GET /tasks: tasks by name, and the cursor of the next page (None: this was the last)."""

    tasks: list[TaskSummary]
    next_cursor: str | None


PAGE_LIMIT = 1000  # the largest page a server gives: what tasks() asks for


def _tasks_page(limit: int | None, cursor: str | None, prefix: str | None) -> _Call[TasksPage]:
    params = {"limit": limit, "cursor": cursor, "prefix": prefix}
    summaries = _models(TaskSummary)

    def parse(response: httpx.Response) -> TasksPage:
        link = response.links.get("next", {}).get("url")
        return TasksPage(summaries(response.json()), None if link is None else httpx.URL(link).params.get("cursor"))

    return _Call("GET", "/tasks", parse, params={k: v for k, v in params.items() if v is not None}, whole=True)


def _inputs(inputs: Inputs) -> Any:
    """Any accepted input shape as the JSON the server reads: tuples and PairInputs become {text, text_pair}."""
    if isinstance(inputs, str):
        return inputs
    out: list[Any] = []
    for x in inputs:
        if isinstance(x, tuple):
            out.append({"text": x[0], "text_pair": x[1]})
        elif isinstance(x, PairInput):
            out.append(x.model_dump(exclude_none=True))
        else:
            out.append(x)
    return out


def _patch_bytes(patch: Upload, task: str | None) -> bytes:
    if isinstance(patch, bytes):
        return patch
    if isinstance(patch, str | os.PathLike):
        path = Path(patch)
        if not path.is_dir():
            return path.read_bytes()
        if task is None:
            raise ValueError(f"{patch} is a PEFT adapter folder: register it with task=NAME, the task to serve as")
        return _adapter_zip(path)
    data = getattr(patch, "data", None)  # a patches.format.Patch
    if not isinstance(data, bytes):
        raise TypeError("register() takes a patch file's path, its bytes, a Patch, or a PEFT adapter folder or archive")
    return data


def _adapter_zip(folder: Path) -> bytes:
    """A PEFT adapter folder as the zip POST /tasks reads: its two files (not the rest, such as PEFT's README)."""
    missing = [name for name in PEFT_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} has no {missing[0]}: not a PEFT adapter folder (save_pretrained writes one)")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in PEFT_FILES:
            archive.write(folder / name, name)
    return buf.getvalue()


def _data_file(source: DataFile) -> tuple[str, bytes]:
    if isinstance(source, tuple):
        return source
    path = Path(source)
    return path.name, path.read_bytes()


def _predict(task: str, inputs: Inputs, top_k: int | None, all_scores: bool) -> _Call[PredictResponse]:
    body: dict[str, Any] = {"inputs": _inputs(inputs)}
    if top_k is not None:
        body["top_k"] = top_k
    if all_scores:
        body["all_scores"] = True
    return _Call("POST", f"/tasks/{task}/predict", _model(PredictResponse), json=body)


def _embed(inputs: Inputs, task: str | None, normalize: bool) -> _Call[EmbedResponse]:
    path = "/embed" if task is None else f"/tasks/{task}/embed"
    return _Call("POST", path, _model(EmbedResponse), json={"inputs": _inputs(inputs), "normalize": normalize})


def _register(patch: Upload, task: str | None, labels: Sequence[str] | None) -> _Call[TaskRegistered]:
    data = _patch_bytes(patch, task)
    if isinstance(labels, str):
        raise TypeError("labels= takes a list of names in head order, e.g. ['negative', 'positive']")
    if labels is not None and any("," in label for label in labels):
        raise ValueError("a label cannot hold a comma (the form field 'labels' is comma-separated)")
    form = {"task": task} if task is not None else {}
    if labels is not None:
        form["labels"] = ",".join(labels)
    files = {"patch": ("patch", data, "application/octet-stream")}
    return _Call("POST", "/tasks", _model(TaskRegistered), files=files, data=form or None)


def _submit(
    config: Mapping[str, Any], train: DataFile, dev: DataFile | None, test: DataFile | None, gate: Mapping | None
) -> _Call[JobPublic]:
    import json

    files = {role: _data_file(src) for role, src in (("train", train), ("dev", dev), ("test", test)) if src}
    body = dict(config) | ({"gate": dict(gate)} if gate else {})
    return _Call("POST", "/jobs", _model(JobPublic), files=files, data={"config": json.dumps(body)})


def _job_id(job: str | JobPublic) -> str:
    return job if isinstance(job, str) else job.id


class _Waiter:
    """How ``wait`` follows a job, for both clients: progress (a tqdm bar on a terminal, a plain line every 30 s
    elsewhere) and the deadline. ``ended(job)`` is True once the job has ended."""

    def __init__(self, timeout: float | None, progress: bool) -> None:
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout, self.progress = timeout, progress
        self.bar: Any = None
        self.tty, self.last_line = sys.stderr.isatty(), 0.0

    def __enter__(self) -> _Waiter:
        return self

    def __exit__(self, *_: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def ended(self, job: JobPublic) -> bool:
        if self.progress:
            self._show(job)
        if job.done:
            return True
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise TimeoutError(f"job {job.id} is still {job.status} after {self.timeout:g}s")
        return False

    def _show(self, job: JobPublic) -> None:
        p = job.progress
        step, total = p.get("step", 0), p.get("total_steps")
        dev = " ".join(f"dev {k} {v:.4f}" for k, v in (p.get("dev") or {}).items())
        if self.tty:
            if self.bar is None and total:
                self.bar = tqdm(total=total, desc=f"job {job.id[:8]} ({job.task})", dynamic_ncols=True)
            if self.bar is not None:
                self.bar.n = step
                self.bar.set_postfix_str(f"{job.status} {dev}".strip())
        elif time.monotonic() - self.last_line >= 30 or job.done:
            self.last_line = time.monotonic()
            where = f", step {step}/{total}" if total else ""
            print(f"job {job.id} ({job.task}): {job.status}{where} {dev}".rstrip(), file=sys.stderr, flush=True)


# --- the clients ---------------------------------------------------------------------------------------------------
def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class Client:
    """A blocking client. ``url``: the server; ``token``: the bearer token (predict or admin, as the route needs);
    ``timeout``: seconds per request. Use it as a context manager, or call ``close()``."""

    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None, timeout: float = 60.0) -> None:
        self.http = httpx.Client(base_url=url, headers=_headers(token), timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _send(self, call: _Call[T]) -> T:
        response = self.http.request(
            call.method, call.path, json=call.json, files=call.files, data=call.data, params=call.params
        )
        raise_for_status(response)
        return call.parse(response if call.whole else response.json())

    def healthy(self) -> bool:
        """The server process answers (GET /healthz)."""
        try:
            return self.http.get("/healthz").is_success
        except httpx.TransportError:
            return False

    def ready(self) -> dict[str, Any]:
        """GET /readyz: the encoder, its fingerprint, the registry; raises Unavailable when not ready."""
        return self._send(_Call("GET", "/readyz", dict))

    def predict(
        self, task: str, inputs: Inputs, *, top_k: int | None = None, all_scores: bool = False
    ) -> PredictResponse:
        """Predict with the current version of ``task``. ``inputs``: a text, a list of texts, or a list of
        (text, text_pair) pairs (tuples, PairInput or dicts)."""
        return self._send(_predict(task, inputs, top_k, all_scores))

    def embed(self, inputs: Inputs, *, task: str | None = None, normalize: bool = False) -> EmbedResponse:
        """Each input's pooled vector under ``task``'s patch (None: the base encoder)."""
        return self._send(_embed(inputs, task, normalize))

    def register(
        self, patch: Upload, *, task: str | None = None, labels: Sequence[str] | None = None
    ) -> TaskRegistered:
        """Register a patch (a file's path, its bytes, or a Patch) as its task's new current version (admin). Or a
        PEFT LoRA or IA3 adapter trained on the server's encoder: its folder (as ``save_pretrained`` wrote it) or
        that folder packed as .zip or .tar(.gz) (a path or bytes), served as task ``task``, its classes named
        ``labels`` in head order (default LABEL_0, LABEL_1, ...)."""
        return self._send(_register(patch, task, labels))

    def tasks(self, *, prefix: str | None = None) -> list[TaskSummary]:
        """Every task (with ``prefix``: every task whose name starts so) with its current version, by name, read a
        page at a time (``tasks_page``)."""
        found, cursor = [], None
        while True:
            page = self.tasks_page(limit=PAGE_LIMIT, cursor=cursor, prefix=prefix)
            found += page.tasks
            if page.next_cursor is None:
                return found
            cursor = page.next_cursor

    def tasks_page(
        self, *, limit: int | None = None, cursor: str | None = None, prefix: str | None = None
    ) -> TasksPage:
        """One page of tasks by name (``limit``: the server's default, 100), from ``cursor`` (a previous page's
        ``next_cursor``; it stays valid while tasks are added or deleted)."""
        return self._send(_tasks_page(limit, cursor, prefix))

    def task(self, name: str) -> TaskDetail:
        """A task's versions, its current one, and the current patch's metadata."""
        return self._send(_Call("GET", f"/tasks/{name}", _model(TaskDetail)))

    def versions(self, name: str) -> list[VersionPublic]:
        """Every stored version of a task, oldest first."""
        return self.task(name).versions

    def rollback(self, name: str, version: int) -> TaskSummary:
        """Make a stored version current (admin)."""
        return self._send(_Call("POST", f"/tasks/{name}/rollback", _model(TaskSummary), json={"version": version}))

    def delete(self, name: str) -> TaskDeleted:
        """Delete a task and all its versions (admin)."""
        return self._send(_Call("DELETE", f"/tasks/{name}", _model(TaskDeleted)))

    def submit(
        self,
        config: Mapping[str, Any],
        *,
        train: DataFile,
        dev: DataFile | None = None,
        test: DataFile | None = None,
        gate: Mapping[str, Any] | None = None,
    ) -> JobPublic:
        """Queue a training job (admin): ``config`` is the training config (``{"task": ..., ...}``), the data
        files are paths or (name, bytes); ``gate``: ``{"min_dev": 0.8, "not_worse": True}``."""
        return self._send(_submit(config, train, dev, test, gate))

    def job(self, job: str | JobPublic) -> JobPublic:
        return self._send(_Call("GET", f"/jobs/{_job_id(job)}", _model(JobPublic)))

    def jobs(self, limit: int = 50) -> list[JobPublic]:
        """Recent jobs, newest first."""
        return self._send(_Call("GET", "/jobs", _models(JobPublic), params={"limit": limit}))

    def cancel(self, job: str | JobPublic) -> JobPublic:
        """Cancel a job (admin): a queued one ends at once, a running one at its worker's next update."""
        return self._send(_Call("POST", f"/jobs/{_job_id(job)}/cancel", _model(JobPublic)))

    def wait(
        self, job: str | JobPublic, *, poll_s: float = 1.0, timeout: float | None = None, progress: bool = True
    ) -> JobPublic:
        """Follow a job until it ends (succeeded, rejected, failed or cancelled) and return it; a progress bar on a
        terminal, plain lines elsewhere. Raises TimeoutError after ``timeout`` seconds."""
        with _Waiter(timeout, progress) as waiter:
            while not waiter.ended(current := self.job(job)):
                time.sleep(poll_s)
        return current


class AsyncClient:
    """The asyncio twin of ``Client``: the same methods, awaited."""

    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None, timeout: float = 60.0) -> None:
        self.http = httpx.AsyncClient(base_url=url, headers=_headers(token), timeout=timeout)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.http.aclose()

    async def _send(self, call: _Call[T]) -> T:
        response = await self.http.request(
            call.method, call.path, json=call.json, files=call.files, data=call.data, params=call.params
        )
        raise_for_status(response)
        return call.parse(response if call.whole else response.json())

    async def healthy(self) -> bool:
        try:
            return (await self.http.get("/healthz")).is_success
        except httpx.TransportError:
            return False

    async def ready(self) -> dict[str, Any]:
        return await self._send(_Call("GET", "/readyz", dict))

    async def predict(
        self, task: str, inputs: Inputs, *, top_k: int | None = None, all_scores: bool = False
    ) -> PredictResponse:
        return await self._send(_predict(task, inputs, top_k, all_scores))

    async def embed(self, inputs: Inputs, *, task: str | None = None, normalize: bool = False) -> EmbedResponse:
        return await self._send(_embed(inputs, task, normalize))

    async def register(
        self, patch: Upload, *, task: str | None = None, labels: Sequence[str] | None = None
    ) -> TaskRegistered:
        return await self._send(_register(patch, task, labels))

    async def tasks(self, *, prefix: str | None = None) -> list[TaskSummary]:
        found, cursor = [], None
        while True:
            page = await self.tasks_page(limit=PAGE_LIMIT, cursor=cursor, prefix=prefix)
            found += page.tasks
            if page.next_cursor is None:
                return found
            cursor = page.next_cursor

    async def tasks_page(
        self, *, limit: int | None = None, cursor: str | None = None, prefix: str | None = None
    ) -> TasksPage:
        return await self._send(_tasks_page(limit, cursor, prefix))

    async def task(self, name: str) -> TaskDetail:
        return await self._send(_Call("GET", f"/tasks/{name}", _model(TaskDetail)))

    async def versions(self, name: str) -> list[VersionPublic]:
        return (await self.task(name)).versions

    async def rollback(self, name: str, version: int) -> TaskSummary:
        return await self._send(
            _Call("POST", f"/tasks/{name}/rollback", _model(TaskSummary), json={"version": version})
        )

    async def delete(self, name: str) -> TaskDeleted:
        return await self._send(_Call("DELETE", f"/tasks/{name}", _model(TaskDeleted)))

    async def submit(
        self,
        config: Mapping[str, Any],
        *,
        train: DataFile,
        dev: DataFile | None = None,
        test: DataFile | None = None,
        gate: Mapping[str, Any] | None = None,
    ) -> JobPublic:
        return await self._send(_submit(config, train, dev, test, gate))

    async def job(self, job: str | JobPublic) -> JobPublic:
        return await self._send(_Call("GET", f"/jobs/{_job_id(job)}", _model(JobPublic)))

    async def jobs(self, limit: int = 50) -> list[JobPublic]:
        return await self._send(_Call("GET", "/jobs", _models(JobPublic), params={"limit": limit}))

    async def cancel(self, job: str | JobPublic) -> JobPublic:
        return await self._send(_Call("POST", f"/jobs/{_job_id(job)}/cancel", _model(JobPublic)))

    async def wait(
        self, job: str | JobPublic, *, poll_s: float = 1.0, timeout: float | None = None, progress: bool = True
    ) -> JobPublic:
        with _Waiter(timeout, progress) as waiter:
            while not waiter.ended(current := await self.job(job)):
                await asyncio.sleep(poll_s)
        return current
