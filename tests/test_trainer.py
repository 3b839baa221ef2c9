"""train_patch on tiny seeded models: it learns, it changes only what it may, every kind runs end to end."""

from __future__ import annotations

import copy
import json

import pytest
import redis
import torch

from patches.bitfit import bias_parameters, ia3_sites, target_names
from patches.data import DataError, DataFile, load_dataset, load_splits, split_dev
from patches.format import Patch
from patches.jobs import JobError, JobLimits
from patches.model import TaskModel
from patches.packed_model import PackedTaskModel
from patches.train_config import TrainConfig, is_bio_scheme
from tests.helpers import free_port, start_redis, synthetic_rows, write_jsonl
from trainer.cli import register_commands  # noqa: F401 - the commands must import cleanly
from trainer.metrics import classification_metrics, tagging_metrics
from trainer.train import (
    JointTrainer,
    PatchTraining,
    TrainingStopped,
    evaluate,
    featurize,
    label_vectors,
    progress_logger,
    train_patch,
)


def _data(tmp_path, kind, n_train=240, n_dev=60):
    train = load_dataset(write_jsonl(tmp_path / f"{kind}-train.jsonl", synthetic_rows(kind, n_train, seed=1)))
    dev = load_dataset(
        write_jsonl(tmp_path / f"{kind}-dev.jsonl", synthetic_rows(kind, n_dev, seed=2)),
        kind=train.kind,
        labels=train.labels or None,
    )
    return train, dev


def _config(**kw) -> TrainConfig:
    base = {
        "task": "t",
        "min_steps": 60,
        "epochs": 1,
        "batch_size": 16,
        "eval_every": 20,
        "device": "cpu",
        "patience": 100,
        "lr": 1e-2,
        "pooling": "mean",
        "restarts": 1,  # one seed unless a test is about restarts (small data would get 3)
        "checkpoint": "best",  # these dev sets are tiny: by default they would keep the last checkpoint
    }
    return TrainConfig(**(base | kw))


def test_dev_accuracy_rises_on_a_learnable_task(tmp_path, tiny_encoder):
    train, dev = _data(tmp_path, "classification")
    result = train_patch(tiny_encoder, train, dev, _config(min_steps=300))
    curve = [h["dev_accuracy"] for h in result.report["history"]]
    assert curve[-1] >= 0.9 and max(curve) > curve[0] + 0.2, curve
    assert result.report["dev"]["accuracy"] == max(curve)  # best checkpoint restored
    assert result.patch is not None and result.patch.meta.metrics["dev_accuracy"] == max(curve)


@pytest.mark.parametrize("subset", ["all", "query-intermediate"])
def test_only_target_biases_and_the_head_change(tmp_path, tiny_encoder, subset):
    train, dev = _data(tmp_path, "classification", 64, 16)
    before = {n: p.detach().clone() for n, p in tiny_encoder.model.named_parameters()}
    result = train_patch(tiny_encoder, train, dev, _config(bias_subset=subset, min_steps=20))
    targets = set(target_names(tiny_encoder.model, subset))
    trained = dict(result.model.encoder.named_parameters())
    moved = {n for n, p in trained.items() if not torch.equal(p.detach().cpu(), before[n])}
    assert moved and moved <= targets, moved - targets
    # every other target must move: b_k gets no gradient (softmax ignores it), the pooler is unused by mean pooling
    unmoved = {n for n in targets - moved if ".attention.self.key." not in n and not n.startswith("pooler.")}
    assert not unmoved, unmoved
    assert all(torch.equal(p, before[n]) for n, p in tiny_encoder.model.named_parameters()), "input encoder touched"
    assert set(result.patch.biases) == targets
    assert (
        result.report["trainable_params"]
        == sum(bias_parameters(tiny_encoder.model)[n].numel() for n in targets) + result.patch.head_weight.numel() + 2
    )


@pytest.mark.parametrize(
    "kind, metric, reported",
    [
        ("pair", "accuracy", {"accuracy", "macro_f1"}),
        ("regression", "spearman", {"spearman", "pearson", "mse"}),
        ("token-classification", "token_accuracy", {"token_accuracy"}),  # ADJ/OTHER: no entities to score
        ("ner", "entity_f1", {"token_accuracy", "entity_precision", "entity_recall", "entity_f1"}),
    ],
)
def test_every_kind_trains_end_to_end(tmp_path, tiny_encoder, kind, metric, reported):
    train, dev = _data(tmp_path, kind)
    result = train_patch(tiny_encoder, train, dev, _config(min_steps=300), test=dev)
    patch = Patch.from_bytes(result.patch.data)
    expected_kind = {"pair": "classification", "ner": "token-classification"}.get(kind, kind)
    assert patch.meta.kind == expected_kind and result.report["kind"] == expected_kind
    # the kind's default selection metric chose the checkpoint, and every metric of the kind is reported
    assert result.report["metric"] == metric == patch.meta.training["metric"]
    assert set(result.report["test"]) == set(result.report["dev"]) == reported
    assert {f"dev_{m}" for m in reported} | {f"test_{m}" for m in reported} == set(patch.meta.metrics)
    assert result.report["test"][metric] > 0.8, result.report["test"]
    assert [h[f"dev_{metric}"] for h in result.report["history"]][-1] > 0.8
    # the patch alone, applied to a fresh copy of the encoder, scores what the trained model scored
    model = TaskModel.from_patch(copy.deepcopy(tiny_encoder.model), patch)
    feats = featurize(tiny_encoder.tokenizer, dev, train.labels, 128)
    # (up to rounding: the report scored the packed model)
    assert evaluate(model, feats, 0, patch.meta.labels) == pytest.approx(result.report["test"], rel=1e-5, abs=1e-6)


