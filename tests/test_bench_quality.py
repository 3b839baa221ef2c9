"""bench/quality.py --joint: a set's BitFit runs trained together in one batch train as each would alone, and the
table shares a joint batch's wall time out over its runs; which recorded runs are at today's defaults; --render's
table and figure; --quick's last line."""

from __future__ import annotations

import torch

from bench.quality import (
    CPU_BFLOAT16,
    MODES,
    QUICK_UPDATES,
    _minutes,
    already_run,
    device_of,
    differences,
    is_current,
    quick_figures,
    render,
    run_record,
    settings,
    train_jointly,
    write_plot,
    write_table,
)
from patchserve.patches import packed_model
from patchserve.patches.data import DataFile, load_splits
from patchserve.patches.train_config import TrainConfig
from patchserve.trainer.train import train_patch
from tests.helpers import synthetic_rows, write_jsonl


def test_runs_trained_together_train_as_each_would_alone(tiny_encoder, tmp_path):
    """Without dropout (the one thing a shared batch draws differently) every run's biases, head and scores are what
    its own train_patch gives: a row touches only its own run's parameters."""
    files = {
        split: DataFile.read(write_jsonl(tmp_path / f"{split}.jsonl", synthetic_rows("classification", n, seed=i)))
        for i, (split, n) in enumerate((("train", 48), ("dev", 16), ("test", 16)))
    }
    splits = load_splits(files["train"], files["dev"], files["test"])
    runs = [
        (mode, seed, TrainConfig(task="t", seed=seed, device="cpu", dropout=0.0, epochs=2, min_steps=8, **MODES[mode]))  # type: ignore[arg-type]
        for mode, seed in (("bitfit", 0), ("bitfit-qi", 1), ("bitfit", 2))
    ]
    together = {
        (mode, seed): (result, seconds)
        for mode, seed, _, result, seconds in train_jointly(tiny_encoder, splits, torch.device("cpu"), runs)
    }
    assert set(together) == {("bitfit", 0), ("bitfit-qi", 1), ("bitfit", 2)}
    for mode, seed, config in runs:
        joint, seconds = together[mode, seed]
        alone = train_patch(tiny_encoder, splits.train, splits.dev, config, test=splits.test)
        assert seconds > 0 and joint.report["steps"] == alone.report["steps"] > 0
        assert joint.report["test"] == alone.report["test"] and joint.report["dev"] == alone.report["dev"]
        assert joint.patch is not None and alone.patch is not None
        assert joint.patch.biases.keys() == alone.patch.biases.keys()
        for name, value in alone.patch.biases.items():
            torch.testing.assert_close(joint.patch.biases[name], value, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(joint.patch.head_weight, alone.patch.head_weight, atol=1e-5, rtol=1e-4)
    # the seeds differ, so the runs do too (the comparison above is not between identical copies)
    a, b = together["bitfit", 0][0].patch, together["bitfit", 2][0].patch
    assert a is not None and b is not None and not torch.equal(a.head_weight, b.head_weight)


def test_min_per_run_shares_a_joint_batch_out_over_its_runs():
    assert _minutes([{"seconds": 720.0, "joint": 6}, {"seconds": 60.0}]) == "1.5"  # 2 and 1 minutes
    assert _minutes([]) == "-"


def test_runs_recorded_with_since_retired_options_off_stay_current_and_on_show_them():
    """Runs recorded while the contrastive stage and distillation existed hold them in their settings: off (0),
    they trained as today's defaults do; on, the table shows the setting."""
    today = settings(TrainConfig(task="quality"))
    then = today | {"contrastive": 0, "distill": 0.0, "distill_temperature": 2.0}  # a record from before
    run = {"set": "rotten_tomatoes", "mode": "bitfit", "train_rows": 8530, "dev_rows": 1066}
    assert is_current(run | {"settings": then}) and is_current(run | {"settings": today})
    distilled = run | {"settings": then | {"distill": 0.5}}
    assert not is_current(distilled) and differences(distilled) == "distill=0.5"  # the default temperature: unsaid
    hotter = run | {"settings": then | {"distill": 0.5, "distill_temperature": 4.0}}
    assert differences(hotter) == "distill=0.5, distill_temperature=4.0"
    staged = run | {"settings": then | {"contrastive": 8}}
    assert not is_current(staged) and differences(staged) == "contrastive=8"


def test_runs_recorded_before_lora_stay_current_and_lora_runs_show_their_settings():
    """Runs recorded before LoRA existed hold no lora_* settings: they trained as today's BitFit defaults do; a lora
    run differs by its rank, and by targets or alpha where they are not the defaults."""
    today = settings(TrainConfig(task="quality"))
    then = {k: v for k, v in today.items() if not k.startswith("lora_")}
    run = {"set": "rotten_tomatoes", "mode": "bitfit", "train_rows": 8530, "dev_rows": 1066}
    assert is_current(run | {"settings": then}) and is_current(run | {"settings": today})
    lora = run | {"settings": today | {"lora_rank": 8}}
    assert not is_current(lora) and differences(lora) == "lora_rank=8, dropout=0.2"  # LoRA's own on a whole set
    wider = run | {"settings": today | {"lora_rank": 8, "lora_targets": ["query", "key", "value"]}}
    assert differences(wider) == "lora_rank=8, lora_targets=['query', 'key', 'value'], dropout=0.2"
    assert is_current({**run, "mode": "lora", "settings": settings(TrainConfig(task="quality", lora_rank=8))})
    # BitFit runs recorded while LoRA's default targets were query and value: without a rank they act on nothing
    assert is_current(run | {"settings": today | {"lora_targets": ["query", "value"]}})
    old_lora = {**run, "mode": "lora", "settings": today | {"lora_rank": 8, "lora_targets": ["query", "value"]}}
    # recorded at BitFit's budget too, before LoRA's own 5 epochs
    expected = "lora_targets=['query', 'value'], epochs=10.0, lr=0.003"
    assert not is_current(old_lora) and differences(old_lora) == expected
    # an unset dropout is what it resolves to for the run's rows: LoRA's own on a whole set, the encoder's on 256
    # rows; the whole-set lora runs recorded before LoRA's own dropout say 0.1 in their records
    lora_today = {**run, "mode": "lora", "settings": settings(TrainConfig(task="quality", lora_rank=8))}
    assert lora_today["settings"]["dropout"] is None and is_current(lora_today)
    before = {**lora_today, "settings": lora_today["settings"] | {"dropout": 0.1}}
    assert not is_current(before) and differences(before) == "dropout=0.1"
    small = {**lora_today, "train_rows": 230, "dev_rows": 26}
    assert is_current(small) and is_current({**before, "train_rows": 230, "dev_rows": 26})


def test_a_candidate_is_paired_seed_by_seed_with_the_same_machines_runs_without_it(tmp_path):
    today = settings(TrainConfig(task="quality"))
    base = {"set": "trec", "mode": "bitfit", "metric": "accuracy", "train_rows": 4952, "dev_rows": 500}
    base |= {"seconds": 600.0, "device": "cpu"}
    runs = [
        *(base | {"seed": s, "test": t, "dev": d, "settings": today} for s, t, d in ((0, 0.96, 0.94), (1, 0.95, 0.95))),
        # seed 2 has no run without the candidate: it is left out of the pairs
        *(
            base | {"seed": s, "test": t, "dev": d, "settings": today | {"head_init": "labels"}}
            for s, t, d in ((0, 0.97, 0.95), (1, 0.94, 0.95), (2, 0.99, 0.99))
        ),
        # another machine's runs of the same candidate pair with that machine's alone (here: none)
        base | {"seed": 0, "test": 0.5, "dev": 0.5, "device": "cuda", "settings": today | {"head_init": "labels"}},
        # a CPU named in the runs pairs with its own runs only: seed 1 on "B" has no run without the candidate on "B"
        *(base | {"seed": s, "test": t, "dev": d, "cpu": "B", "settings": today} for s, t, d in ((0, 0.9, 0.9),)),
        *(
            base | {"seed": s, "test": t, "dev": d, "cpu": "B", "settings": today | {"head_init": "labels"}}
            for s, t, d in ((0, 0.93, 0.92), (1, 0.1, 0.1))
        ),
        # not a paired candidate: shown in the table, never paired
        base | {"seed": 0, "test": 0.9, "dev": 0.9, "settings": today | {"batch_size": 32}},
    ]
    path = tmp_path / "quality.md"
    write_table(runs, path, "python bench/quality.py --set head_init=labels")
    lines = [line for line in path.read_text().splitlines() if line.startswith("- trec")]
    assert lines == [
        "- trec, bitfit (cpu): head_init=labels against today's defaults, same seeds: "
        "dev +1.0 (per seed: +1.0, +2.0, +0.0); test +1.0 (per seed: +1.0, +3.0, -1.0)"
    ]


def test_a_job_that_averages_its_restarts_is_recorded_and_shown_against_its_own_restarts(tiny_encoder, tmp_path):
    files = {
        split: DataFile.read(write_jsonl(tmp_path / f"{split}.jsonl", synthetic_rows("classification", n, seed=i)))
        for i, (split, n) in enumerate((("train", 48), ("dev", 16), ("test", 16)))
    }
    splits = load_splits(files["train"], files["dev"], files["test"])
    config = TrainConfig(task="t", seed=3, device="cpu", epochs=2, min_steps=8, restarts=2, restarts_merge="average")
    # (bench/few_sample.py scores a held-out set too: its record keeps each restart's score there as well)
    result = train_patch(tiny_encoder, splits.train, splits.dev, config, test=splits.test, heldout=splits.train)
    rec = run_record("rotten_tomatoes", "bitfit", 3, config, result, splits, 60.0) | {"device": "cpu"}
    assert [r["seed"] for r in rec["restarts"]] == [3, 4] and rec["merged"][0]["seeds"] == [3, 4]
    assert all(set(r) == {"seed", "dev", "test", "heldout"} for r in rec["restarts"])
    assert rec["merged"][0]["dev"] == rec["dev"] and rec["merged"][0]["test"] == rec["test"]  # the patch kept
    assert rec["merged"][0]["heldout"] == result.report["heldout"][result.report["metric"]]
    # one run: nothing to compare
    one = TrainConfig(task="t", seed=3, device="cpu", epochs=2, min_steps=8, restarts=1, checkpoint="best")
    alone = train_patch(tiny_encoder, splits.train, splits.dev, one, test=splits.test)
    single = run_record("rotten_tomatoes", "bitfit", 3, one, alone, splits, 60.0)
    assert "restarts" not in single
    # the kept run's dev curve: one [step, score] a evaluation, ending at the run's last step, its best among them
    steps = [step for step, _ in single["curve"]]
    assert len(steps) >= 2 and steps == sorted(steps) and steps[-1] == single["steps"]
    assert max(score for _, score in single["curve"]) == round(single["dev"], 4)

    # the table pairs each job's average with its own restarts: the best by dev (a tie: the first) and the first
    def job(seed: int, dev: float, test: float, restarts: list[tuple[float, float]]) -> dict:
        alone = [{"seed": seed + i, "dev": d, "test": t} for i, (d, t) in enumerate(restarts)]
        return rec | {"seed": seed, "dev": dev, "test": test, "restarts": alone, "merged": [{"dev": dev, "test": test}]}

    path = tmp_path / "quality.md"
    write_table(
        [job(1, 0.84, 0.83, [(0.83, 0.80), (0.85, 0.82)]), job(0, 0.83, 0.82, [(0.83, 0.81), (0.83, 0.83)])],
        path,
        "cmd",
    )
    line = (
        f"- rotten_tomatoes, bitfit ({differences(rec)}, cpu): the restarts' average, same jobs, "
        "against the best restart by dev: dev -0.5 (per job: +0.0, -1.0); test +1.0 (per job: +1.0, +1.0); "
        "against the first restart alone: dev +0.5 (per job: +0.0, +1.0); test +2.0 (per job: +1.0, +3.0)"
    )
    assert line in path.read_text().splitlines()


def _quality_run(ds: str, mode: str, seed: int, test: float, device: str = "cpu", **more: object) -> dict:
    """A recorded run at today's defaults (the floor: a logreg run) on ``device`` ("cuda" adds an H100's name)."""
    run = {"set": ds, "mode": mode, "seed": seed, "metric": "accuracy", "test": test, "dev": test, "seconds": 60.0}
    run |= {"train_rows": 4952, "dev_rows": 500, "device": device.split(":")[0]}
    if device.startswith("cuda"):
        run["device_name"] = "NVIDIA H100 80GB HBM3"
    if mode != "logreg":
        run["settings"] = settings(TrainConfig(task="quality", **MODES[mode]))  # type: ignore[arg-type]
    return run | more


def test_render_rewrites_the_table_and_a_figure_with_a_panel_per_machine(tmp_path):
    runs = [_quality_run("trec", m, s, 0.9 + s / 100, "cuda:0") for m in MODES for s in (0, 1, 2)]
    runs += [_quality_run("trec", "bitfit", 0, 0.95), _quality_run("trec", "logreg", 0, 0.904)]
    candidate = _quality_run("trec", "bitfit", 0, 0.5, "cuda:0")
    candidate["settings"] = candidate["settings"] | {"lr": 0.1}  # not today's defaults: in neither panel
    write_jsonl(tmp_path / "quality-runs.jsonl", [*runs, candidate])
    (tmp_path / "quality.md").write_text("...\n\nLast command: `python bench/quality.py --sets trec`.\n")
    assert len(render(tmp_path)) == len(runs) + 1  # the candidate too
    table = (tmp_path / "quality.md").read_text()
    assert "Last command: `python bench/quality.py --sets trec`." in table  # kept: --render trained nothing
    assert "| trec | accuracy | 91.0 ± 1.0 (n=3) |" in table and "## cpu" in table
    assert (tmp_path / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    titles = write_plot(runs, tmp_path / "again.png")
    assert titles == [
        "cuda: NVIDIA H100 80GB HBM3: today's defaults, mean ± std over seeds",
        "cpu: today's defaults, mean ± std over seeds",
    ]
    assert write_plot([candidate], tmp_path / "none.png") == [] and not (tmp_path / "none.png").exists()


def test_quick_figures_name_the_scores_minutes_and_machine():
    runs = [
        _quality_run("trec", "bitfit", 0, 0.932, train_rows=1000, seconds=35.0),
        _quality_run("trec", "full", 0, 0.934, train_rows=1000, seconds=90.0),
        _quality_run("trec", "logreg", 0, 0.866, train_rows=1000, seconds=12.0),
    ]
    got = quick_figures(runs)
    assert got == {
        "set": "trec",
        "train_rows": 1000,
        "max_updates": QUICK_UPDATES,
        "bitfit": 93.2,
        "full": 93.4,
        "floor": 86.6,
        "bitfit_minus_full": -0.2,
        "minutes_bitfit": 0.58,
        "minutes_full": 1.5,
        "device": "cpu",
    }


def test_epochs_that_min_steps_overrode_do_not_set_a_small_data_run_apart():
    """At 256 rows min_steps (900 for LoRA) sets every run's length, and with its last checkpoint kept and patience
    outlasting every evaluation, epochs decided nothing: a lora draw recorded at LoRA's 5 epochs of before 2026-12-03
    trained as one at LoRA's 8 does. Where epochs did act -- a whole set, the best checkpoint chosen among evaluations
    they spaced, or an early stop they could trigger -- the run keeps its difference."""
    lora = settings(TrainConfig(task="quality", lora_rank=8))
    assert lora["epochs"] == 8.0 and lora["min_steps"] is None  # resolved by the rows: 900 on 256, 600 on a whole set
    draw = {"set": "trec", "rows": 256, "mode": "lora", "seed": 3}
    assert is_current(draw | {"settings": lora}) and is_current(draw | {"settings": lora | {"min_steps": 900}})
    assert is_current(draw | {"settings": lora | {"epochs": 5.0}})
    # 10 epochs of 900 updates evaluate 41 times, once more than the patience: an early stop they could trigger
    assert differences(draw | {"settings": lora | {"epochs": 10.0}}) == "epochs=10.0"
    best = draw | {"settings": lora | {"epochs": 5.0, "checkpoint": "best"}}
    assert differences(best) == "epochs=5.0, checkpoint=best"
    impatient = draw | {"settings": lora | {"epochs": 5.0, "patience": 6}}
    assert differences(impatient) == "epochs=5.0, patience=6"
    whole = {"set": "trec", "mode": "lora", "train_rows": 4952, "dev_rows": 500, "settings": lora | {"epochs": 10.0}}
    assert not is_current(whole) and differences(whole) == "epochs=10.0"


def test_a_lora_draw_recorded_at_600_updates_is_set_apart_on_small_data_only():
    """Runs recorded before min_steps resolved by the data say 600 in their records: a lora draw at 256 rows trains
    900 today, a lora run on a whole set and every BitFit run still 600."""
    lora, bitfit = settings(TrainConfig(task="quality", lora_rank=8)), settings(TrainConfig(task="quality"))
    draw = {"set": "rotten_tomatoes", "rows": 256, "mode": "lora", "seed": 0}
    assert differences(draw | {"settings": lora | {"min_steps": 600}}) == "min_steps=600"
    assert differences(draw | {"settings": lora | {"min_steps": 600, "epochs": 5.0}}) == "min_steps=600"
    whole = {"set": "rotten_tomatoes", "mode": "lora", "train_rows": 8530, "dev_rows": 1066}
    assert is_current(whole | {"settings": lora | {"min_steps": 600}}) and is_current(whole | {"settings": lora})
    assert is_current(draw | {"mode": "bitfit", "settings": bitfit | {"min_steps": 600}})
    assert differences(draw | {"mode": "bitfit", "settings": bitfit | {"min_steps": 900}}) == "min_steps=900"


def test_a_run_counts_as_already_run_only_in_the_arithmetic_it_would_train_in_here(tmp_path, monkeypatch):
    """A CPU that multiplies bfloat16 trains the packed model's products in bfloat16 by default: a float32 run
    recorded at the same settings (before 2026-12-01, or on a CPU without them) does not stand in for it, and the
    bfloat16 machine's runs are a table of their own."""
    today = settings(TrainConfig(task="quality"))
    full = settings(TrainConfig(task="quality", full=True))
    key = {"set": "trec", "mode": "bitfit", "seed": 0, "train_rows": 4952, "dev_rows": 500, "device": "cpu"}
    old = key | {"settings": today}  # recorded before the field: float32
    path = tmp_path / "quality-runs.jsonl"
    write_jsonl(path, [old, key | {"mode": "full", "settings": full, "precision": "float32"}])
    shape = (4952, 500, "classification")
    cpu = torch.device("cpu")
    for native in (True, False):
        monkeypatch.setattr(packed_model, "cpu_bfloat16_is_faster", lambda native=native: native)
        assert already_run(path, today, shape, cpu, set="trec", mode="bitfit", seed=0) is not native
        assert already_run(path, full, shape, cpu, set="trec", mode="full", seed=0)  # full is float32 everywhere
    new = key | {"settings": today, "precision": "bfloat16", "device_name": CPU_BFLOAT16}
    write_jsonl(path, [old, new])
    monkeypatch.setattr(packed_model, "cpu_bfloat16_is_faster", lambda: True)
    assert already_run(path, today, shape, cpu, set="trec", mode="bitfit", seed=0)
    assert (device_of(old), device_of(new)) == ("cpu", "cpu: bfloat16 products")
