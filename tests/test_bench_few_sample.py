"""bench/few_sample.py: the rows a seed draws, the table that groups runs by set, size and settings, the run
records it shares with bench/quality.py, its figure, --render and --quick's last line."""

from __future__ import annotations

import json

import pytest
import torch

from bench.baselines import BASELINES
from bench.common import cpu_name
from bench.few_sample import QUICK_MIN_STEPS, quick_figures, render, sample, write_plot, write_table
from bench.quality import already_run, changes, default_settings, differences, is_current, record_run
from patchserve.patches import packed_model
from patchserve.patches.data import load_dataset
from tests.helpers import synthetic_rows, write_jsonl


def _table(runs: list[dict], tmp_path) -> str:
    """The few-sample table of ``runs``, as ``write_table`` writes it."""
    write_table(runs, tmp_path / "t.md", "cmd")
    return (tmp_path / "t.md").read_text()


def test_a_seed_draws_the_same_rows_and_keeps_the_whole_label_set(tmp_path):
    full = load_dataset(write_jsonl(tmp_path / "train.jsonl", synthetic_rows("classification", 100, seed=1)))
    a, b, c = sample(full, 10, 0), sample(full, 10, 0), sample(full, 10, 1)
    assert len(a) == 10 and a.examples == b.examples and a.examples != c.examples
    assert a.labels == full.labels and a.kind == full.kind
    with pytest.raises(SystemExit, match="has only 100 rows"):
        sample(full, 100, 0)


def test_table_groups_runs_by_settings_and_lists_notes(tmp_path):
    today = default_settings("bitfit")
    run = {"set": "trec", "rows": 256, "mode": "bitfit", "metric": "accuracy", "planned_steps": 600, "device": "cpu"}
    seeds = [[{"seed": 0, "test": 0.9, "dev": 0.95}, {"seed": 1, "test": 0.8, "dev": 0.9}]]
    seeds += [[{"seed": 1, "test": 0.92, "dev": 0.97}, {"seed": 2, "test": 0.96, "dev": 0.9}]]
    runs = [
        run
        | {"seed": 0, "test": 0.9, "dev": 0.95, "steps": 600, "best_step": 200, "seconds": 60, "settings": today}
        | {"restarts": seeds[0], "heldout": 0.85},
        run
        | {"seed": 1, "test": 0.92, "dev": 0.97, "steps": 600, "best_step": 300, "seconds": 60, "settings": today}
        | {"restarts": seeds[1], "heldout": 0.87},
        run
        | {"seed": 0, "test": 0.8, "dev": 0.9, "steps": 150, "best_step": 30, "seconds": 30, "note": "old schedule"}
        | {"settings": today | {"eval_every": 3}},
    ]
    text = _table(runs, tmp_path)
    # first seed alone: 90 and 92; seeds' mean per run: 85 and 94
    row = "| trec | 256 | bitfit | today's defaults | 91.0 ± 1.4 | 86.0 ± 1.4 | 96.0 | 91.0 ± 1.4 | 89.5 ± 6.4 |"
    assert row + " 600 / 600 | 250 | 2 | 1.0 | cpu |" in text
    assert "| trec | 256 | bitfit | eval_every=3 | 80.0 | - | 90.0 | - | - | 150 / 600 | 30 | 1 | 0.5 | cpu |" in text
    assert "- eval_every=3: old schedule" in text
    assert "the average against" not in text  # no run averaged its restarts


def test_averaged_runs_are_compared_with_the_restart_their_dev_would_have_kept(tmp_path):
    averaged = default_settings("bitfit") | {"restarts_merge": "average"}
    run = {"set": "rotten_tomatoes", "rows": 256, "mode": "bitfit", "metric": "accuracy", "device": "cpu"}
    run |= {"seconds": 60, "settings": averaged, "steps": 600, "planned_steps": 600, "best_step": 600}
    restarts = [  # the best dev is the second restart's (a tie with the third goes to the earlier)
        {"seed": 0, "dev": 0.7, "test": 0.70, "heldout": 0.71},
        {"seed": 1, "dev": 0.8, "test": 0.72, "heldout": 0.73},
        {"seed": 2, "dev": 0.8, "test": 0.76, "heldout": 0.77},
    ]
    runs = [
        run
        | {"seed": 0, "test": 0.75, "heldout": 0.74, "dev": 0.8, "restarts": restarts}
        | {"merged": [{"seeds": [0, 1, 2], "dev": 0.8, "test": 0.75, "heldout": 0.74}]},
        run
        | {"seed": 1, "test": 0.70, "heldout": 0.75, "dev": 0.8, "restarts": restarts}
        | {"merged": [{"seeds": [1, 2, 3], "dev": 0.8, "test": 0.70, "heldout": 0.75}]},
    ]
    text = _table(runs, tmp_path)
    # on 256 rows the average is today's default (the restarts are automatic there)
    assert "| rotten_tomatoes | 256 | bitfit | today's defaults | 72.5 ± 3.5 | 74.5 ± 0.7 |" in text
    assert (
        "- rotten_tomatoes, 256 rows, bitfit (today's defaults, cpu): the average against the best restart by "
        "dev, same runs: test +0.5 (per draw: +3.0, -2.0); set's dev +1.5 (per draw: +1.0, +2.0)"
    ) in text
    best_before = default_settings("bitfit")  # a run recorded before restarts could be averaged kept the best
    del best_before["restarts_merge"]
    assert differences({"mode": "bitfit", "rows": 256, "settings": best_before}) == "restarts_merge=best"
    assert differences({"mode": "bitfit", "rows": 2560, "settings": best_before}) == "today's defaults"  # 1 run