def test_training_is_deterministic_per_seed(tmp_path, tiny_encoder):
    train, dev = _data(tmp_path, "classification", 64, 16)
    a = train_patch(tiny_encoder, train, dev, _config(min_steps=15, seed=3))
    b = train_patch(tiny_encoder, train, dev, _config(min_steps=15, seed=3))
    c = train_patch(tiny_encoder, train, dev, _config(min_steps=15, seed=4))
    assert all(torch.equal(a.patch.biases[n], b.patch.biases[n]) for n in a.patch.biases)
    assert torch.equal(a.patch.head_weight, b.patch.head_weight)
    assert not torch.equal(a.patch.head_weight, c.patch.head_weight)


def test_a_stop_during_evaluation_leaves_the_model_in_training_mode(tmp_path, tiny_encoder):
    train, dev = _data(tmp_path, "classification", 16, 130)
    model = TaskModel(
        copy.deepcopy(tiny_encoder.model), torch.nn.Linear(tiny_encoder.hidden_size, 2), "classification", "mean"
    )
    feats = featurize(tiny_encoder.tokenizer, dev, train.labels, 128)
    asked = []

    def stop_on_second_batch() -> bool:  # the first batch has run (in eval mode) when the stop comes
        asked.append(model.training)
        return len(asked) == 2

    model.train()
    with pytest.raises(TrainingStopped):
        evaluate(model, feats, 0, train.labels, batch_size=64, should_stop=stop_on_second_batch)
    assert asked == [False, False] and model.training  # dropout is back on for the training that goes on
    model.eval()
    evaluate(model, feats, 0, train.labels)
    assert not model.training  # and a model that was in eval mode stays there


def test_restarts_and_lr_search_keep_the_best_dev_score(tmp_path, tiny_encoder):
    train, dev = _data(tmp_path, "classification", 64, 16)
    result = train_patch(tiny_encoder, train, dev, _config(min_steps=15, lr_search=[1e-4, 3e-3], restarts=2))
    runs = result.report["runs"]
    assert [(r["lr"], r["seed"]) for r in runs] == [(1e-4, 0), (1e-4, 1), (3e-3, 0), (3e-3, 1)]
    assert result.report["dev"]["accuracy"] == max(r["best_dev"]["accuracy"] for r in runs)


def test_averaged_restarts_make_one_patch_the_mean_of_the_restarts(tmp_path, tiny_encoder):
    """restarts_merge="average": a learning rate's restarts start from one head, train on their own orders, and are
    averaged (biases and head) into one patch, scored on dev; the learning rate is chosen on those averages."""
    train, dev = _data(tmp_path, "classification", 64, 16)
    config = _config(min_steps=15, lr_search=[1e-4, 3e-3], restarts=2, restarts_merge="average", checkpoint="last")
    training = PatchTraining(tiny_encoder, train, dev, config, test=dev, heldout=dev)
    trainer = JointTrainer([training])
    while len(trainer):
        assert all(error is None for _, error in trainer.step())
    trained = [[p.detach().clone() for p in run["params"]] for run in training._runs]  # each run's own parameters
    result = training.finish()
    report, patch = result.report, result.patch
    assert [(m["lr"], m["seeds"]) for m in report["merged"]] == [(1e-4, [0, 1]), (3e-3, [0, 1])]
    assert report["dev"] == max((m["dev"] for m in report["merged"]), key=lambda d: d["accuracy"])
    chosen = next(m for m in report["merged"] if m["lr"] == report["lr"])
    assert report["test"] == chosen["test"] == report["heldout"]  # test and heldout were both the dev rows here
    assert len(report["runs"]) == 4 and all("test" in r and "heldout" in r for r in report["runs"])
    first = 0 if report["lr"] == 1e-4 else 2
    a, b = trained[first], trained[first + 1]
    assert not torch.equal(a[-2], b[-2])  # the two restarts trained apart ...
    mean = [(x + y) / 2 for x, y in zip(a, b, strict=True)]
    torch.testing.assert_close(patch.head_weight, mean[-2], rtol=0, atol=1e-6)  # ... and the patch is their mean
    torch.testing.assert_close(patch.head_bias, mean[-1], rtol=0, atol=1e-6)
    names = target_names(tiny_encoder.model, "all")
    for name, value in zip(names, mean[: len(names)], strict=True):
        torch.testing.assert_close(patch.biases[name], value, rtol=0, atol=1e-6, msg=name)
    assert patch.meta.training["restarts_merge"] == "average"
    # the average's dev score is its own: re-scoring the kept model on dev gives it again
    dev_f = featurize(tiny_encoder.tokenizer, dev, train.labels, 128)
    assert evaluate(result.model, dev_f, 0, train.labels)["accuracy"] == pytest.approx(report["dev"]["accuracy"])


def test_full_fine_tuning_reports_without_a_patch(tmp_path, tiny_encoder):
    train, dev = _data(tmp_path, "classification", 64, 16)
    result = train_patch(tiny_encoder, train, dev, _config(min_steps=10, full=True))
    assert result.patch is None and result.report["mode"] == "full"
    assert result.report["trainable_params"] == result.report["total_params"]


