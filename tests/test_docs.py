"""The documentation: its reference tables are rendered from the declarations, and the README's links resolve.
(The site itself is built with ``mkdocs build --strict`` by scripts/test: a broken link or a missing page fails.)"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from patchserve.patches.train_config import options
from patchserve.server.settings import ServerSettings

ROOT = Path(__file__).resolve().parents[1]


def _hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_tables_show_every_option_and_setting_as_declared():
    hooks = _hooks()
    training = hooks.training_options()
    for o in options():
        assert f"| `{o.flag}` | `{o.name}` |" in training and hooks._cell(o.help) in training, o.name
    assert "| `--min-steps` | `min_steps` | integer (>= 1, <= 10000000) | unset |" in training
    settings = hooks.server_settings()
    for name, field in ServerSettings.model_fields.items():
        assert f"`PATCHSERVE_{name.upper()}`" in settings and hooks._cell(field.description) in settings, name
    commands = hooks.command_line()
    for command in ("serve", "train", "eval", "worker", "submit", "jobs", "inspect", "tasks", "register", "prune"):
        assert f"### `patchserve {command}`" in commands, command
    assert "| `--concurrent-jobs` |" in commands and "| `--unservable` |" in commands
    page = hooks.on_page_markdown("a\n<!-- generated: training-options -->\nb", None, None, None)
    assert page.startswith("a\n| option | job JSON field |") and page.endswith("\nb")
    for name in hooks.TABLES:  # every table has its page
        assert any(f"<!-- generated: {name} -->" in p.read_text() for p in (ROOT / "docs").glob("*.md")), name


def test_the_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= 300
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links and all((ROOT / link).exists() for link in links if "://" not in link), links
