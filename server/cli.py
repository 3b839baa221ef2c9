"""``patchserve serve``. Its options are generated from ServerSettings, so flags, env vars and --help agree."""

from __future__ import annotations

import argparse
import logging
import sys
import types
import typing
from typing import Any

from pydantic import SecretStr, ValidationError

from patchserve.server.settings import RENAMED, ServerSettings


def _option_type(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not types.NoneType] or [annotation]
    base = args[0]
    return str if base is SecretStr else base


def add_settings_options(parser: argparse.ArgumentParser, settings_cls: type[ServerSettings]) -> None:
    prefix = settings_cls.model_config.get("env_prefix", "")
    for name, field in settings_cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = "unset" if field.default is None else field.default
        # argparse %-formats help texts: a literal % in a description must be doubled
        help_text = f"{field.description} [env {prefix}{name.upper()}; default {default}]".replace("%", "%%")
        kind = _option_type(field.annotation)
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=kind, default=None, help=help_text, metavar=name.upper())
    for old, new in RENAMED.items():  # a former flag still works, under its new name (--help shows only that)
        kind = _option_type(settings_cls.model_fields[new].annotation)
        parser.add_argument("--" + old.replace("_", "-"), dest=new, type=kind, default=None, help=argparse.SUPPRESS)


def settings_from_args(args: argparse.Namespace, settings_cls: type[ServerSettings]) -> ServerSettings:
    """Flags given on the command line override env vars, which override defaults."""
    given = {n: getattr(args, n) for n in settings_cls.model_fields if getattr(args, n, None) is not None}
    return settings_cls(**given)


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args, ServerSettings)
    except ValidationError as exc:
        for err in exc.errors():
            where = ".".join(str(x) for x in err["loc"]) or "settings"
            print(f"error: {where}: {err['msg']}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from patchserve.server.predict import serial_tokenizers

    serial_tokenizers()
    if settings.workers != 0:
        from patchserve.server.supervisor import serve

        return serve(settings)
    import uvicorn

    from patchserve.server.app import create_app
    from patchserve.server.supervisor import GRACEFUL_SHUTDOWN_S

    uvicorn.run(  # --workers 0: the engine in this one process
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    return 0


def register_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the HTTP server (one resident encoder, any number of task patches)",
        description="Serve BitFit patches over HTTP. Every option is also an environment variable PATCHSERVE_<NAME>.",
    )
    add_settings_options(p, ServerSettings)
    p.set_defaults(func=_serve)
