"""Request and response bodies of the HTTP API (what OpenAPI documents)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class PairInput(BaseModel):
    text: str = Field(description="The (first) sentence.")
    text_pair: str | None = Field(None, description="The second sentence, for sentence-pair tasks.")


class PredictRequest(BaseModel):
    inputs: str | list[str] | list[PairInput] = Field(
        description='One text, a list of texts, or a list of {"text", "text_pair"} objects.',
        examples=[
            "a gripping, beautifully acted film",
            [{"text": "A plane takes off.", "text_pair": "A jet departs."}],
        ],
    )
    top_k: int | None = Field(None, ge=1, description="Classification: also return the k best labels with scores.")
    all_scores: bool = Field(False, description="Classification: also return the score of every label.")


class LabelScore(BaseModel):
    label: str
    score: float


class TokenPrediction(BaseModel):
    token: str = Field(description="A whitespace-separated word of the input.")
    label: str
    score: float


class Prediction(BaseModel):
    label: str | None = Field(None, description="Classification: the best label.")
    score: float | None = Field(None, description="Classification: its probability.")
    top_k: list[LabelScore] | None = Field(None, description="Classification with top_k: the k best labels.")
    scores: dict[str, float] | None = Field(None, description="Classification with all_scores: every label.")
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
    labels: list[str]
    n_params: int
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


class RollbackRequest(BaseModel):
    version: int = Field(ge=1, description="The version to make current.")


class ErrorBody(BaseModel):
    detail: str
