"""MkDocs hooks (mkdocs.yml): the docs' reference tables, rendered from the declarations they document.

A page holds a marker comment and gets the table in its place at build time, so the docs cannot drift from the code:
- ``<!-- generated: server-settings -->``: every ``patchserve serve`` option (``ServerSettings``: its flag, env
  var, default and description);
- ``<!-- generated: training-options -->``: every training option (``patchserve.patches.train_config.options()``:
  its flag, JSON field, type and bounds, default and help), as ``patchserve train``, ``submit`` and the job API
  take them.
A marker whose table cannot be made fails the build (``mkdocs build --strict`` runs in the test command).
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- generated: {} -->"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def server_settings() -> str:
    from patchserve.server.settings import ServerSettings

    prefix = ServerSettings.model_config.get("env_prefix", "")
    rows = ["| option | environment variable | default | what it does |", "| --- | --- | --- | --- |"]
    for name, field in ServerSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = "unset" if field.default is None else field.default
        rows.append(f"| `{flag}` | `{prefix}{name.upper()}` | `{_cell(default)}` | {_cell(field.description or '')} |")
    return "\n".join(rows)


def _type(schema: dict[str, Any]) -> str:
    """A field's JSON type and bounds, as the job API checks them."""
    options = schema.get("anyOf", [schema])
    parts = []
    for option in options:
        if option.get("type") == "null":
            continue
        if "enum" in option:
            parts.append(" \\| ".join(f"`{v}`" for v in option["enum"]))
            continue
        kind = option.get("type", "")
        if kind == "array":
            kind = f"list of {_type(option.get('items', {}))}"
        bounds = [f"{op} {option[key]}" for key, op in (("minimum", ">="), ("exclusiveMinimum", ">")) if key in option]
        bounds += [f"{op} {option[key]}" for key, op in (("maximum", "<="), ("exclusiveMaximum", "<")) if key in option]
        parts.append(kind + (f" ({', '.join(bounds)})" if bounds else ""))
    return " or ".join(parts)


def training_options() -> str:
    from patchserve.patches.train_config import options

    rows = ["| option | job JSON field | type | default | what it does |", "| --- | --- | --- | --- | --- |"]
    for o in options():
        if o.required:
            default = "required"
        elif o.default is None:
            default = "unset"
        else:
            default = f"`{o.default}`"
        rows.append(f"| `{o.flag}` | `{o.name}` | {_type(o.schema)} | {default} | {_cell(o.help)} |")
    return "\n".join(rows)


TABLES = {"server-settings": server_settings, "training-options": training_options}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    for name, make in TABLES.items():
        marker = MARKER.format(name)
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown


def command_line() -> str:
    """Every ``patchserve`` command with its options, as ``--help`` declares them."""
    import argparse

    from patchserve.__main__ import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = []
    for name, command in sorted(sub.choices.items()):
        out += [f"### `patchserve {name}`", "", _cell(command.description or command.format_usage().strip()), ""]
        out += ["| option | what it does |", "| --- | --- |"]
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flags = ", ".join(f"`{f}`" for f in action.option_strings) or f"`{action.metavar or action.dest}`"
            text = (action.help or "") % {"default": action.default, "prog": command.prog}
            out.append(f"| {flags} | {_cell(text)} |")
        out.append("")
    return "\n".join(out)


TABLES["command-line"] = command_line