def test_small_data_stretched_by_min_steps_evaluates_four_times_per_stretched_epoch(tmp_path, tiny_encoder):
    # 32 rows at batch 16 are 2 updates an epoch; min_steps stretches 2 epochs to 80 updates, so an epoch of the
    # run is 40 updates and dev is scored every 10 (not after every update, which let patience end the run early)
    train, dev = _data(tmp_path, "classification", 32, 16)
    result = train_patch(tiny_encoder, train, dev, _config(min_steps=80, epochs=2, eval_every=None))
    assert [h["step"] for h in result.report["history"]] == list(range(10, 81, 10))
    assert result.report["steps"] == result.report["planned_steps"] == 80
    # data large enough for its epochs keeps 4 evaluations per real epoch: 240 rows = 15 updates, every 3
    train, dev = _data(tmp_path, "classification", 240, 16)
    result = train_patch(tiny_encoder, train, dev, _config(min_steps=1, epochs=1, eval_every=None))
    assert [h["step"] for h in result.report["history"]] == [3, 6, 9, 12, 15]


def test_mode_defaults_fill_what_the_config_leaves_open():
    bitfit, full = TrainConfig(task="t").resolved(), TrainConfig(task="t", full=True).resolved()
    assert (bitfit.lr, bitfit.epochs, bitfit.patience) == (3e-3, 10.0, 40)
    assert (full.lr, full.epochs, full.patience) == (5e-5, 5.0, 6)
    mine = TrainConfig(task="t", lr=1e-3, epochs=2, patience=3).resolved()
    assert (mine.lr, mine.epochs, mine.patience) == (1e-3, 2, 3)


