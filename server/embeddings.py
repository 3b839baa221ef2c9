"""Embeddings: each input's pooled vector under a task's patch (its biases change the representation: a
task-tuned embedding, batched with every other request like predict), or under the base encoder; and the
OpenAI-compatible ``POST /v1/embeddings`` so existing OpenAI clients can call it.

Pooling follows the patch's metadata (the base encoder's own pooling for the base: mean for the default
sentence-embedding encoder). ``/v1/embeddings`` returns unit-length vectors, as OpenAI's do.
"""

from __future__ import annotations

import base64
import time
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field, WrapValidator
from pydantic_core import PydanticCustomError
from pydantic_core.core_schema import ValidatorFunctionWrapHandler

from patchserve.patches.api import EmbedRequest, EmbedResponse, Text
from patchserve.patches.errors import InvalidTaskNameError, TaskNotFoundError
from patchserve.server.deps import PredictAuth, ServiceDep
from patchserve.server.inference import BASE_TASK, InferenceService, name_task, run_rows
from patchserve.server.openapi import TaskName, errors
from patchserve.server.predict import InputError, check_request, normalise_inputs

router = APIRouter(tags=["embeddings"])
BASE_MODEL = "base"  # /v1 model name of the base encoder (its own name works too)


async def _embed(
    svc: Any, request: Request, task: str | None, texts: list[str], pairs: list[str] | None, normalize: bool
) -> tuple[EmbedResponse, int]:
    """Vectors of ``texts`` under ``task``'s current patch (None: the base encoder), and the tokens they took."""
    info = patch = None
    if task is not None:
        info, patch = await svc.catalog.resolve_async(task)
        check_request(patch, pairs)
    name_task(request, BASE_TASK if task is None else task)
    encoded, vectors = await run_rows(svc, request, patch, texts, pairs, output="embedding")
    stacked = np.stack(vectors)  # [N, H]
    if normalize:  # as torch.nn.functional.normalize: a zero vector stays zero
        stacked = stacked / np.maximum(np.linalg.norm(stacked, axis=-1, keepdims=True), 1e-12)
    response = EmbedResponse(
        task=task,
        version=None if info is None else info.version,
        patch_id=None if info is None else info.patch_id,
        model=svc.encoder.name,
        pooling=svc.encoder.default_pooling if patch is None else patch.meta.pooling,
        dimensions=stacked.shape[1],
        embeddings=stacked.tolist(),
        truncated=[e.truncated for e in encoded],
    )
    return response, sum(len(e.row.input_ids) for e in encoded)


_TASK_ERRORS = errors(401, 403, 404, 409, 413, 422, 503, 504)


@router.post("/tasks/{name}/embed", response_model=EmbedResponse, responses=_TASK_ERRORS)
async def embed_task(name: TaskName, body: EmbedRequest, request: Request, svc: InferenceService) -> Any:
    """Each input's pooled vector under the current version of task ``name``'s patch."""
    texts, pairs = normalise_inputs(body.inputs)
    return (await _embed(svc, request, name, texts, pairs, body.normalize))[0]


@router.post("/embed", response_model=EmbedResponse, responses=errors(401, 403, 413, 422, 503, 504))
async def embed_base(body: EmbedRequest, request: Request, svc: InferenceService) -> Any:
    """Each input's pooled vector under the base encoder (no patch)."""
    texts, pairs = normalise_inputs(body.inputs)
    return (await _embed(svc, request, None, texts, pairs, body.normalize))[0]


# --- OpenAI-compatible ---------------------------------------------------------------------------------------------
def _texts_only(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    if isinstance(value, list) and value and all(isinstance(x, int | list) for x in value):
        raise PydanticCustomError("token_ids", "token ids are not accepted: send the text (a string or strings)")
    return handler(value)


class OpenAIEmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str = Field(description=f"A task name, or {BASE_MODEL!r} (or the encoder's name) for the base encoder.")
    input: Annotated[Text | list[Text], WrapValidator(_texts_only)] = Field(description="A text or a list of texts.")
    encoding_format: Literal["float", "base64"] = Field("float", description="float lists, or base64 float32 LE.")
    dimensions: int | None = Field(None, description="Must equal the encoder's width when given.")
    user: str | None = Field(None, description="Accepted and ignored.")


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage


@router.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse, responses=_TASK_ERRORS)
async def openai_embeddings(body: OpenAIEmbeddingRequest, request: Request, svc: InferenceService) -> Any:
    """OpenAI's embeddings API: ``model`` names a task (its patch shapes the vectors) or the base encoder; vectors
    have unit length. The API key is the bearer token."""
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise InputError("input is empty: send a text or a non-empty list of texts")
    base = body.model in (BASE_MODEL, svc.encoder.name) and not await run_in_threadpool(_is_task, svc, body.model)
    result, tokens = await _embed(svc, request, None if base else body.model, texts, None, normalize=True)
    if body.dimensions is not None and body.dimensions != result.dimensions:
        raise InputError(f"this model's vectors have {result.dimensions} dimensions; leave dimensions out")
    data = [
        OpenAIEmbedding(index=i, embedding=_base64(v) if body.encoding_format == "base64" else v)
        for i, v in enumerate(result.embeddings)
    ]
    return OpenAIEmbeddingResponse(
        data=data, model=body.model, usage=OpenAIUsage(prompt_tokens=tokens, total_tokens=tokens)
    )


def _base64(vector: list[float]) -> str:
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


def _is_task(svc: Any, name: str) -> bool:
    """Whether a task is registered as ``name`` (it then wins over the base encoder of that name)."""
    if name in svc.catalog.current:
        return True
    try:
        svc.registry.info(name)
    except (TaskNotFoundError, InvalidTaskNameError):
        return False
    return True


@router.get("/v1/models", responses=errors(401, 403))
async def openai_models(svc: ServiceDep, _: PredictAuth) -> dict[str, Any]:
    """OpenAI's model list: every task, and the base encoder."""
    now = int(time.time())
    names = [BASE_MODEL, *await run_in_threadpool(svc.registry.tasks)]
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "created": now, "owned_by": "patchserve"} for n in names],
    }
