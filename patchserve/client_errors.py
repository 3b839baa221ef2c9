"""The errors of ``patchserve.client``: an error answer raises the ``PatchserveError`` subclass of its status,
carrying the status, the server's message (which says what to fix) and the answer's headers."""

from __future__ import annotations

from collections.abc import Mapping

import httpx


class PatchserveError(Exception):
    """The server answered with an error. ``status`` is the HTTP status, ``detail`` the server's message."""

    def __init__(self, status: int, detail: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(f"{status}: {detail}")
        self.status, self.detail, self.headers = status, detail, dict(headers or {})


class InvalidRequest(PatchserveError):
    """400/422: the request (inputs, a patch, a job config or data) is invalid; the message names the problem."""


class Unauthorized(PatchserveError):
    """401: the route needs a bearer token (pass ``token=``)."""


class Forbidden(PatchserveError):
    """403: the token is not one this route accepts."""


class NotFound(PatchserveError):
    """404: no such task, version or job."""


class Conflict(PatchserveError):
    """409: a stored patch does not fit the server's encoder, or a job to cancel has already ended."""


class TooLarge(PatchserveError):
    """413: the body or patch is over the server's limit."""


class NotSupported(PatchserveError):
    """501: the server does not offer this (e.g. training jobs without a job queue)."""


class Overloaded(PatchserveError):
    """503 with Retry-After: the server's queue is full; retry after ``retry_after`` seconds."""

    @property
    def retry_after(self) -> float:
        return float(self.headers.get("retry-after", 1))


class Unavailable(PatchserveError):
    """503: the registry or job queue cannot be reached, or the server is starting."""


class Timeout(PatchserveError):
    """504: the request outlived the server's request timeout."""


class ServerError(PatchserveError):
    """Any other 5xx."""


_BY_STATUS: dict[int, type[PatchserveError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    422: InvalidRequest,
    501: NotSupported,
    504: Timeout,
}


def raise_for_status(response: httpx.Response) -> None:
    """Raise the ``PatchserveError`` subclass of an error answer's status, with the server's message."""
    if response.is_success:
        return
    try:
        detail = str(response.json().get("detail", response.text))
    except ValueError:
        detail = response.text or response.reason_phrase
    status = response.status_code
    if status == 503:
        kind: type[PatchserveError] = Overloaded if "retry-after" in response.headers else Unavailable
    else:
        kind = _BY_STATUS.get(status, ServerError if status >= 500 else PatchserveError)
    raise kind(status, detail, response.headers)