def test_report_shows_resolved_settings_head_lr_and_dropout(tmp_path, tiny_encoder):
    train, dev = _data(tmp_path, "classification", 64, 16)
    config = _config(min_steps=15, epochs=None, lr=None, head_lr=1e-12, dropout=0.0, seed=5, head_init="random")
    result = train_patch(tiny_encoder, train, dev, config)
    assert result.report["config"]["epochs"] == 10.0 and result.report["lr"] == 3e-3
    assert result.report["head_lr"] == 1e-12
    # the head barely moved from its initialisation (the first draw after seeding), while the biases trained
    torch.manual_seed(5)
    init = torch.nn.Linear(tiny_encoder.hidden_size, len(train.labels))
    assert torch.allclose(result.patch.head_weight, init.weight, atol=1e-6)
    before = bias_parameters(tiny_encoder.model)
    assert any(not torch.equal(b, before[n].detach().cpu()) for n, b in result.patch.biases.items())
    rates = {m.p for m in result.model.encoder.modules() if isinstance(m, torch.nn.Dropout)}
    assert rates == {0.0}
    assert {m.p for m in tiny_encoder.model.modules() if isinstance(m, torch.nn.Dropout)} != {0.0}  # input untouched


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


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "good", "label": "positive"}\n{"text": "bad"\n', ":2: not valid JSON"),
        ('{"text": "good", "label": "positive"}\n{"text": "bad"}\n', ':2: missing "label"'),
        ('{"text": "", "label": "x"}\n', ':1: missing or empty "text"'),
        ('{"tokens": ["a", "b"], "tags": ["X"]}\n', ':1: "tokens" has 2 items but "tags" has 1'),
        ("[1, 2]\n", ":1: expected a JSON object"),
        ('{"text": "a", "label": "x"}\n{"text": "b", "text_pair": "c", "label": "y"}\n', "all pairs or none"),
        ('{"text": "a", "label": "x"}\n{"text": "b", "label": "x"}\n', "at least 2 distinct labels"),
    ],
)
def test_malformed_data_names_file_line_and_problem(tmp_path, content, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(DataError) as exc:
        load_dataset(f)
    assert str(f) in str(exc.value) and message in str(exc.value)


def test_readers_csv_unicode_separators_and_inference(tmp_path):
    f = tmp_path / "d.csv"
    f.write_text('text,text_pair,label\n"a, quoted",b,1.5\nc,d,2\n')
    ds = load_dataset(f)
    assert ds.kind == "regression" and ds.is_pair and [e.label for e in ds.examples] == [1.5, 2.0]
    j = tmp_path / "u.jsonl"
    j.write_text(json.dumps({"text": "line\u2028separator", "label": 1}) + "\n" + json.dumps({"text": "x", "label": 0}))
    ds = load_dataset(j)
    assert ds.kind == "classification" and ds.labels == [0, 1] and len(ds) == 2  # JSON numbers stay numbers
    train, dev = split_dev(load_dataset(write_jsonl(tmp_path / "s.jsonl", synthetic_rows("classification", 50))))
    assert (len(train), len(dev)) == (45, 5)
    with pytest.raises(DataError, match="not among the task's labels"):
        load_dataset(f, kind="classification", labels=["x"])


def test_cli_train_eval_and_report(tmp_path, tiny_bert_dir, capsys):
    from patches.cli import main

    train = write_jsonl(tmp_path / "train.jsonl", synthetic_rows("classification", 120, seed=1))
    test = write_jsonl(tmp_path / "test.jsonl", synthetic_rows("classification", 40, seed=3))
    out, report = tmp_path / "sent.safetensors", tmp_path / "report.json"
    rc = main(
        [
            "train",
            "--task",
            "sent",
            "--train",
            str(train),
            "--test",
            str(test),
            "--model",
            str(tiny_bert_dir),
            "--min-steps",
            "200",
            "--epochs",
            "1",
            "--lr",
            "1e-2",
            "--pooling",
            "mean",
            "--out",
            str(out),
            "--report",
            str(report),
            "--device",
            "cpu",
            "--eval-every",
            "20",
            "--dropout",
            "0",
            "--head-lr",
            "5e-3",
            "--metric",
            "macro_f1",
            "--restarts",
            "1",
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    # stderr is not a terminal here: plain progress lines instead of a bar, the last one at the final step
    assert "step 200/200 loss" in captured.err and "dev accuracy" in captured.err and "macro_f1" in captured.err
    assert summary["metric"] == "macro_f1" and set(summary["test"]) == {"accuracy", "macro_f1"}
    assert summary["selection"]["restarts"] == 1 and summary["selection"]["restarts_why"] == "set: restarts=1"
    assert summary["patch"]["file"] == str(out) and out.is_file()
    full = json.loads(report.read_text())
    assert full["test"] == summary["test"] and full["history"] and "bias_movement" in full
    assert (full["config"]["dropout"], full["head_lr"], full["config"]["patience"]) == (0, 5e-3, 40)  # 40: default
    assert main(["eval", "--patch", str(out), "--data", str(test), "--model", str(tiny_bert_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"] == summary["test"]
    reg = f"disk://{tmp_path}/reg"
    rc = main(
        [
            "train",
            "--task",
            "sent",
            "--train",
            str(train),
            "--model",
            str(tiny_bert_dir),
            "--min-steps",
            "5",
            "--registry",
            reg,
            "--device",
            "cpu",
            "--restarts-merge",
            "average",
        ]
    )
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["registered"]["version"] == 1
    assert summary["selection"]["restarts"] == 3 and summary["metric"] == "accuracy"  # 108 rows: automatic restarts
    assert summary["selection"]["restarts_merge"] == "average"  # the 3 restarts averaged into the registered patch


def test_progress_is_reported_between_evaluations(tmp_path, tiny_encoder):
    """The worker's lease heartbeat rides on progress reports, so they must not wait for a dev evaluation."""
    train, dev = _data(tmp_path, "classification", 64, 16)
    calls: list[dict] = []
    train_patch(
        tiny_encoder, train, dev, _config(min_steps=30, eval_every=1000), on_progress=calls.append, progress_every_s=0.0
    )
    assert [c["step"] for c in calls] == list(range(1, 31))
    assert calls[0]["dev"] is None and calls[-1]["dev"] is not None  # the only evaluation is at the last step


def test_progress_logger_prints_prefixed_lines_off_a_terminal_and_nothing_on_one(capsys, monkeypatch):
    """Off a terminal (nohup, logs) a long run prints a plain line now and then, naming the run it belongs to where
    several runs share one log (the benchmarks); on a terminal there is the progress bar and no logger."""
    log = progress_logger(every_s=3600, prefix="trec bitfit seed=1: ")
    assert log is not None  # pytest's captured stderr is not a terminal
    report = {"step": 1, "total_steps": 3, "loss": 0.5, "dev": {"accuracy": 0.75}, "seed": 1, "lr": 0.003}
    for step in (1, 2, 3):  # the second comes within every_s of the first; the last update is always shown
        log(report | {"step": step})
    assert capsys.readouterr().err.splitlines() == [
        "trec bitfit seed=1: step 1/3 loss 0.5000 dev accuracy 0.7500 (seed=1 lr=0.003)",
        "trec bitfit seed=1: step 3/3 loss 0.5000 dev accuracy 0.7500 (seed=1 lr=0.003)",
    ]

    class Terminal:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stderr", Terminal())
    assert progress_logger() is None


def test_cli_train_checks_where_the_patch_goes_first_and_never_loses_a_trained_patch(
    tmp_path, tiny_bert_dir, capsys, monkeypatch
):
    from patches.cli import main

    monkeypatch.chdir(tmp_path)
    train = write_jsonl(tmp_path / "train.jsonl", synthetic_rows("classification", 60, seed=1))
    argv = ["train", "--task", "sent", "--train", str(train), "--model", str(tiny_bert_dir), "--device", "cpu"]
    argv += ["--min-steps", "5"]
    # an unreachable registry or a missing folder is refused before any training
    assert main([*argv, "--registry", f"redis://127.0.0.1:{free_port()}/0"]) == 1
    err = capsys.readouterr().err
    assert "unreachable" in err and "step " not in err, err
    assert main([*argv, "--report", str(tmp_path / "no" / "report.json")]) == 2
    err = capsys.readouterr().err
    assert "--report" in err and "does not exist" in err and "step " not in err
    assert not (tmp_path / "sent.safetensors").exists()

    # a registry that answers but refuses the write (a full Redis): the trained patch is saved in a file
    proc, url = start_redis(tmp_path, "--maxmemory", "1", "--maxmemory-policy", "noeviction")
    try:
        assert main([*argv, "--registry", url]) == 1
        captured = capsys.readouterr()
        assert "trained but not registered" in captured.err and "out of memory" in captured.err
        assert f"patchserve register sent.safetensors --registry {url}" in captured.err
        saved = Patch.read("sent.safetensors")
        assert json.loads(captured.out)["patch"]["patch_id"] == saved.patch_id
        # the command it suggests works once the registry takes writes again
        redis.Redis.from_url(url).config_set("maxmemory", 0)
        assert main(["register", "sent.safetensors", "--registry", url]) == 0
        assert f"registered sent v1 ({saved.patch_id})" in capsys.readouterr().out
        # --registry and --out together do both
        assert main([*argv, "--registry", url, "--out", "copy.safetensors"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["registered"]["version"] == 2
        assert summary["registered"]["patch_id"] == Patch.read("copy.safetensors").patch_id
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_small_data_restarts_automatically_and_the_report_says_why(tmp_path, tiny_encoder):
    train, dev = _data(tmp_path, "classification", 64, 16)
    result = train_patch(tiny_encoder, train, dev, _config(min_steps=15, restarts=None), test=dev)
    report = result.report
    assert [r["seed"] for r in report["runs"]] == [0, 1, 2]
    why = report["selection"]["restarts_why"]
    assert report["selection"]["restarts"] == 3 and why.startswith("automatic: 64 training rows")
    assert why.endswith("averaged into one patch") and report["selection"]["restarts_merge"] == "average"
    assert all(set(r["test"]) == {"accuracy", "macro_f1"} for r in report["runs"])  # each restart scored on test
    assert [m["seeds"] for m in report["merged"]] == [[0, 1, 2]]
    assert report["test"] == report["merged"][0]["test"] and report["dev"] == report["merged"][0]["dev"]
    assert result.patch.meta.training["restarts"] == 3 and result.patch.meta.training["restarts_merge"] == "average"
    # asked for: the best dev score is kept
    best = train_patch(tiny_encoder, train, dev, _config(min_steps=15, restarts=None, restarts_merge="best"), test=dev)
    report = best.report
    assert report["selection"]["restarts_why"].endswith("the best dev score kept") and "merged" not in report
    assert report["dev"]["accuracy"] == max(r["best_dev"]["accuracy"] for r in report["runs"])
    chosen = next(r for r in report["runs"] if r["seed"] == report["seed"])
    assert report["test"] == chosen["test"]
    # the rule itself: small data (under 1,000 rows) gets 3 seeds, averaged, more data 1, and a set value always wins
    config = TrainConfig(task="t")
    assert (config.restarts_for(999), config.restarts_for(1000), config.runs(10)) == (3, 1, 3)
    assert (config.restarts_merge_for(999), config.restarts_merge_for(1000)) == ("average", "best")
    assert TrainConfig(task="t", restarts=3).restarts_merge_for(10) == "best"  # restarts asked for: the best of them
    assert TrainConfig(task="t", restarts_merge="best").restarts_merge_for(10) == "best"
    assert TrainConfig(task="t", restarts=2, lr_search=[1e-3, 2e-3]).runs(10) == 4
    assert TrainConfig(task="t", restarts=1).restarts_for(10) == 1


def test_job_limits_count_the_automatic_restarts():
    limits = JobLimits(max_updates=1500)
    limits.check(TrainConfig(task="t"), 2000)  # 2,000 rows: 1 run of 10 epochs x 125 updates
    with pytest.raises(JobError, match=r"1800 updates \(3 run\(s\) x 600\), over"):  # 100 rows: 3 automatic restarts
        limits.check(TrainConfig(task="t"), 100)
    limits.check(TrainConfig(task="t", restarts=1), 100)


def test_a_tie_on_dev_keeps_the_later_checkpoint(tmp_path, tiny_encoder):
    # with learning rates of 1e-12 nothing moves, so every evaluation scores the same: the last one is kept
    train, dev = _data(tmp_path, "classification", 64, 16)
    result = train_patch(tiny_encoder, train, dev, _config(min_steps=60, lr=1e-12, eval_every=20))
    scores = {h["dev_accuracy"] for h in result.report["history"]}
    assert len(scores) == 1 and [h["step"] for h in result.report["history"]] == [20, 40, 60]
    assert result.report["best_step"] == 60


def test_the_selection_metric_is_settable_and_checked(tmp_path, tiny_encoder):
    train, dev = _data(tmp_path, "classification", 64, 16)
    result = train_patch(tiny_encoder, train, dev, _config(min_steps=20, metric="macro_f1"))
    assert result.report["metric"] == "macro_f1" and "dev_macro_f1" in result.report["history"][0]
    assert result.report["dev"]["macro_f1"] == max(h["dev_macro_f1"] for h in result.report["history"])
    with pytest.raises(JobError, match="does not score a classification task"):
        train_patch(tiny_encoder, train, dev, _config(metric="spearman"))
    tags, tags_dev = _data(tmp_path, "token-classification", 16, 4)
    with pytest.raises(JobError, match="needs tags in a BIO/IOB2/BIOES scheme"):
        train_patch(tiny_encoder, tags, tags_dev, _config(metric="entity_f1"))
    with pytest.raises(JobError, match="metric: Input should be .accuracy., .macro_f1."):
        TrainConfig.from_dict({"task": "t", "metric": "f1"})
    with pytest.raises(JobError, match="does not score a regression task"):
        TrainConfig.from_dict({"task": "t", "kind": "regression", "metric": "accuracy"})


def test_metric_values_match_hand_computed_ones():
    import numpy as np

    # gold 0 0 1 1 2, predicted 0 1 1 1 0: F1 per label 1/2 (P 1/2, R 1/2), 4/5 (P 2/3, R 1), 0 -> macro 13/30
    got = classification_metrics(np.array([0, 1, 1, 1, 0]), np.array([0, 0, 1, 1, 2]))
    assert got == {"accuracy": pytest.approx(3 / 5), "macro_f1": pytest.approx(13 / 30)}
    tags = ["B-PER", "I-PER", "B-LOC", "O"]
    # sentence 1: PER(0-1) found, LOC(3) missed; sentence 2: LOC(0) found, PER(2) predicted where none is
    gold = [np.array([0, 1, 3, 2]), np.array([2, 3, 3])]
    pred = [np.array([0, 1, 3, 3]), np.array([2, 3, 0])]
    got = tagging_metrics(pred, gold, tags)
    assert got["token_accuracy"] == pytest.approx(5 / 7)
    assert (got["entity_precision"], got["entity_recall"]) == (pytest.approx(2 / 3), pytest.approx(2 / 3))
    assert got["entity_f1"] == pytest.approx(2 / 3)
    # an entity whose end is wrong counts as missed, though most of its tokens are right
    cut = tagging_metrics([np.array([0, 3, 3, 2])], [np.array([0, 1, 3, 2])], tags)
    assert cut["entity_recall"] == pytest.approx(1 / 2) and cut["token_accuracy"] == pytest.approx(3 / 4)
    assert is_bio_scheme(["O", "B-X", "I-X", "E-X", "S-X"]) and not is_bio_scheme(["nn", "vb", "B-X"])
    assert (
        not is_bio_scheme(["O"])
        and TrainConfig(task="t").selection_metric("token-classification", ["nn", "vb"]) == "token_accuracy"
    )


def test_labels_keep_their_json_type(tmp_path, tiny_encoder):
    numbers = [
        {"text": r["text"], "label": int(r["label"] == "positive")} for r in synthetic_rows("classification", 64)
    ]
    train, dev = split_dev(load_dataset(write_jsonl(tmp_path / "n.jsonl", numbers)))
    assert train.labels == [0, 1]
    result = train_patch(tiny_encoder, train, dev, _config(min_steps=10))
    patch = Patch.from_bytes(result.patch.data)
    assert patch.meta.labels == [0, 1] and '"labels":[0,1]' in patch.meta.to_json()
    # more than 10 integer labels sort as numbers, strings after them
    many = [{"text": f"row {i}", "label": i % 12} for i in range(24)]
    assert load_dataset(write_jsonl(tmp_path / "m.jsonl", many)).labels == list(range(12))
    mixed = [{"text": "a", "label": "x"}, {"text": "b", "label": 2}, {"text": "c", "label": 1.0}]
    assert load_dataset(write_jsonl(tmp_path / "x.jsonl", mixed)).labels == [1, 2, "x"]
    clash = [{"text": "a", "label": 1}, {"text": "b", "label": "1"}, {"text": "c", "label": 0}]
    with pytest.raises(DataError, match="appears both as a JSON number and as a string"):
        load_dataset(write_jsonl(tmp_path / "c.jsonl", clash))
    # a patch made before labels kept their type ("0", "1") still scores a file labelled 0/1
    feats = featurize(tiny_encoder.tokenizer, load_dataset(tmp_path / "n.jsonl", labels=["0", "1"]), ["0", "1"], 64)
    assert [f.label for f in feats] == [int(r["label"]) for r in numbers]


def test_a_dev_set_too_small_to_rank_checkpoints_keeps_the_last_one(tmp_path, tiny_encoder):
    train, dev = _data(tmp_path, "classification", 64, 16)
    result = train_patch(tiny_encoder, train, dev, _config(min_steps=60, eval_every=20, checkpoint=None), test=dev)
    report, history = result.report, result.report["history"]
    assert (
        report["selection"]["checkpoint"] == "last" and "16 rows (under 100)" in report["selection"]["checkpoint_why"]
    )
    assert report["best_step"] == 60 == history[-1]["step"]
    assert report["dev"]["accuracy"] == history[-1]["dev_accuracy"] == report["test"]["accuracy"]  # dev is test here
    # the patch is the last model: it scores on dev what the last evaluation scored
    model = TaskModel.from_patch(copy.deepcopy(tiny_encoder.model), Patch.from_bytes(result.patch.data))
    feats = featurize(tiny_encoder.tokenizer, dev, train.labels, 128)
    assert evaluate(model, feats, 0, train.labels)["accuracy"] == history[-1]["dev_accuracy"]
    assert TrainConfig(task="t").checkpoint_for(99) == "last" and TrainConfig(task="t").checkpoint_for(100) == "best"
    assert TrainConfig(task="t", checkpoint="best").checkpoint_for(5) == "best"
    with pytest.raises(JobError, match="checkpoint"):
        TrainConfig.from_dict({"task": "t", "checkpoint": "first"})


def test_a_tag_only_dev_and_test_carry_joins_the_tag_set_and_counts_as_an_error(tmp_path, tiny_bert_dir, capsys):
    # Brown's part-of-speech dev and test files carry contractions (pn+bez...) that its training sentences lack:
    # the task must still train, and the tokens of such a tag count as errors, since the patch never learnt it
    from patches.cli import main

    def retag(rows: list[dict]) -> list[dict]:
        return [
            r | {"tags": ["NOUN" if t == "cat" else g for t, g in zip(r["tokens"], r["tags"], strict=True)]}
            for r in rows
        ]

    train = write_jsonl(tmp_path / "train.jsonl", synthetic_rows("token-classification", 200, seed=1))
    dev_rows, test_rows = (retag(synthetic_rows("token-classification", 60, seed=s)) for s in (2, 3))
    dev, test = write_jsonl(tmp_path / "dev.jsonl", dev_rows), write_jsonl(tmp_path / "test.jsonl", test_rows)
    splits = load_splits(*(DataFile.read(f) for f in (train, dev, test)))
    assert splits.untrained_tags == ["NOUN"]
    assert splits.train.labels == splits.dev.labels == splits.test.labels == ["ADJ", "NOUN", "OTHER"]
    with pytest.raises(DataError, match=r"labels \['NOUN'\] are not among the task's labels"):
        load_dataset(dev, labels=["ADJ", "OTHER"])  # a patch's own tag set, as `patchserve eval` reads a file

    out, report = tmp_path / "pos.safetensors", tmp_path / "report.json"
    args = ["train", "--task", "pos", "--train", str(train), "--dev", str(dev), "--test", str(test)]
    args += ["--model", str(tiny_bert_dir), "--min-steps", "300", "--out", str(out), "--report", str(report)]
    assert main([*args, "--device", "cpu"]) == 0
    assert "carry 1 tag(s) that no training sentence has (NOUN)" in capsys.readouterr().err
    assert Patch.from_bytes(out.read_bytes()).meta.labels == ["ADJ", "NOUN", "OTHER"]
    scores = json.loads(report.read_text())["test"]
    cats = sum(t == "NOUN" for r in test_rows for t in r["tags"])
    ceiling = 1 - cats / sum(len(r["tags"]) for r in test_rows)  # every NOUN token wrong, every other one right
    assert ceiling - 0.1 < scores["token_accuracy"] <= ceiling


def _serves_as_trained(tiny_bert_dir, tiny_encoder, result, dev, labels) -> None:
    """Served by the engine in one batch, the result's patch answers every dev row as the trained model does."""
    from patches.encoder import load_encoder
    from server.engine.runner import Row, Runner

    feats = featurize(tiny_encoder.tokenizer, dev, labels, 32)
    served = Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=2).run(
        [Row(f.input_ids, f.token_type_ids, result.patch) for f in feats]
    )
    result.model.eval()
    for f, out in zip(feats, served, strict=True):
        ids = torch.tensor([f.input_ids])
        with torch.no_grad():
            want = result.model(ids, torch.ones_like(ids), torch.tensor([f.token_type_ids]))[0]
        torch.testing.assert_close(out, want, rtol=0, atol=1e-5)


def test_scales_ia3_trains_every_scale_on_the_packed_model_and_the_patch_serves_as_trained(
    tmp_path, tiny_bert_dir, tiny_encoder
):
    train, dev = _data(tmp_path, "classification", 64, 16)
    before = {n: p.detach().clone() for n, p in tiny_encoder.model.named_parameters()}
    result = train_patch(tiny_encoder, train, dev, _config(scales="ia3", min_steps=20))
    patch = result.patch
    assert patch is not None and patch.meta.patch_type == "bitfit-ia3" and result.report["scales"] == "ia3"
    sites = set(ia3_sites(tiny_encoder.model))
    assert set(patch.scales) == sites and set(patch.biases) == set(target_names(tiny_encoder.model, "all"))
    assert all(not torch.equal(patch.scales[n], torch.ones_like(patch.scales[n])) for n in sites), "a scale is 1"
    assert all(torch.equal(p, before[n]) for n, p in tiny_encoder.model.named_parameters()), "input encoder touched"
    assert not any(hasattr(m, "ia3_scale") for m in tiny_encoder.model.modules()), "input encoder hooked"
    assert result.report["trainable_params"] == patch.n_params
    moved = result.report["scale_movement"]
    assert set(moved) == {"k", "v", "ff"} and set(moved["k"]) == {"0", "1"} and moved["ff"]["1"] > 0
    _serves_as_trained(tiny_bert_dir, tiny_encoder, result, dev, train.labels)
    with pytest.raises(ValueError, match=r"\(IA\)\^3 scales train on the packed model"):
        train_patch(tiny_encoder, train, dev, _config(scales="ia3", min_steps=20), packed=False)


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


def test_cli_train_takes_scales_and_inspect_shows_the_patch_type(tmp_path, tiny_bert_dir, capsys):
    from patches.cli import main

    rows = write_jsonl(tmp_path / "sent.jsonl", synthetic_rows("classification", 40, seed=1))
    out = tmp_path / "sent.safetensors"
    argv = ["train", "--task", "sent", "--model", str(tiny_bert_dir), "--device", "cpu", "--min-steps", "4"]
    assert main([*argv, "--restarts", "1", "--train", str(rows), "--scales", "ia3", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["scales"] == "ia3"
    assert main(["inspect", "--json", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["patch_type"] == "bitfit-ia3" and info["n_scale_tensors"] == 6 and info["n_bias_tensors"] == 18
    with pytest.raises(SystemExit):
        main([*argv, "--train", str(rows), "--scales", "lora", "--out", str(out)])
    assert "invalid choice: 'lora'" in capsys.readouterr().err


def _name_vector(encoder, name: str) -> torch.Tensor:
    """The encoder's mean-pooled unit vector of one text, encoded alone (no padding)."""
    enc = encoder.tokenizer(name, return_tensors="pt")
    with torch.no_grad():
        hidden = encoder.model.eval()(**enc).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden.mean(0), dim=-1)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_a_label_name_head_starts_every_run_from_the_names_and_the_patch_serves_as_trained(
    tmp_path, tiny_bert_dir, tiny_encoder, packed
):
    train, dev = _data(tmp_path, "classification", 64, 16)
    names = torch.stack([_name_vector(tiny_encoder, str(label)) for label in train.labels])
    restarts = 2 if packed else 1
    config = _config(min_steps=20, head_init="labels", restarts=restarts, restarts_merge="average")
    training = PatchTraining(tiny_encoder, train, dev, config, packed=packed)
    runs = training.group()  # before the first update
    assert runs is not None
    if packed:
        assert isinstance(runs.model, PackedTaskModel)
        starts = [(runs.model.head_weights[r], runs.model.head_biases[r]) for r in range(restarts)]
    else:
        starts = [(runs.model.head.weight, runs.model.head.bias)]
    for weight, bias in starts:
        torch.testing.assert_close(weight.detach(), names, rtol=0, atol=1e-5)
        assert torch.equal(bias.detach(), torch.zeros(len(train.labels)))
    trainer = JointTrainer([training])
    while len(trainer):
        assert all(error is None for _, error in trainer.step())
    result = training.finish()
    assert result.report["selection"]["head_init"] == "labels"
    assert result.patch is not None and result.patch.meta.training["head_init"] == "labels"
    assert not torch.allclose(result.patch.head_weight, names), "the head did not train"
    _serves_as_trained(tiny_bert_dir, tiny_encoder, result, dev, train.labels)
    plain = train_patch(tiny_encoder, train, dev, _config(min_steps=4, head_init="random"))
    assert plain.report["selection"]["head_init"] == "random" and "head_init" not in plain.patch.meta.training
    assert plain.report["selection"]["head_init_why"] == "set: head_init=random"


def test_label_name_heads_are_automatic_for_a_small_classifier_only(tmp_path, tiny_encoder):
    config = TrainConfig(task="t")
    assert config.head_init is None
    assert config.head_init_for("classification", 999) == "labels"
    assert config.head_init_for("classification", 1000) == "random"
    assert config.head_init_for("regression", 10) == config.head_init_for("token-classification", 10) == "random"
    assert TrainConfig(task="t", full=True).head_init_for("classification", 10) == "random"
    assert TrainConfig(task="t", head_init="random").head_init_for("classification", 10) == "random"
    train, dev = _data(tmp_path, "classification", 64, 16)
    small = train_patch(tiny_encoder, train, dev, _config(min_steps=4))
    assert small.report["selection"]["head_init"] == "labels" and small.report["config"]["head_init"] == "labels"
    assert small.report["selection"]["head_init_why"] == (
        "automatic: a classifier on 64 training rows (under 1000) starts from its names"
    )
    assert small.patch is not None and small.patch.meta.training["head_init"] == "labels"
    scores, scores_dev = _data(tmp_path, "regression", 32, 8)
    other = train_patch(tiny_encoder, scores, scores_dev, _config(min_steps=4))
    assert other.report["selection"]["head_init"] == "random"
    assert other.report["selection"]["head_init_why"] == (
        "automatic: a random head: label names start classifiers, not a regression head"
    )


def test_label_names_read_as_lower_case_text_with_underscores_as_spaces(tiny_encoder):
    got = label_vectors(tiny_encoder, ["Card_Arrival", "positive", 7], "mean", 128)
    want = torch.stack([_name_vector(tiny_encoder, text) for text in ("card arrival", "positive", "7")])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_label_name_head_is_refused_where_no_sentence_is_classified(tmp_path, tiny_encoder):
    with pytest.raises(JobError, match="head_init 'labels' starts a sentence classifier"):
        TrainConfig(task="t", kind="regression", head_init="labels")
    with pytest.raises(JobError, match="head_init"):
        TrainConfig.from_dict({"task": "t", "head_init": "names"})
    for kind in ("regression", "token-classification"):
        rows, rows_dev = _data(tmp_path, kind, 32, 8)
        with pytest.raises(JobError, match=f"not a {kind} head; set head_init to 'random'"):
            train_patch(tiny_encoder, rows, rows_dev, _config(head_init="labels"))


def test_a_label_name_head_on_the_real_encoder_classifies_sentiment_before_any_training(minilm):
    from patches.data import Dataset, Example

    train = Dataset(
        examples=[Example(text="a film", label=label) for label in ("negative", "positive")],
        kind="classification",
        labels=["negative", "positive"],
        source="t",
    )
    training = PatchTraining(
        minilm, train, train, TrainConfig(task="t", head_init="labels", restarts=1, device="cpu"), packed=False
    )
    runs = training.group()
    assert runs is not None and isinstance(runs.model, TaskModel)
    # matched pairs: each praise leans further to "positive" than its twin complaint (a weak zero-shot start, 64% on
    # Rotten Tomatoes' test, but one that knows which way the names point)
    pairs = [
        ("a wonderful, moving and funny film", "a dull, tedious and boring mess"),
        ("brilliant acting", "awful"),
        ("a great movie", "a terrible movie"),
        ("i loved it", "i hated it"),
    ]
    enc = minilm.tokenizer([t for pair in pairs for t in pair], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = runs.model.eval()(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    lean = (logits[:, 1] - logits[:, 0]).view(-1, 2)
    assert (lean[:, 0] > lean[:, 1]).all(), lean


def test_cli_train_takes_head_init(tmp_path, tiny_bert_dir, capsys):
    from patches.cli import main

    rows = write_jsonl(tmp_path / "sent.jsonl", synthetic_rows("classification", 40, seed=1))
    argv = ["train", "--task", "sent", "--model", str(tiny_bert_dir), "--device", "cpu", "--min-steps", "4"]
    argv += ["--restarts", "1", "--out", str(tmp_path / "sent.safetensors")]
    assert main([*argv, "--train", str(rows), "--head-init", "labels"]) == 0
    assert json.loads(capsys.readouterr().out)["selection"]["head_init"] == "labels"
    assert Patch.read(tmp_path / "sent.safetensors").meta.training["head_init"] == "labels"
    scores = write_jsonl(tmp_path / "scores.jsonl", synthetic_rows("regression", 40, seed=1))
    assert main([*argv, "--train", str(scores), "--head-init", "labels"]) == 1
    assert "set head_init to 'random'" in capsys.readouterr().err
