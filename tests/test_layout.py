"""The project's shape: one installed namespace (patchserve.*, nothing generic at top level), and small modules."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {  # folder -> its installed package
    "patchserve": "patchserve",
    "patches": "patchserve.patches",
    "server": "patchserve.server",
    "trainer": "patchserve.trainer",
}


def _packages_on_disk() -> set[str]:
    """Every package folder of the layout under its installed name (server/engine -> patchserve.server.engine)."""
    found = set()
    for folder, name in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    return found


def test_every_package_folder_is_installed_under_patchserve():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(setuptools["packages"]) == _packages_on_disk()
    assert setuptools["package-dir"] == {v: k for k, v in FOLDERS.items() if k != "patchserve"}


def test_the_wheel_installs_one_namespace_and_nothing_generic(tmp_path):
    """Built and installed as users get it: every file under patchserve/ (the UI's templates too), the command's
    entry point there, and `import server`, `trainer` or `patches` fail where `import patchserve.server` works."""
    source = tmp_path / "src"  # a copy: a build leaves build/ and *.egg-info behind in its source folder
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("patchserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"patchserve", wheel.name.split("-py")[0] + ".dist-info"}
    for path in ("patchserve/server/app.py", "patchserve/server/ui/templates/page.html", "patchserve/__main__.py"):
        assert path in names, path
    packages = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packages == _packages_on_disk()
    entry_points = zipfile.ZipFile(wheel).read(wheel.name.split("-py")[0] + ".dist-info/entry_points.txt").decode()
    assert "patchserve = patchserve.__main__:main" in entry_points
    target = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)]
    assert subprocess.run(install, capture_output=True, timeout=300).returncode == 0
    probe = (
        "import importlib, sys\n"
        "import patchserve.server, patchserve.trainer, patchserve.patches\n"
        "assert patchserve.server.__file__.startswith(sys.argv[1]), patchserve.server.__file__\n"
        "for name in ('server', 'trainer', 'patches'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError:\n"
        "        continue\n"
        "    raise SystemExit(f'{name} is importable')\n"
    )
    # -S: no site-packages (this checkout's editable install stays out); run outside the checkout
    run = subprocess.run(
        [sys.executable, "-S", "-c", probe, str(target)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_modules_stay_small():
    """No source file over 500 lines and no function over 80 outside bench/: one concern per module."""
    too_long = []
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            source = path.read_text()
            if source.count("\n") > 500:
                too_long.append(f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines")
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    if length > 80:
                        too_long.append(f"{path.relative_to(ROOT)}: {node.name} is {length} lines")
    assert not too_long, too_long
