"""Path parameters shared by the routes, with the descriptions and examples OpenAPI shows."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path

TaskName = Annotated[
    str,
    Path(
        description="A task name: 1-64 letters, digits, '_', '.', '-', starting with a letter or digit.",
        examples=["sentiment"],
    ),
]
JobId = Annotated[str, Path(description="A job id (32 hex characters), as POST /jobs returned it.")]
