"""The Open Inference Protocol (KServe v2 REST) beside patchserve's own routes, so Triton and KServe clients work
unchanged: every task is a model, every registered version a model version.

A request's ``text`` (and optional ``text_pair``) input is a BYTES tensor of shape [N] or [N, 1], sent as JSON
data or with the binary tensor data extension (a JSON header of ``Inference-Header-Content-Length`` bytes, then
the raw tensors; BYTES elements are a 4-byte little-endian length and the UTF-8 bytes). Outputs by the task's
kind: classification ``label`` (BYTES [N]), ``score`` (FP32 [N], the label's probability) and ``logits`` (FP32
[N, C], in the order of the patch's labels); regression ``value`` (FP32 [N]); token classification ``token``,
``label`` (BYTES [N, W]) and ``score`` (FP32 [N, W]), one column per word, padded with "" and 0 to the longest
input. Outputs asked for with ``binary_data`` (or all, with ``binary_data_output``) come back binary.

Same auth, limits and batching as predict: the rows go through ``patchserve.server.inference.run_rows``.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from patchserve import __version__
from patchserve.patches.api import Prediction
from patchserve.patches.errors import describe_validation_errors
from patchserve.patches.format import PatchMeta
from patchserve.patches.validation import strict_json
from patchserve.server.deps import PredictAuth, ServiceDep
from patchserve.server.engine.protocol import EngineUnavailableError
from patchserve.server.inference import InferenceService, name_task, run_rows
from patchserve.server.openapi import TaskName, errors
from patchserve.server.predict import InputError, check_request, decode

router = APIRouter(tags=["open inference protocol (KServe v2)"])
HEADER_LENGTH = "Inference-Header-Content-Length"
_READ = errors(401, 403, 404, 409, 422, 503)
_INFER = errors(401, 403, 404, 409, 413, 422, 503, 504)
_PROTOCOL = ConfigDict(extra="forbid")


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class InferInput(BaseModel):
    model_config = _PROTOCOL

    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] = Field(default_factory=dict)
    data: list[Any] | None = None


class RequestedOutput(BaseModel):
    model_config = _PROTOCOL

    name: str
    parameters: dict[str, Any] = Field(default_factory=dict)


class InferRequest(BaseModel):
    model_config = _PROTOCOL

    id: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    inputs: list[InferInput]
    outputs: list[RequestedOutput] | None = None


# --- metadata and health ---------------------------------------------------------------------------------------
@router.get("/v2")
async def server_metadata() -> dict[str, Any]:
    """The server's name, version and protocol extensions."""
    return {"name": "patchserve", "version": __version__, "extensions": ["binary_tensor_data"]}


@router.get("/v2/health/live")
async def live() -> dict[str, bool]:
    """The process is alive (as /healthz)."""
    return {"live": True}


@router.get("/v2/health/ready", responses=errors(503))
async def ready(svc: ServiceDep) -> dict[str, bool]:
    """The encoder is loaded and the registry answers (as /readyz)."""
    problem = svc.engine.problem()
    if problem is not None:
        raise EngineUnavailableError(problem)
    await run_in_threadpool(svc.registry.ping)
    return {"ready": True}


def _tensors(meta: PatchMeta) -> tuple[list[TensorMetadata], list[TensorMetadata]]:
    inputs = [TensorMetadata(name="text", datatype="BYTES", shape=[-1])]
    if meta.kind != "token-classification" and meta.text_pair is not False:
        inputs.append(TensorMetadata(name="text_pair", datatype="BYTES", shape=[-1]))
    if meta.kind == "classification":
        outputs = [("label", "BYTES", [-1]), ("score", "FP32", [-1]), ("logits", "FP32", [-1, len(meta.labels)])]
    elif meta.kind == "regression":
        outputs = [("value", "FP32", [-1])]
    else:
        outputs = [("token", "BYTES", [-1, -1]), ("label", "BYTES", [-1, -1]), ("score", "FP32", [-1, -1])]
    return inputs, [TensorMetadata(name=n, datatype=d, shape=s) for n, d, s in outputs]


async def _metadata(svc: Any, name: str, version: int | None) -> ModelMetadata:
    def read() -> ModelMetadata:
        _, patch = svc.catalog.resolve(name, version)
        versions = [str(v.version) for v in svc.registry.versions(name)]
        inputs, outputs = _tensors(patch.meta)
        return ModelMetadata(name=name, versions=versions, platform="patchserve", inputs=inputs, outputs=outputs)

    return await run_in_threadpool(read)


