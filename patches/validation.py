"""What a client sends, checked before it becomes a file name, a Redis key, a log line or JSON: task names, labels,
texts and JSON documents. Each refusal names what was wrong, quoting the value cut short (``shown``)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from patchserve.patches.errors import InvalidTaskNameError

TASK_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # always fullmatch: "$" would allow a final "\n"
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")  # Unicode's categories Cc (controls), Cs (surrogates)
_SURROGATE = re.compile("[\ud800-\udfff]")


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages that quote what a client sent."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def unprintable(text: str) -> str | None:
    """The first control character or lone surrogate in ``text`` (as a ``U+XXXX`` string), or None.

    Names (tasks, labels, uploaded files) become file names, Redis keys, log lines and JSON; none of them may
    carry a newline, a NUL or half of a UTF-16 pair.
    """
    found = _UNPRINTABLE.search(text)
    return None if found is None else f"U+{ord(found.group()):04X}"


def validate_task_name(name: str) -> str:
    """Return ``name`` if it is a legal task name, else raise :class:`InvalidTaskNameError`.

    Task names become file names and Redis keys, so: 1-64 characters of letters, digits, ``_ . -``,
    starting with a letter or digit, and no ``..`` (no path traversal). No control character passes.
    """
    if not isinstance(name, str) or not TASK_NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidTaskNameError(
            f"invalid task name {shown(name)}: use 1-64 characters of letters, digits, '_', '.', '-', "
            "starting with a letter or digit, without '..'"
        )
    return name


MAX_JSON_DEPTH = 16


MAX_JSON_INT = 2**53 - 1  # the largest integer every JSON reader (JavaScript's included) holds exactly


Label = str | int  # a task's label keeps the JSON type of the training data's labels; tags are strings


def is_label(value: object) -> bool:
    """A label as a patch stores it: a non-empty string, or an integer (not a bool) any JSON reader holds exactly."""
    if isinstance(value, str):
        return bool(value)
    return type(value) is int and abs(value) <= MAX_JSON_INT


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def is_finite_number(v: object) -> bool:
    """A JSON number that is a finite float (an integer too large for a float is not: 1e400 written out)."""
    if not _is_number(v):
        return False
    try:
        return math.isfinite(v)  # type: ignore[arg-type]
    except OverflowError:
        return False


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


class _OutOfRange(ValueError):
    """A JSON number too large for a float (1e400)."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _OutOfRange(text)
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]")


def _may_hold_surrogates(text: str | bytes) -> bool:
    """False when no string parsed from ``text`` can hold a lone surrogate: ASCII (in no wider encoding: no NUL)
    with no escape of one (most JSON; a false True only costs the walk over its strings)."""
    if isinstance(text, bytes):
        return not text.isascii() or b"\x00" in text or _SURROGATE_ESCAPE_BYTES.search(text) is not None
    return not text.isascii() or _SURROGATE_ESCAPE.search(text) is not None


def strict_json(text: str | bytes, what: str, error: type[Exception]) -> Any:
    """``json.loads`` for JSON a client sent, raising ``error`` (naming ``what``) for anything that could break
    later: invalid JSON, NaN/Infinity, numbers too large for a float, nesting deeper than ``MAX_JSON_DEPTH``,
    and strings with lone surrogates (which cannot be written back as UTF-8)."""
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise error(f"{what}: nested too deeply") from None
    except _OutOfRange:
        raise error(f"{what}: a number is out of range (NaN or Infinity)") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, NaN, a 5,000-digit integer...
        raise error(f"{what}: not valid JSON ({exc})") from None
    problem = _json_problem(value, MAX_JSON_DEPTH, strings=_may_hold_surrogates(text))
    if problem is not None:
        raise error(f"{what}: {problem}")
    return value


def _json_problem(value: Any, depth: int, strings: bool = True) -> str | None:
    """What makes a parsed JSON value unusable, or None (iterative: a deep value cannot exhaust the stack): nesting
    deeper than ``depth``, a string with a lone surrogate (looked for only with ``strings``). Its numbers are
    finite: ``strict_json`` parses them so."""
    stack = [(value, depth)]
    while stack:
        item, left = stack.pop()
        if isinstance(item, dict | list):
            if left <= 0:
                return f"nested deeper than {MAX_JSON_DEPTH} levels"
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            if strings:
                stack.extend((child, left - 1) for child in children)
            else:  # only what can nest
                stack.extend((child, left - 1) for child in children if isinstance(child, dict | list))
        elif strings and isinstance(item, str) and _SURROGATE.search(item):
            return f"the string {shown(item)} contains a lone surrogate (not valid Unicode)"
    return None