def test_runs_recorded_before_a_setting_existed_compare_as_they_ran():
    # a quality-table run (a large set) recorded with restarts=1 and no checkpoint, metric or restarts_merge ran as
    # today's defaults do there; a 256-row run recorded the same way did not (today: 3 seeds and the last checkpoint)
    old = default_settings("bitfit") | {"restarts": 1}
    del old["checkpoint"], old["metric"], old["restarts_merge"]
    del old["head_init"]  # (a random head before label-name heads existed)
    assert is_current({"mode": "bitfit", "settings": old})
    assert differences({"mode": "bitfit", "rows": 256, "settings": old}) == (
        "head_init=random, restarts=1, checkpoint=best"
    )
    assert is_current({"mode": "bitfit", "rows": 256, "settings": default_settings("bitfit")})
    stage = default_settings("bitfit") | {"contrastive": 8}  # a since-retired option, recorded on
    assert differences({"mode": "bitfit", "rows": 256, "settings": stage}) == "contrastive=8"
    assert is_current({"mode": "bitfit", "rows": 256, "settings": default_settings("bitfit") | {"contrastive": 0}})
    # an unset head_init starts a small classifier from its label names, and nothing else
    labelled = default_settings("bitfit") | {"head_init": "labels"}
    assert is_current({"set": "trec", "mode": "bitfit", "rows": 256, "settings": labelled})
    assert differences({"set": "trec", "mode": "bitfit", "train_rows": 5000, "settings": labelled}) == (
        "head_init=labels"
    )
    assert is_current({"set": "stsb", "mode": "bitfit", "rows": 256, "settings": default_settings("bitfit")})
    assert not is_current({"set": "stsb", "mode": "bitfit", "rows": 256, "settings": labelled})
    full = default_settings("full")
    assert not is_current({"set": "trec", "mode": "full", "rows": 256, "settings": full | {"head_init": "labels"}})


def test_a_recorded_run_is_found_again_only_with_its_settings_device_and_fields(tmp_path, capsys, monkeypatch):
    # a CPU without bfloat16 products (one with them: tests/test_bench_quality.py), so float32 is the default here
    monkeypatch.setattr(packed_model, "cpu_bfloat16_is_faster", lambda: False)
    runs_file, today, cpu = tmp_path / "runs.jsonl", default_settings("bitfit"), torch.device("cpu")
    seen: list[list[dict]] = []
    small = (230, 26, "classification")  # 256 rows: training and carved dev
    assert not already_run(runs_file, today, small, cpu, set="trec", rows=256, seed=0)  # no file yet
    record_run({"set": "trec", "rows": 256, "seed": 0, "settings": today}, cpu, "shared", runs_file, seen.append)
    rec = json.loads(runs_file.read_text())
    assert rec["device"] == "cpu" and rec["note"] == "shared" and "device_name" not in rec
    assert rec["cpu"] == cpu_name() and rec["cpu"]  # the CPU it ran on: what pairs it with other runs
    assert seen == [[rec]] and json.loads(capsys.readouterr().out) == rec
    assert already_run(runs_file, today, small, cpu, set="trec", rows=256, seed=0)
    assert not already_run(runs_file, today, small, cpu, set="trec", rows=64, seed=0)
    assert not already_run(runs_file, today | {"eval_every": 3}, small, cpu, set="trec", rows=256, seed=0)
    assert not already_run(runs_file, today | {"restarts": 1}, small, cpu, set="trec", rows=256, seed=0)
    assert not already_run(runs_file, today, small, torch.device("cuda"), set="trec", rows=256, seed=0)


