"""Every error the shared library raises.

Each message says what is wrong *and* what to do about it; the server turns these into HTTP 4xx answers and the
CLI prints them, so they are written for the person who sent the patch or named the task.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class PatchServeError(Exception):
    """Base of every error patchserve raises on purpose."""


# --- patch files ---------------------------------------------------------------------------------------------
class PatchError(PatchServeError):
    """A patch file (or bytes) could not be accepted."""


class PatchTooLargeError(PatchError):
    """The file is larger than the configured limit."""


class PatchCorruptError(PatchError):
    """Truncated or garbage bytes: not a readable safetensors file."""


class PatchVersionError(PatchError):
    """The file declares a patch format version this build does not read."""


class PatchMetadataError(PatchError):
    """Metadata missing, malformed or inconsistent with the tensors."""


class RetiredPatchTypeError(PatchMetadataError):
    """The patch is of a type an earlier release wrote and this one no longer serves (``RETIRED_PATCH_TYPES``)."""


class PatchKeysError(PatchError):
    """Unknown or missing tensor keys."""


class PatchShapeError(PatchError):
    """A tensor has the wrong shape or dtype."""


class PatchValueError(PatchError):
    """A tensor holds NaN or Inf."""


class FingerprintMismatchError(PatchError):
    """The patch was trained on a different base encoder."""


# --- encoders ------------------------------------------------------------------------------------------------
class EncoderError(PatchServeError):
    """The base encoder could not be loaded or is not supported."""


# --- registry ------------------------------------------------------------------------------------------------
class RegistryError(PatchServeError):
    """The registry could not complete an operation."""


class InvalidTaskNameError(RegistryError):
    """A task name breaks the naming rules."""


class TaskNotFoundError(RegistryError):
    """No task of that name is registered."""

    def __init__(self, task: str) -> None:
        super().__init__(
            f"task {task!r} is not registered; list the registered tasks with GET /tasks "
            "or `patchserve tasks`, or register it with POST /tasks"
        )
        self.task = task


class VersionNotFoundError(RegistryError):
    """The task exists but not at that version."""

    def __init__(self, task: str, version: int, available: list[int]) -> None:
        super().__init__(f"task {task!r} has no version {version}; its versions are {available}")
        self.task = task
        self.version = version
        self.available = available


class RegistryUnavailableError(RegistryError):
    """The backing store (disk folder or Redis) cannot be reached."""


class ReplicationError(RegistryUnavailableError):
    """A write reached the Redis primary but not the replicas it must reach before it counts (--redis-min-replicas):
    it may be lost in a failover. The message says so, and that the client should check before it retries."""


# --- training jobs -----------------------------------------------------------------------------------------------
class JobError(PatchServeError):
    """A job request (its training config, gate or data) is invalid, or a job cannot be found."""


def describe_validation_errors(errors: Iterable[Mapping[str, Any]], limit: int = 5) -> str:
    """pydantic-style errors (``ValidationError.errors()``, FastAPI's request errors) as one line,
    ``where: problem; where: problem``. The values sent are never echoed: they may be huge, NaN or not
    valid Unicode, and a message that quotes them could not itself be sent."""
    lines = []
    for err in errors:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        lines.append(f"{where}: {err.get('msg', 'invalid')}")
    more = f"; and {len(lines) - limit} more" if len(lines) > limit else ""
    return "; ".join(lines[:limit]) + more