@router.get("/v2/models/{name}", response_model=ModelMetadata, responses=_READ)
async def model_metadata(name: TaskName, svc: ServiceDep, _: PredictAuth) -> Any:
    """A task as a model: its stored versions, its input tensors and the output tensors of its kind."""
    return await _metadata(svc, name, None)


@router.get("/v2/models/{name}/versions/{version}", response_model=ModelMetadata, responses=_READ)
async def model_version_metadata(name: TaskName, version: int, svc: ServiceDep, _: PredictAuth) -> Any:
    """As GET /v2/models/{name}, for one stored version."""
    return await _metadata(svc, name, version)


@router.get("/v2/models/{name}/ready", responses=_READ)
async def model_ready(name: TaskName, svc: ServiceDep, _: PredictAuth) -> dict[str, Any]:
    """200 when the task is registered and fits this server's encoder; else 404 or 409."""
    await svc.catalog.resolve_async(name)
    return {"name": name, "ready": True}


@router.get("/v2/models/{name}/versions/{version}/ready", responses=_READ)
async def model_version_ready(name: TaskName, version: int, svc: ServiceDep, _: PredictAuth) -> dict[str, Any]:
    """As GET /v2/models/{name}/ready, for one stored version."""
    await svc.catalog.resolve_async(name, version)
    return {"name": name, "version": str(version), "ready": True}


# --- inference ---------------------------------------------------------------------------------------------------
def openapi_components() -> dict[str, Any]:
    """Schemas of the infer body, for the OpenAPI document's components (the route reads its body itself, since
    it may be binary, so FastAPI does not add them)."""
    schema = InferRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    return {**schema.pop("$defs", {}), "InferRequest": schema}


_INFER_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/InferRequest"}},
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": f"The binary tensor data extension: {HEADER_LENGTH} bytes of JSON, then the tensors.",
            },
        },
    }
}


@router.post("/v2/models/{name}/infer", responses=_INFER, openapi_extra=_INFER_BODY)
async def infer(name: TaskName, request: Request, svc: InferenceService) -> Response:
    """Run a task's current version on a BYTES ``text`` tensor (and ``text_pair``); outputs by its kind."""
    return await _infer(svc, request, name, None)


@router.post("/v2/models/{name}/versions/{version}/infer", responses=_INFER, openapi_extra=_INFER_BODY)
async def infer_version(name: TaskName, version: int, request: Request, svc: InferenceService) -> Response:
    """As POST /v2/models/{name}/infer, with one stored version of the task."""
    return await _infer(svc, request, name, version)


async def _infer(svc: Any, request: Request, name: str, version: int | None) -> Response:
    body, tail = _split(await request.body(), request.headers.get(HEADER_LENGTH))
    texts, pairs = _texts(body, tail)
    info, patch = await svc.catalog.resolve_async(name, version)
    name_task(request, name)
    check_request(patch, pairs)
    wanted = _wanted(body, [t.name for t in _tensors(patch.meta)[1]])  # before the work: a typo costs nothing
    encoded, logits = await run_rows(svc, request, patch, texts, pairs)
    preds = [decode(o, e, None, False) for o, e in zip(logits, encoded, strict=True)]
    tensors = _outputs(patch.meta, preds, logits)
    header: dict[str, Any] = {"model_name": name, "model_version": str(info.version), "outputs": []}
    if body.id is not None:
        header["id"] = body.id
    blobs = []
    for out_name, binary in wanted:
        datatype, shape, values = tensors[out_name]
        tensor: dict[str, Any] = {"name": out_name, "datatype": datatype, "shape": shape}
        if binary:
            blob = _encode(datatype, values)
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = values
        header["outputs"].append(tensor)
    if not blobs:
        return JSONResponse(header)
    head = JSONResponse(header).body
    return Response(
        bytes(head) + b"".join(blobs), media_type="application/octet-stream", headers={HEADER_LENGTH: str(len(head))}
    )


def _split(raw: bytes, header_length: str | None) -> tuple[InferRequest, bytes]:
    """The request's JSON header, parsed and validated, and the binary tensor data after it."""
    if header_length is None:
        head, tail = raw, b""
    else:
        if not header_length.isdigit() or int(header_length) > len(raw):
            raise InputError(f"{HEADER_LENGTH} must be the byte length of the JSON header, at most the body's")
        head, tail = raw[: int(header_length)], raw[int(header_length) :]
    try:
        return InferRequest.model_validate(strict_json(head, "infer request", InputError)), tail
    except ValidationError as exc:
        raise InputError(f"infer request: {describe_validation_errors(exc.errors())}") from None


