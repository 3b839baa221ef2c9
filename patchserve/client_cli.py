"""Commands that talk to a running server through ``patchserve.client``: ``predict``, ``versions``, ``rollback``
and ``delete`` (``--url``, ``--token``; env PATCHSERVE_URL and PATCHSERVE_TOKEN). Errors print the server's
message and exit 1."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

URL_ENV, TOKEN_ENV = "PATCHSERVE_URL", "PATCHSERVE_TOKEN"


def _client(args: argparse.Namespace) -> Any:
    from patchserve.client import Client

    return Client(args.url, token=args.token)


def _run(command: Any) -> Any:
    """Run a client call; the server's error message (or an unreachable server) becomes exit 1."""

    def run(args: argparse.Namespace) -> int:
        import httpx

        from patchserve.client import PatchserveError

        try:
            with _client(args) as client:
                return int(command(client, args) or 0)
        except PatchserveError as exc:
            print(f"error: {exc.detail} (HTTP {exc.status})", file=sys.stderr)
        except httpx.TransportError as exc:
            print(f"error: cannot reach the server at {args.url}: {exc}", file=sys.stderr)
        return 1

    return run


def _predict(client: Any, args: argparse.Namespace) -> None:
    if args.pair and len(args.pair) != len(args.texts):
        raise SystemExit(f"error: {len(args.texts)} texts but {len(args.pair)} --pair; give one --pair per text")
    inputs = list(zip(args.texts, args.pair, strict=True)) if args.pair else args.texts
    result = client.predict(args.task, inputs, top_k=args.top_k)
    if args.json:
        print(result.model_dump_json(indent=2, exclude_none=True))
        return
    for text, pred in zip(args.texts, result.predictions, strict=True):
        if pred.tokens is not None:
            shown = " ".join(f"{t.token}/{t.label}" for t in pred.tokens)
        elif pred.value is not None:
            shown = f"{pred.value:.4f}"
        elif pred.top_k:
            shown = ", ".join(f"{s.label} {s.score:.3f}" for s in pred.top_k)
        else:
            shown = f"{pred.label} {pred.score:.3f}"
        print(f"{shown}\t{text}" + ("\t(truncated)" if pred.truncated else ""))


def _versions(client: Any, args: argparse.Namespace) -> None:
    detail = client.task(args.task)
    if args.json:
        print(json.dumps([v.model_dump() for v in detail.versions], indent=2))
        return
    print("version\tcurrent\tregistered_at\tpatch_id")
    for v in detail.versions:
        print(f"{v.version}\t{'*' if v.version == detail.current else ''}\t{v.registered_at}\t{v.patch_id}")


def _rollback(client: Any, args: argparse.Namespace) -> None:
    info = client.rollback(args.task, args.version)
    print(f"{info.name}: version {info.version} is current ({info.patch_id})")


def _delete(client: Any, args: argparse.Namespace) -> None:
    client.delete(args.task)
    print(f"{args.task}: deleted with all its versions")


def _server_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default=os.environ.get(URL_ENV, "http://localhost:8000"),
        help=f"the server (env {URL_ENV}; default http://localhost:8000)",
    )
    p.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"bearer token (env {TOKEN_ENV}; default none)")
    p.add_argument("--task", required=True, help="the task's name")


def register_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predict",
        help="predict with a task on a running server",
        description="Send texts to POST /tasks/TASK/predict and print one answer per line (label and score, the "
        "value, or word/tag pairs).",
    )
    _server_options(p)
    p.add_argument("texts", nargs="+", metavar="TEXT", help="the texts to predict")
    p.add_argument("--pair", action="append", metavar="TEXT", help="text_pair for sentence-pair tasks, one per TEXT")
    p.add_argument("--top-k", type=int, help="classification: also the k best labels (default: the best only)")
    p.add_argument("--json", action="store_true", help="print the server's JSON answer")
    p.set_defaults(func=_run(_predict))

    p = sub.add_parser("versions", help="list a task's versions on a running server (the current one is marked *)")
    _server_options(p)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_run(_versions))

    p = sub.add_parser("rollback", help="make a stored version of a task current on a running server (admin token)")
    _server_options(p)
    p.add_argument("--version", type=int, required=True, help="the version to make current")
    p.set_defaults(func=_run(_rollback))

    p = sub.add_parser("delete", help="delete a task and all its versions on a running server (admin token)")
    _server_options(p)
    p.set_defaults(func=_run(_delete))
