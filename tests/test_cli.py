"""The ``patchserve`` command line: inspect, tasks, register."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from safetensors.torch import save as st_save

from patchserve.__main__ import main
from tests.helpers import make_patch


def test_inspect_prints_metadata(tmp_path, tiny_encoder, capsys):
    patch = make_patch(tiny_encoder, task="trec", kind="classification", labels=["DESC", "HUM", "LOC"])
    f = tmp_path / "trec.safetensors"
    f.write_bytes(patch.data)
    assert main(["inspect", str(f)]) == 0
    out = capsys.readouterr().out
    assert "trec" in out and patch.patch_id in out and '["DESC", "HUM", "LOC"]' in out
    assert main(["inspect", "--json", str(f)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["task"] == "trec" and info["n_params"] == patch.n_params and info["labels"] == ["DESC", "HUM", "LOC"]
    assert info["base"]["fingerprint"] == tiny_encoder.fingerprint


def test_inspect_refuses_invalid_files_with_the_reason(tmp_path, tiny_encoder, capsys):
    f = tmp_path / "cut.safetensors"
    f.write_bytes(make_patch(tiny_encoder).data[:-10])
    assert main(["inspect", str(f)]) == 1
    assert "truncated" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing.safetensors")]) == 1
    assert "cannot read" in capsys.readouterr().err
    # every command that takes a patch file says the same, without a traceback
    assert main(["register", str(f), "--registry", f"disk://{tmp_path}/reg"]) == 1
    assert f"{f} is not a valid patch" in capsys.readouterr().err
    assert main(["eval", "--patch", str(tmp_path / "missing.safetensors"), "--data", str(f)]) == 1
    assert "cannot read" in capsys.readouterr().err
    # hostile metadata (nested 100,000 deep, which json.loads cannot parse without blowing the stack) is a reason
    patch = make_patch(tiny_encoder)
    tensors = {"bias." + k: v for k, v in patch.biases.items()} | {"head.weight": patch.head_weight}
    deep = tmp_path / "deep.safetensors"
    deep.write_bytes(st_save(tensors | {"head.bias": patch.head_bias}, metadata={"patchserve": "[" * 100_000}))
    assert main(["inspect", str(deep)]) == 1
    assert "nested too deeply" in capsys.readouterr().err


def test_register_and_list_tasks(tmp_path, tiny_encoder, capsys):
    f = tmp_path / "p.safetensors"
    f.write_bytes(make_patch(tiny_encoder).data)
    reg = f"disk://{tmp_path}/reg"
    assert main(["register", str(f), "--registry", reg]) == 0
    assert "registered sentiment v1" in capsys.readouterr().out
    assert main(["tasks", "--registry", reg, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sentiment"]["version"] == 1
    for name in ("trec", "sts-a", "sts-b"):
        f.write_bytes(make_patch(tiny_encoder, name).data)
        assert main(["register", str(f), "--registry", reg]) == 0
    capsys.readouterr()
    assert main(["tasks", "--registry", reg]) == 0
    assert [line.split("\t")[:2] for line in capsys.readouterr().out.splitlines()] == [
        ["sentiment", "v1"],
        ["sts-a", "v1"],
        ["sts-b", "v1"],
        ["trec", "v1"],
    ]
    assert main(["tasks", "--registry", reg, "--prefix", "sts-", "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)) == ["sts-a", "sts-b"]
    assert main(["tasks", "--registry", reg, "--prefix", "x"]) == 0
    assert "no tasks named x*" in capsys.readouterr().out


def test_console_script_is_installed(tmp_path, tiny_encoder):
    exe = shutil.which("patchserve")
    assert exe, "the patchserve console script is not on PATH: pip install -e ."
    f = tmp_path / "p.safetensors"
    f.write_bytes(make_patch(tiny_encoder).data)
    done = subprocess.run([exe, "inspect", "--json", str(f)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["task"] == "sentiment"
    done = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert "inspect" in done.stdout and "tasks" in done.stdout


def test_every_option_explains_itself_and_names_its_default(capsys):
    import argparse

    from patchserve.__main__ import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = []
    for name, command in sub.choices.items():
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            shown = action.help or ""
            has_default = action.option_strings and action.default not in (None, False)
            if not shown or (
                has_default and not isinstance(action, argparse.BooleanOptionalAction) and "default" not in shown
            ):
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"options without help or without their default: {missing}"
    for name, command in sub.choices.items():  # every --help renders (argparse %-formats the texts: a stray % broke
        assert name in command.format_help()  # 'patchserve serve --help' once)
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("patchserve 0.1")


def test_a_renamed_serve_setting_still_works_under_its_former_name(monkeypatch):
    """--patch-cache-mb became --host-cache-mb: the former flag and env var still set it, --help shows only the new
    name, and the new env var wins over the former one."""
    import argparse

    from patchserve.server.cli import add_settings_options, settings_from_args
    from patchserve.server.settings import ServerSettings

    parser = argparse.ArgumentParser()
    add_settings_options(parser, ServerSettings)
    assert settings_from_args(parser.parse_args(["--patch-cache-mb", "64"]), ServerSettings).host_cache_mb == 64
    assert "--host-cache-mb" in parser.format_help() and "--patch-cache-mb" not in parser.format_help()
    assert ServerSettings().host_cache_mb == 512
    monkeypatch.setenv("PATCHSERVE_PATCH_CACHE_MB", "32")
    assert ServerSettings().host_cache_mb == 32
    monkeypatch.setenv("PATCHSERVE_HOST_CACHE_MB", "16")
    assert ServerSettings().host_cache_mb == 16
