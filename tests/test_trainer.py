"""train_patch on tiny seeded models: it learns, it changes only what it may, every kind runs end to end."""

from __future__ import annotations

import copy

import pytest
import torch

from patchserve.patches.bitfit import bias_parameters, ia3_sites, target_names
from patchserve.patches.data import DataError, load_dataset, split_dev
from patchserve.patches.errors import EncoderError
from patchserve.patches.format import Patch
from patchserve.patches.jobs import JobError
from patchserve.patches.model import TaskModel
from patchserve.patches.train_config import TrainConfig
from patchserve.trainer.cli import register_commands  # noqa: F401 - the commands must import cleanly
from patchserve.trainer.evaluation import evaluate
from patchserve.trainer.features import featurize
from patchserve.trainer.joint import JointTrainer
from patchserve.trainer.models import PackedRuns, PaddedRun
from patchserve.trainer.train import PatchTraining, train_patch
from tests.helpers import name_vector, synthetic_rows, train_config, training_data, write_jsonl


def test_dev_accuracy_rises_on_a_learnable_task(tmp_path, tiny_encoder):
    train, dev = training_data(tmp_path, "classification")
    result = train_patch(tiny_encoder, train, dev, train_config(min_steps=300))
    curve = [h["dev_accuracy"] for h in result.report["history"]]
    assert curve[-1] >= 0.9 and max(curve) > curve[0] + 0.2, curve
    assert result.report["dev"]["accuracy"] == max(curve)  # best checkpoint restored
    assert result.patch is not None and result.patch.meta.metrics["dev_accuracy"] == max(curve)


@pytest.mark.parametrize("subset", ["all", "query-intermediate"])
def test_only_target_biases_and_the_head_change(tmp_path, tiny_encoder, subset):
    train, dev = training_data(tmp_path, "classification", 64, 16)
    before = {n: p.detach().clone() for n, p in tiny_encoder.model.named_parameters()}
    result = train_patch(tiny_encoder, train, dev, train_config(bias_subset=subset, min_steps=20))
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
    train, dev = training_data(tmp_path, kind)
    result = train_patch(tiny_encoder, train, dev, train_config(min_steps=300), test=dev)
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
    # (up to rounding: the report scored the packed model, whose products are bfloat16 on a CPU that has them)
    rel = 1e-5 if result.report["precision"] == "float32" else 1e-3
    assert evaluate(model, feats, 0, patch.meta.labels) == pytest.approx(result.report["test"], rel=rel, abs=1e-6)


def test_training_is_deterministic_per_seed(tmp_path, tiny_encoder):
    train, dev = training_data(tmp_path, "classification", 64, 16)
    a = train_patch(tiny_encoder, train, dev, train_config(min_steps=15, seed=3))
    b = train_patch(tiny_encoder, train, dev, train_config(min_steps=15, seed=3))
    c = train_patch(tiny_encoder, train, dev, train_config(min_steps=15, seed=4))
    assert all(torch.equal(a.patch.biases[n], b.patch.biases[n]) for n in a.patch.biases)
    assert torch.equal(a.patch.head_weight, b.patch.head_weight)
    assert not torch.equal(a.patch.head_weight, c.patch.head_weight)


def test_restarts_and_lr_search_keep_the_best_dev_score(tmp_path, tiny_encoder):
    train, dev = training_data(tmp_path, "classification", 64, 16)
    result = train_patch(tiny_encoder, train, dev, train_config(min_steps=15, lr_search=[1e-4, 3e-3], restarts=2))
    runs = result.report["runs"]
    assert [(r["lr"], r["seed"]) for r in runs] == [(1e-4, 0), (1e-4, 1), (3e-3, 0), (3e-3, 1)]
    assert result.report["dev"]["accuracy"] == max(r["best_dev"]["accuracy"] for r in runs)


def test_averaged_restarts_make_one_patch_the_mean_of_the_restarts(tmp_path, tiny_encoder):
    """restarts_merge="average": a learning rate's restarts start from one head, train on their own orders, and are
    averaged (biases and head) into one patch, scored on dev; the learning rate is chosen on those averages."""
    train, dev = training_data(tmp_path, "classification", 64, 16)
    config = train_config(min_steps=15, lr_search=[1e-4, 3e-3], restarts=2, restarts_merge="average", checkpoint="last")
    training = PatchTraining(tiny_encoder, train, dev, config, test=dev, heldout=dev)
    trainer = JointTrainer([training])
    while len(trainer):
        assert all(error is None for _, error in trainer.step())
    trained = [[p.detach().clone() for p in run["params"]] for _, run in training._trained]  # each run's own
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
    biases = torch.cat([patch.biases[name] for name in target_names(tiny_encoder.model, "all")])
    torch.testing.assert_close(biases, mean[0], rtol=0, atol=1e-6)  # the packed runs' flat bank rows, averaged
    assert patch.meta.training["restarts_merge"] == "average"
    # the average's dev score is its own: re-scoring the kept model on dev gives it again
    dev_f = featurize(tiny_encoder.tokenizer, dev, train.labels, 128)
    assert evaluate(result.model, dev_f, 0, train.labels)["accuracy"] == pytest.approx(report["dev"]["accuracy"])


