"""The training options: declared once (TrainConfig), read by the CLI, the job API and the docs alike."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import get_args

import pytest

from patchserve.patches.bitfit import BIAS_SUBSETS
from patchserve.patches.format import KINDS, POOLINGS
from patchserve.patches.jobs import JobError, JobLimits
from patchserve.patches.train_config import (
    LORA_DROPOUT,
    LORA_SMALL_DATA_MIN_STEPS,
    MIN_STEPS,
    SELECTION_METRICS,
    SMALL_DATA_ROWS,
    BiasSubset,
    Kind,
    Metric,
    Pooling,
    TrainConfig,
    options,
)
from patchserve.trainer.cli import add_training_options, config_from_args
from patchserve.trainer.selection import plan


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
    assert by_name["min_steps"].schema["anyOf"][0]["maximum"] == 10_000_000  # the bounds the docs' table shows


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
    from patchserve.__main__ import main

    for command in ("train", "submit"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        shown = capsys.readouterr().out
        assert all(o.flag in shown for o in options()), command


def test_mode_defaults_fill_what_the_config_leaves_open():
    bitfit, full = TrainConfig(task="t").resolved(), TrainConfig(task="t", full=True).resolved()
    assert (bitfit.lr, bitfit.epochs, bitfit.patience) == (3e-3, 10.0, 40)
    assert (full.lr, full.epochs, full.patience) == (5e-5, 5.0, 6)
    mine = TrainConfig(task="t", lr=1e-3, epochs=2, patience=3).resolved()
    assert (mine.lr, mine.epochs, mine.patience) == (1e-3, 2, 3)
    lora = TrainConfig(task="t", lora_rank=8).resolved()  # fewer epochs than BitFit at LoRA's rate, every linear layer
    assert (lora.lr, lora.epochs, lora.patience) == (1e-3, 8.0, 40) and len(lora.lora_targets) == 6
    assert TrainConfig(task="t", lora_rank=8, lr=3e-3).resolved().lr == 3e-3


def test_lora_trains_at_twice_the_encoders_dropout_from_a_thousand_rows():
    lora, bitfit = TrainConfig(task="t", lora_rank=8), TrainConfig(task="t")
    assert lora.dropout_for(SMALL_DATA_ROWS) == LORA_DROPOUT == 0.2 and lora.dropout_for(SMALL_DATA_ROWS - 1) is None
    assert bitfit.dropout_for(10_000) is None and TrainConfig(task="t", full=True).dropout_for(10_000) is None
    assert TrainConfig(task="t", lora_rank=8, dropout=0.0).dropout_for(10_000) == 0.0  # as set
    assert plan(lora, "classification", 5000, 500).config.dropout == 0.2
    assert plan(lora, "classification", 256, 26).config.dropout is None  # the encoder's own


def test_lora_trains_longer_on_small_data_and_every_run_counts_it():
    lora, bitfit = TrainConfig(task="t", lora_rank=8), TrainConfig(task="t")
    assert (LORA_SMALL_DATA_MIN_STEPS, MIN_STEPS) == (900, 600)
    assert lora.min_steps_for(SMALL_DATA_ROWS - 1) == 900 and lora.min_steps_for(SMALL_DATA_ROWS) == 600
    assert bitfit.min_steps_for(230) == 600 and TrainConfig(task="t", full=True).min_steps_for(230) == 600
    assert TrainConfig(task="t", lora_rank=8, min_steps=300).min_steps_for(230) == 300  # as set
    assert lora.planned_steps(230) == 900 and bitfit.planned_steps(230) == 600 and lora.planned_steps(1000) == 600
    assert lora.eval_every_for(230) == 28  # 4 evaluations per stretched epoch: 900 updates / 8 epochs / 4
    small, whole = plan(lora, "classification", 230, 26).config, plan(lora, "classification", 5000, 500).config
    assert (small.min_steps, small.planned_steps(230), whole.min_steps) == (900, 900, 600)
    with pytest.raises(JobError, match=r"2700 updates \(3 run\(s\) x 900\), over"):  # the cap counts the 900
        JobLimits(max_updates=2000).check(lora, 230)


def test_bad_configs_are_refused():
    for bad in (
        {"task": "../x"},
        {"task": "t", "bias_subset": "keys"},
        {"task": "t", "lr": -1.0},
        {"task": "t", "epochs": 0},
        {"task": "t", "dropout": 1.0},
        {"task": "t", "head_lr": 0.0},
        {"task": "t", "patience": 0},
    ):
        with pytest.raises(Exception):  # noqa: B017 - InvalidTaskNameError or JobError, each with a message
            TrainConfig.from_dict(bad)
    with pytest.raises(JobError, match="unknown fields"):
        TrainConfig.from_dict({"task": "t", "learning_rate": 1e-3})


def test_job_limits_count_the_automatic_restarts():
    limits = JobLimits(max_updates=1500)
    limits.check(TrainConfig(task="t"), 2000)  # 2,000 rows: 1 run of 10 epochs x 125 updates
    with pytest.raises(JobError, match=r"1800 updates \(3 run\(s\) x 600\), over"):  # 100 rows: 3 automatic restarts
        limits.check(TrainConfig(task="t"), 100)
    limits.check(TrainConfig(task="t", restarts=1), 100)


def test_scales_are_checked_and_refused_with_full_fine_tuning():
    assert TrainConfig(task="t").scales == "none"
    with pytest.raises(JobError, match="drop scales or full"):
        TrainConfig.from_dict({"task": "t", "scales": "ia3", "full": True})
    with pytest.raises(JobError, match="scales"):
        TrainConfig.from_dict({"task": "t", "scales": "lora"})


def test_retired_options_are_dropped_when_off_and_refused_otherwise():
    """A job an earlier release queued holds every option it knew: the contrastive stage and distillation (since
    removed) at their "off" values train as before; asked for, they are refused with the reason."""
    queued = {"task": "t", "contrastive": 0, "distill": 0.0, "distill_temperature": 2.0}
    assert TrainConfig.from_dict(queued) == TrainConfig(task="t")
    for retired in ({"contrastive": 8}, {"distill": 0.5}):
        with pytest.raises(JobError, match=rf"{next(iter(retired))} was removed .*docs/experiments.md"):
            TrainConfig.from_dict({"task": "t"} | retired)
    with pytest.raises(JobError, match=r"scales 'layernorm' .* was removed .*use 'none' or 'ia3'"):
        TrainConfig.from_dict({"task": "t", "scales": "layernorm"})