def test_opt_in_candidates_are_compared_with_todays_defaults_on_the_same_draws(tmp_path):
    today, stage = default_settings("bitfit"), default_settings("bitfit") | {"min_steps": 1200}
    gains, both = today | {"scales": "ia3"}, stage | {"scales": "ia3"}
    run = {"set": "trec", "rows": 256, "mode": "bitfit", "metric": "accuracy", "device": "cpu", "seconds": 60}
    runs = [
        run | {"seed": 0, "test": 0.92, "heldout": 0.88, "dev": 0.9, "settings": stage},
        run | {"seed": 1, "test": 0.90, "heldout": 0.86, "dev": 0.9, "settings": stage},
        run | {"seed": 2, "test": 0.99, "heldout": 0.99, "dev": 0.9, "settings": stage},  # no draw to pair with
        run | {"seed": 0, "test": 0.91, "heldout": 0.864, "dev": 0.9, "settings": today},
        run | {"seed": 1, "test": 0.91, "heldout": 0.87, "dev": 0.9, "settings": today},
        run | {"seed": 1, "test": 0.93, "heldout": 0.85, "dev": 0.9, "settings": gains},
        run | {"seed": 1, "test": 0.50, "heldout": 0.50, "dev": 0.9, "settings": both},  # two changes
    ]
    text = _table(runs, tmp_path)
    assert (
        "- trec, 256 rows, bitfit (cpu): scales=ia3 against today's defaults, same draws: "
        "set's dev -2.0 (per draw: -2.0); test +2.0 (per draw: +2.0)"
    ) in text
    # two changes: each is paired with the runs that have only the other
    assert (
        "- trec, 256 rows, bitfit (cpu): scales=ia3 against min_steps=1200, same draws: "
        "set's dev -36.0 (per draw: -36.0); test -40.0 (per draw: -40.0)"
    ) in text
    assert (
        "- trec, 256 rows, bitfit (cpu): min_steps=1200 against scales=ia3, same draws: "
        "set's dev -35.0 (per draw: -35.0); test -43.0 (per draw: -43.0)"
    ) in text
    assert "scales=ia3, min_steps=1200 against" not in text
    assert changes("lr_search=[0.001, 0.002], scales=ia3") == ["lr_search=[0.001, 0.002]", "scales=ia3"]
    assert changes("today's defaults") == []
    assert "| trec | 256 | bitfit | min_steps=1200 | 93.7 ± 4.7 | 91.0 ± 7.0 |" in text
    assert (
        "- trec, 256 rows, bitfit (cpu): min_steps=1200 against today's defaults, same draws: "
        "set's dev +0.3 (per draw: +1.6, -1.0); test +0.0 (per draw: +1.0, -1.0)"
    ) in text


def _draws(mode: str, tests: list[float], device: str = "cpu", **more: object) -> list[dict]:
    """One recorded run a draw at 256 rows of TREC, at today's defaults (a baseline: as it ran)."""
    runs = []
    for seed, test in enumerate(tests):
        run = {"set": "trec", "rows": 256, "mode": mode, "seed": seed, "metric": "accuracy", "test": test}
        run |= {"dev": 0.9, "seconds": 60.0, "device": device}
        if device == "cuda":
            run["device_name"] = "NVIDIA H200"
        if mode not in BASELINES:
            run |= {"settings": default_settings(mode), "heldout": test - 0.04}
        runs.append(run | more)
    return runs


def test_the_figure_shows_each_mode_on_each_machine_with_its_draws(tmp_path):
    runs = _draws("bitfit", [0.91, 0.93]) + _draws("bitfit", [0.9, 0.92, 0.94], "cuda")
    runs += _draws("setfit", [0.95], "cuda") + _draws("logreg", [0.75, 0.77])
    candidate = _draws("bitfit", [0.5])[0]
    candidate["settings"] = candidate["settings"] | {"lr": 0.1}  # not today's defaults: not a bar
    labels = write_plot([*runs, candidate], tmp_path / "f.png")
    assert labels == [
        "floor\ncpu\n2 draws",
        "BitFit\ncpu\n2 draws",
        "BitFit\nH200\n3 draws",
        "SetFit\nH200\n1 draw",
    ]
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_plot([candidate], tmp_path / "none.png") == [] and not (tmp_path / "none.png").exists()


def test_render_keeps_the_last_command_and_quick_figures_sum_up_a_quick_run(tmp_path):
    runs = _draws("bitfit", [0.904], min_steps=200) + _draws("logreg", [0.798])
    write_jsonl(tmp_path / "few-sample-runs.jsonl", runs)
    (tmp_path / "few-sample.md").write_text("Last command: `python bench/few_sample.py --sets trec`.\n")
    assert render(tmp_path) == runs
    assert "Last command: `python bench/few_sample.py --sets trec`." in (tmp_path / "few-sample.md").read_text()
    assert (tmp_path / "few-sample.png").is_file()
    assert quick_figures(runs) == {
        "set": "trec",
        "rows": 256,
        "min_steps": QUICK_MIN_STEPS,
        "bitfit": 90.4,
        "bitfit_set_dev": 86.4,
        "floor": 79.8,
        "bitfit_minus_floor": 10.6,
        "minutes_bitfit": 1.0,
        "device": "cpu",
    }