def test_full_fine_tuning_reports_without_a_patch(tmp_path, tiny_encoder):
    train, dev = training_data(tmp_path, "classification", 64, 16)
    result = train_patch(tiny_encoder, train, dev, train_config(min_steps=10, full=True))
    assert result.patch is None and result.report["mode"] == "full"
    assert result.report["trainable_params"] == result.report["total_params"]


def test_small_data_stretched_by_min_steps_evaluates_four_times_per_stretched_epoch(tmp_path, tiny_encoder):
    # 32 rows at batch 16 are 2 updates an epoch; min_steps stretches 2 epochs to 80 updates, so an epoch of the
    # run is 40 updates and dev is scored every 10 (not after every update, which let patience end the run early)
    train, dev = training_data(tmp_path, "classification", 32, 16)
    result = train_patch(tiny_encoder, train, dev, train_config(min_steps=80, epochs=2, eval_every=None))
    assert [h["step"] for h in result.report["history"]] == list(range(10, 81, 10))
    assert result.report["steps"] == result.report["planned_steps"] == 80
    # data large enough for its epochs keeps 4 evaluations per real epoch: 240 rows = 15 updates, every 3
    train, dev = training_data(tmp_path, "classification", 240, 16)
    result = train_patch(tiny_encoder, train, dev, train_config(min_steps=1, epochs=1, eval_every=None))
    assert [h["step"] for h in result.report["history"]] == [3, 6, 9, 12, 15]


def test_report_shows_resolved_settings_head_lr_and_dropout(tmp_path, tiny_encoder):
    train, dev = training_data(tmp_path, "classification", 64, 16)
    config = train_config(min_steps=15, epochs=None, lr=None, head_lr=1e-12, dropout=0.0, seed=5, head_init="random")
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


def test_progress_is_reported_between_evaluations(tmp_path, tiny_encoder):
    """The worker's lease heartbeat rides on progress reports, so they must not wait for a dev evaluation."""
    train, dev = training_data(tmp_path, "classification", 64, 16)
    calls: list[dict] = []
    train_patch(
        tiny_encoder,
        train,
        dev,
        train_config(min_steps=30, eval_every=1000),
        on_progress=calls.append,
        progress_every_s=0.0,
    )
    assert [c["step"] for c in calls] == list(range(1, 31))
    assert calls[0]["dev"] is None and calls[-1]["dev"] is not None  # the only evaluation is at the last step


def test_small_data_restarts_automatically_and_the_report_says_why(tmp_path, tiny_encoder):
    train, dev = training_data(tmp_path, "classification", 64, 16)
    result = train_patch(tiny_encoder, train, dev, train_config(min_steps=15, restarts=None), test=dev)
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
    best = train_patch(
        tiny_encoder, train, dev, train_config(min_steps=15, restarts=None, restarts_merge="best"), test=dev
    )
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


def test_a_tie_on_dev_keeps_the_later_checkpoint(tmp_path, tiny_encoder):
    # with learning rates of 1e-12 nothing moves, so every evaluation scores the same: the last one is kept
    train, dev = training_data(tmp_path, "classification", 64, 16)
    result = train_patch(tiny_encoder, train, dev, train_config(min_steps=60, lr=1e-12, eval_every=20))
    scores = {h["dev_accuracy"] for h in result.report["history"]}
    assert len(scores) == 1 and [h["step"] for h in result.report["history"]] == [20, 40, 60]
    assert result.report["best_step"] == 60


