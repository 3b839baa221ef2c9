"""Request and response bodies of the HTTP API, defined once: the server validates and documents them (OpenAPI),
the Python client (``patchserve.client``) sends and parses them."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError
from pydantic_core.core_schema import ValidatorFunctionWrapHandler

JOB_STATUSES = ("queued", "running", "succeeded", "rejected", "failed", "cancelled")
TERMINAL = frozenset({"succeeded", "failed", "rejected", "cancelled"})

# Request bodies are read strictly: a bool is not a number, a number is not a text, and a field this API does not
# know is an error rather than silently ignored (a misspelt "topk" would otherwise change nothing without a word).
REQUEST = ConfigDict(strict=True, extra="forbid")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_unicode(text: str) -> str:
    found = _SURROGATE.search(text)
    if found is not None:
        raise PydanticCustomError(
            "lone_surrogate",
            "the text has a lone UTF-16 surrogate at character {index}, which is not valid Unicode; send UTF-8 "
            "text (in JSON, a \\uD8xx escape must be followed by its \\uDCxx pair)",
            {"index": found.start()},
        )
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


class PairInput(BaseModel):
    model_config = REQUEST

    text: Text = Field(description="The (first) sentence.")
    text_pair: Text | None = Field(None, description="The second sentence, for sentence-pair tasks.")


_TEXTS: TypeAdapter[list[str]] = TypeAdapter(list[Text])
_PAIRS: TypeAdapter[list[PairInput]] = TypeAdapter(list[PairInput])


def _one_input_shape(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Errors of the one shape the client meant (by the value's type), instead of one per union member."""
    try:
        return handler(value)
    except ValidationError:
        if isinstance(value, list) and value and isinstance(value[0], dict):
            return _PAIRS.validate_python(value, strict=True)
        if isinstance(value, list):
            return _TEXTS.validate_python(value, strict=True)
        if isinstance(value, str):
            return _valid_unicode(value)
        raise PydanticCustomError(
            "inputs_shape", 'inputs must be a text, a list of texts, or a list of {"text", "text_pair"} objects'
        ) from None


class PredictRequest(BaseModel):
    model_config = REQUEST

    inputs: Annotated[Text | list[Text] | list[PairInput], WrapValidator(_one_input_shape)] = Field(
        description='One text, a list of texts, or a list of {"text", "text_pair"} objects. Texts longer than '
        "the task's maximum length are truncated (and flagged `truncated`).",
        examples=[
            "a gripping, beautifully acted film",
            [{"text": "A plane takes off.", "text_pair": "A jet departs."}],
        ],
    )
    top_k: int | None = Field(None, ge=1, description="Classification: also return the k best labels with scores.")
    all_scores: bool = Field(False, description="Classification: also return the score of every label.")


class LabelScore(BaseModel):
    label: str | int = Field(description="A label as the task's training data wrote it: a string, or a JSON integer.")
    score: float


class TokenPrediction(BaseModel):
    token: str = Field(description="A whitespace-separated word of the input.")
    label: str
    score: float


class Prediction(BaseModel):
    label: str | int | None = Field(
        None, description="Classification: the best label, with the JSON type of the training data's labels."
    )
    score: float | None = Field(None, description="Classification: its probability.")
    top_k: list[LabelScore] | None = Field(None, description="Classification with top_k: the k best labels.")
    scores: dict[str, float] | None = Field(
        None, description="Classification with all_scores: every label (as text: JSON object keys are strings)."
    )
    value: float | None = Field(None, description="Regression: the predicted value.")
    tokens: list[TokenPrediction] | None = Field(None, description="Token classification: one label per word.")
    truncated: bool = Field(False, description="True when the input was cut to the task's maximum length.")


class PredictResponse(BaseModel):
    task: str
    version: int
    patch_id: str
    predictions: list[Prediction]


class BaseInfo(BaseModel):
    name: str
    fingerprint: str


class TaskRegistered(BaseModel):
    name: str
    version: int
    patch_id: str
    kind: str
    labels: list[str | int]
    n_params: int
    patch_type: str = Field(
        "bitfit",
        description="`bitfit` (biases + head), `bitfit-ia3` (biases, (IA)^3 scales + head) or `lora` (biases, LoRA "
        "factors + head)",
    )
    base: BaseInfo


class VersionPublic(BaseModel):
    version: int
    patch_id: str
    size: int
    registered_at: str


class TaskSummary(BaseModel):
    name: str
    version: int = Field(description="The current version.")
    patch_id: str
    registered_at: str


class TaskDetail(BaseModel):
    name: str
    current: int
    versions: list[VersionPublic]
    metadata: dict[str, Any] = Field(description="The current version's patch metadata (as `patchserve inspect`).")


class TaskDeleted(BaseModel):
    name: str
    deleted: bool = True


class EmbedRequest(BaseModel):
    model_config = REQUEST

    inputs: Annotated[Text | list[Text] | list[PairInput], WrapValidator(_one_input_shape)] = Field(
        description='One text, a list of texts, or a list of {"text", "text_pair"} objects (as for predict).',
        examples=["a gripping, beautifully acted film"],
    )
    normalize: bool = Field(False, description="Scale each vector to unit length (cosine similarity = dot product).")


class EmbedResponse(BaseModel):
    task: str | None = Field(description="The task whose patch shaped the vectors; null for the base encoder.")
    version: int | None = Field(description="The task's version; null for the base encoder.")
    patch_id: str | None
    model: str = Field(description="The base encoder's name.")
    pooling: str = Field(description="How token states became one vector: mean, cls or pooler.")
    dimensions: int
    embeddings: list[list[float]] = Field(description="One vector per input, in order.")
    truncated: list[bool] = Field(description="Per input: true when it was cut to the maximum length.")


class JobPublic(BaseModel):
    """A training job as the queue holds it."""

    id: str
    task: str
    status: str = Field(description="queued, running, succeeded, rejected, failed or cancelled.")
    config: dict[str, Any] = Field(description="The training config (every field, defaults filled in).")
    gate: dict[str, Any] = Field(description='When the patch is registered: {"min_dev", "not_worse"}.')
    files: dict[str, str] = Field(description="Data file role (train, dev, test) -> the uploaded file's name.")
    created_at: str = Field(description="When it was submitted (ISO-8601, UTC).")
    started_at: str | None = Field(None, description="When its (last) attempt started.")
    finished_at: str | None = Field(None, description="When it ended.")
    worker: str | None = None
    attempts: int = 0
    progress: dict[str, Any] = Field(
        default_factory=dict,
        description="While training: step, total_steps, loss, dev metrics, seed, lr, runs, active_runs.",
    )
    result: dict[str, Any] = Field(
        default_factory=dict, description="When done: dev/test metrics, steps, seconds; version and patch_id."
    )
    error: str | None = Field(None, description="Why it was rejected, failed or cancelled.")
    cancel_requested: str | None = Field(None, description="When a cancel was asked for, if it was.")

    @property
    def done(self) -> bool:
        """The job has ended (succeeded, rejected, failed or cancelled)."""
        return self.status in TERMINAL


class RollbackRequest(BaseModel):
    model_config = REQUEST

    version: int = Field(ge=1, description="The version to make current.")


class ErrorBody(BaseModel):
    detail: str