def _texts(body: InferRequest, tail: bytes) -> tuple[list[str], list[str] | None]:
    """The ``text`` and ``text_pair`` inputs as lists of strings (binary inputs take the tail in order)."""
    given: dict[str, list[str]] = {}
    offset = 0
    for tensor in body.inputs:
        if tensor.name not in ("text", "text_pair"):
            raise InputError(f"unknown input {tensor.name!r}; this model takes 'text' and optionally 'text_pair'")
        if tensor.datatype != "BYTES":
            raise InputError(f"input {tensor.name!r} must be BYTES (UTF-8 text), got {tensor.datatype}")
        if len(tensor.shape) not in (1, 2) or (len(tensor.shape) == 2 and tensor.shape[1] != 1):
            raise InputError(f"input {tensor.name!r} must have shape [N] or [N, 1], got {tensor.shape}")
        size = tensor.parameters.get("binary_data_size")
        if size is not None:
            if type(size) is not int or not 0 <= size <= len(tail) - offset:
                raise InputError(f"input {tensor.name!r}: binary_data_size {size!r} does not fit the binary data")
            values = _decode_bytes(tail[offset : offset + size], tensor.name)
            offset += size
        elif tensor.data is not None:
            values = _flatten(tensor.data, tensor.name)
        else:
            raise InputError(f"input {tensor.name!r} has neither data nor binary_data_size")
        if len(values) != math.prod(tensor.shape):
            raise InputError(f"input {tensor.name!r} has {len(values)} elements for shape {tensor.shape}")
        given[tensor.name] = values
    if "text" not in given:
        raise InputError("the request has no 'text' input")
    pairs = given.get("text_pair")
    if pairs is not None and len(pairs) != len(given["text"]):
        raise InputError(f"'text_pair' has {len(pairs)} elements, 'text' {len(given['text'])}; send one per text")
    if not given["text"]:
        raise InputError("'text' is empty: send at least one text")
    return given["text"], pairs


def _flatten(data: list[Any], name: str) -> list[str]:
    out: list[str] = []
    stack = list(reversed(data))
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, str):
            out.append(item)
        else:
            raise InputError(f"input {name!r}: BYTES data must be strings, got {type(item).__name__}")
    return out


def _decode_bytes(blob: bytes, name: str) -> list[str]:
    """Binary BYTES elements (4-byte little-endian length, then the bytes) as UTF-8 strings."""
    out, i = [], 0
    while i < len(blob):
        if i + 4 > len(blob):
            raise InputError(f"input {name!r}: binary BYTES data is cut short")
        (n,) = struct.unpack_from("<I", blob, i)
        if i + 4 + n > len(blob):
            raise InputError(f"input {name!r}: binary BYTES data is cut short")
        try:
            out.append(blob[i + 4 : i + 4 + n].decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InputError(f"input {name!r}: element {len(out)} is not UTF-8 ({exc.reason})") from None
        i += 4 + n
    return out


def _encode(datatype: str, values: list[Any]) -> bytes:
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(b)) + b for b in (v.encode() for v in values))
    return np.asarray(values, dtype="<f4").tobytes()


def _outputs(meta: PatchMeta, preds: list[Prediction], logits: list[np.ndarray]) -> dict[str, tuple[str, list, list]]:
    """Every output tensor of the task's kind: name -> (datatype, shape, values flattened row-major)."""
    n = len(preds)
    if meta.kind == "classification":
        return {
            "label": ("BYTES", [n], [str(p.label) for p in preds]),  # BYTES: an integer label as its text
            "score": ("FP32", [n], [p.score for p in preds]),
            "logits": ("FP32", [n, len(meta.labels)], [float(x) for row in logits for x in row]),
        }
    if meta.kind == "regression":
        return {"value": ("FP32", [n], [p.value for p in preds])}
    width = max(len(p.tokens or []) for p in preds)
    rows = [(p.tokens or []) + [None] * (width - len(p.tokens or [])) for p in preds]
    return {
        "token": ("BYTES", [n, width], ["" if t is None else t.token for row in rows for t in row]),
        "label": ("BYTES", [n, width], ["" if t is None else t.label for row in rows for t in row]),
        "score": ("FP32", [n, width], [0.0 if t is None else t.score for row in rows for t in row]),
    }


def _wanted(body: InferRequest, names: list[str]) -> list[tuple[str, bool]]:
    """(output name, send it binary) for each output to return: the requested ones, or all of the kind."""
    all_binary = body.parameters.get("binary_data_output") is True
    if body.outputs is None:
        return [(name, all_binary) for name in names]
    wanted = []
    for out in body.outputs:
        if out.name not in names:
            raise InputError(f"unknown output {out.name!r}; this model has {names}")
        wanted.append((out.name, all_binary or out.parameters.get("binary_data") is True))
    return wanted