def test_the_selection_metric_is_settable_and_checked(tmp_path, tiny_encoder):
    train, dev = training_data(tmp_path, "classification", 64, 16)
    result = train_patch(tiny_encoder, train, dev, train_config(min_steps=20, metric="macro_f1"))
    assert result.report["metric"] == "macro_f1" and "dev_macro_f1" in result.report["history"][0]
    assert result.report["dev"]["macro_f1"] == max(h["dev_macro_f1"] for h in result.report["history"])
    with pytest.raises(JobError, match="does not score a classification task"):
        train_patch(tiny_encoder, train, dev, train_config(metric="spearman"))
    tags, tags_dev = training_data(tmp_path, "token-classification", 16, 4)
    with pytest.raises(JobError, match="needs tags in a BIO/IOB2/BIOES scheme"):
        train_patch(tiny_encoder, tags, tags_dev, train_config(metric="entity_f1"))
    with pytest.raises(JobError, match=r"metric: Input should be 'accuracy', 'macro_f1'"):
        TrainConfig.from_dict({"task": "t", "metric": "f1"})
    with pytest.raises(JobError, match="does not score a regression task"):
        TrainConfig.from_dict({"task": "t", "kind": "regression", "metric": "accuracy"})


def test_labels_keep_their_json_type(tmp_path, tiny_encoder):
    numbers = [
        {"text": r["text"], "label": int(r["label"] == "positive")} for r in synthetic_rows("classification", 64)
    ]
    train, dev = split_dev(load_dataset(write_jsonl(tmp_path / "n.jsonl", numbers)))
    assert train.labels == [0, 1]
    result = train_patch(tiny_encoder, train, dev, train_config(min_steps=10))
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
    train, dev = training_data(tmp_path, "classification", 64, 16)
    result = train_patch(tiny_encoder, train, dev, train_config(min_steps=60, eval_every=20, checkpoint=None), test=dev)
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


def _serves_as_trained(tiny_bert_dir, tiny_encoder, result, dev, labels) -> None:
    """Served by the engine in one batch, the result's patch answers every dev row as the trained model does."""
    from patchserve.patches.encoder import load_encoder
    from patchserve.server.engine.protocol import Row
    from patchserve.server.engine.runner import Runner

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
    train, dev = training_data(tmp_path, "classification", 64, 16)
    before = {n: p.detach().clone() for n, p in tiny_encoder.model.named_parameters()}
    result = train_patch(tiny_encoder, train, dev, train_config(scales="ia3", min_steps=20))
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
    with pytest.raises(EncoderError, match=r"\(IA\)\^3 scales train on the packed model"):
        train_patch(tiny_encoder, train, dev, train_config(scales="ia3", min_steps=20), packed=False)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_a_label_name_head_starts_every_run_from_the_names_and_the_patch_serves_as_trained(
    tmp_path, tiny_bert_dir, tiny_encoder, packed
):
    train, dev = training_data(tmp_path, "classification", 64, 16)
    names = torch.stack([name_vector(tiny_encoder, str(label)) for label in train.labels])
    restarts = 2 if packed else 1
    config = train_config(min_steps=20, head_init="labels", restarts=restarts, restarts_merge="average")
    training = PatchTraining(tiny_encoder, train, dev, config, packed=packed)
    runs = training.run_group()  # before the first update
    assert runs is not None
    assert isinstance(runs.model, PackedRuns if packed else PaddedRun)
    starts = [runs.model.parameters_of(r)[-2:] for r in range(restarts)]  # each run's head: weight and bias
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
    plain = train_patch(tiny_encoder, train, dev, train_config(min_steps=4, head_init="random"))
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
    train, dev = training_data(tmp_path, "classification", 64, 16)
    small = train_patch(tiny_encoder, train, dev, train_config(min_steps=4))
    assert small.report["selection"]["head_init"] == "labels" and small.report["config"]["head_init"] == "labels"
    assert small.report["selection"]["head_init_why"] == (
        "automatic: a classifier on 64 training rows (under 1000) starts from its names"
    )
    assert small.patch is not None and small.patch.meta.training["head_init"] == "labels"
    scores, scores_dev = training_data(tmp_path, "regression", 32, 8)
    other = train_patch(tiny_encoder, scores, scores_dev, train_config(min_steps=4))
    assert other.report["selection"]["head_init"] == "random"
    assert other.report["selection"]["head_init_why"] == (
        "automatic: a random head: label names start classifiers, not a regression head"
    )


def test_a_label_name_head_is_refused_where_no_sentence_is_classified(tmp_path, tiny_encoder):
    with pytest.raises(JobError, match="head_init 'labels' starts a sentence classifier"):
        TrainConfig(task="t", kind="regression", head_init="labels")
    with pytest.raises(JobError, match="head_init"):
        TrainConfig.from_dict({"task": "t", "head_init": "names"})
    for kind in ("regression", "token-classification"):
        rows, rows_dev = training_data(tmp_path, kind, 32, 8)
        with pytest.raises(JobError, match=f"not a {kind} head; set head_init to 'random'"):
            train_patch(tiny_encoder, rows, rows_dev, train_config(head_init="labels"))
