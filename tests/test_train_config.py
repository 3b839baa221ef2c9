"""The training options: declared once (TrainConfig), read by the CLI, the job API and the docs alike."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import get_args

import pytest

from patches.bitfit import BIAS_SUBSETS
from patches.format import KINDS, POOLINGS
from patches.train_config import (
    SELECTION_METRICS,
    BiasSubset,
    Kind,
    Metric,
    Pooling,
    TrainConfig,
    options,
)
from trainer.cli import add_training_options, config_from_args


def test_every_option_is_declared_with_help_and_the_choices_its_owners_know():
    declared = options()
    assert [o.name for o in declared] == [f for f in TrainConfig.__dataclass_fields__]
    assert all(o.help.endswith(".") and len(o.help) > 20 for o in declared), [o.name for o in declared if not o.help]
    assert set(get_args(Kind)) == set(KINDS) and set(get_args(Pooling)) == set(POOLINGS)
    assert set(get_args(BiasSubset)) == set(BIAS_SUBSETS)
    assert set(get_args(Metric)) == {m for names in SELECTION_METRICS.values() for m in names}
    by_name = {o.name: o for o in declared}
    assert by_name["task"].required and not by_name["lr"].required
    assert (by_name["lr_search"].flag, by_name["lr_search"].many, by_name["lr_search"].kind) == (
        "--lr-search",
        True,
        float,
    )
    assert by_name["scales"].choices == ("none", "ia3") and by_name["full"].kind is bool
    assert by_name["min_steps"].schema["maximum"] == 10_000_000  # the bounds the docs' table shows


def _parse(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_training_options(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_the_cli_flags_are_the_options_and_only_what_was_given_is_sent():
    assert _parse("--task", "t") == {"task": "t"}
    given = _parse(
        "--task", "t", "--lr-search", "1e-3", "2e-3", "--full", "--dropout", "0", "--kind", "regression", "--seed", "3"
    )
    assert given == {
        "task": "t",
        "lr_search": [1e-3, 2e-3],
        "full": True,
        "dropout": 0.0,
        "kind": "regression",
        "seed": 3,
    }
    config = TrainConfig.from_dict(given)
    assert asdict(config) == asdict(TrainConfig(**given))  # the job API takes exactly what the CLI sends
    with pytest.raises(SystemExit):
        _parse("--task", "t", "--scales", "layernorm")  # a choice the declaration does not have
    with pytest.raises(SystemExit):
        _parse("--lr", "0.1")  # --task is required


def test_every_option_has_a_flag_on_train_and_submit(capsys):
    from patches.cli import main

    for command in ("train", "submit"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        shown = capsys.readouterr().out
        assert all(o.flag in shown for o in options()), command
