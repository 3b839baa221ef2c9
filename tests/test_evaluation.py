"""Scoring: the metrics against hand-computed values, evaluation's modes, and label-name vectors."""

from __future__ import annotations

import copy

import pytest
import torch

from patchserve.patches.model import TaskModel
from patchserve.patches.train_config import TrainConfig, is_bio_scheme
from patchserve.trainer.evaluation import evaluate, label_vectors
from patchserve.trainer.features import featurize
from patchserve.trainer.metrics import classification_metrics, tagging_metrics
from patchserve.trainer.models import PaddedRun
from patchserve.trainer.progress import TrainingStopped
from patchserve.trainer.train import PatchTraining
from tests.helpers import name_vector, training_data


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


def test_a_stop_during_evaluation_leaves_the_model_in_training_mode(tmp_path, tiny_encoder):
    train, dev = training_data(tmp_path, "classification", 16, 130)
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


def test_label_names_read_as_lower_case_text_with_underscores_as_spaces(tiny_encoder):
    got = label_vectors(tiny_encoder, ["Card_Arrival", "positive", 7], "mean", 128)
    want = torch.stack([name_vector(tiny_encoder, text) for text in ("card arrival", "positive", "7")])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_label_name_head_on_the_real_encoder_classifies_sentiment_before_any_training(minilm):
    from patchserve.patches.data import Dataset, Example

    train = Dataset(
        examples=[Example(text="a film", label=label) for label in ("negative", "positive")],
        kind="classification",
        labels=["negative", "positive"],
        source="t",
    )
    training = PatchTraining(
        minilm, train, train, TrainConfig(task="t", head_init="labels", restarts=1, device="cpu"), packed=False
    )
    runs = training.run_group()
    assert runs is not None and isinstance(runs.model, PaddedRun)
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
        logits = runs.model.eval().model(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    lean = (logits[:, 1] - logits[:, 0]).view(-1, 2)
    assert (lean[:, 0] > lean[:, 1]).all(), lean
