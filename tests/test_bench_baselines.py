"""bench/baselines.py: the frozen-encoder floor and SetFit (the real library from PyPI), run as the benchmarks run
them, on the real packaged encoder where the score must mean something."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from bench.baselines import C_GRID, embed, logreg, setfit, word_vectors
from bench.few_sample import run_baseline, write_table
from bench.quality import default_settings, differences, is_current
from bench.quality import write_table as write_quality_table
from patchserve.patches.data import Dataset, Example
from patchserve.patches.encoder import default_encoder_path

CPU = torch.device("cpu")


def topic_rows() -> tuple[Dataset, Dataset]:
    """Animals against money: 8 + 8 training sentences, 4 + 4 test sentences no training sentence repeats. Any
    sentence encoder separates them; a baseline that mixed up its labels would score near 0."""
    animals = ["cat", "dog", "horse", "rabbit", "parrot", "goat"]
    firms = ["the bank", "the insurer", "the fund", "the broker", "the lender", "the exchange"]
    pets = [f"The {a} {v} in the garden." for a, v in itertools.product(animals, ["slept", "played"])]
    money = [f"Shares of {f} {v} after the earnings report." for f, v in itertools.product(firms, ["fell", "rose"])]

    def ds(rows: list[tuple[str, str]], source: str) -> Dataset:
        examples = [Example(text=t, label=label) for t, label in rows]
        return Dataset("classification", examples, source, labels=["animals", "money"])

    train = [(t, "animals") for t in pets[:8]] + [(t, "money") for t in money[:8]]
    test = [(t, "animals") for t in pets[8:]] + [(t, "money") for t in money[8:]]
    return ds(train, "train"), ds(test, "test")


def test_vectors_are_unit_length_and_do_not_depend_on_the_batch(tiny_encoder):
    texts = ["the good movie", "a very very long and dull plot about a cat", "dog"]
    together = embed(tiny_encoder, texts, CPU)
    alone = np.concatenate([embed(tiny_encoder, [t], CPU) for t in texts])
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(together, alone, atol=1e-5)  # padding in a batch changes nothing


def test_a_pair_regression_floor_is_the_spearman_of_the_vectors_cosine(tiny_encoder):
    # labels that are exactly the frozen vectors' cosine rank perfectly; their reverse ranks perfectly backwards
    pairs = [("the good movie", "a dull plot"), ("cat", "dog"), ("the film", "the movie"), ("a plot", "very good")]
    pairs += [("the actor runs", "the city"), ("dog and cat", "cat and dog")]
    a, b = (embed(tiny_encoder, [p[i] for p in pairs], CPU) for i in (0, 1))
    cosine = (a * b).sum(1)

    def ds(labels: np.ndarray) -> Dataset:
        rows = [Example(text=x, text_pair=y, label=float(v)) for (x, y), v in zip(pairs, labels, strict=True)]
        return Dataset("regression", rows, "pairs")

    result = logreg(tiny_encoder, ds(cosine), ds(cosine), ds(-cosine), CPU)
    assert result.dev is not None and abs(result.dev - 1.0) < 1e-6
    assert abs(result.test + 1.0) < 1e-6


def test_the_floor_picks_c_on_dev_and_scores_test_on_the_real_encoder(minilm):
    train, test = topic_rows()
    result = logreg(minilm, train, test, test, CPU)
    assert result.settings["C"] in C_GRID and "scikit-learn" in result.settings
    assert result.dev is not None and result.dev >= 0.9 and result.test >= 0.9


def tag_rows() -> tuple[Dataset, Dataset]:
    """Words tagged by what they name: animals ``a``, firms ``f``, the rest ``o``; the test sentences use other
    animals and firms than training. Frozen sentence-encoder word vectors tell them apart."""
    animals = ["cat", "dog", "horse", "rabbit", "parrot", "goat", "sheep", "donkey"]
    firms = ["bank", "insurer", "fund", "broker", "lender", "exchange", "brokerage", "trust"]

    def ds(names: list[tuple[str, str]], source: str) -> Dataset:
        examples = [
            Example(tokens=["the", a, "saw", "the", f, "today"], tags=["o", "a", "o", "o", "f", "o"]) for a, f in names
        ]
        return Dataset("token-classification", examples, source, labels=["a", "f", "o"])

    pairs = list(zip(animals, firms, strict=True))
    return ds(pairs[:6], "train"), ds(pairs[6:], "test")


def test_word_vectors_are_each_words_first_subword_as_the_trainer_tags_it(tiny_encoder):
    train, _ = tag_rows()
    x, y = word_vectors(tiny_encoder, train, train.labels, CPU)
    assert x.shape == (36, tiny_encoder.hidden_size) and list(y[:6]) == [2, 0, 2, 2, 1, 2]  # 6 sentences of 6 words
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    enc = tiny_encoder.tokenizer([train.examples[0].tokens], is_split_into_words=True, return_tensors="pt")
    firsts = [enc.word_ids(0).index(w) for w in range(6)]  # each word's first subword
    with torch.inference_mode():
        hidden = tiny_encoder.model(**enc).last_hidden_state[0, firsts]
    np.testing.assert_allclose(x[:6], torch.nn.functional.normalize(hidden, dim=-1).numpy(), atol=1e-5)


def test_the_tagging_floor_classifies_words_on_the_real_encoder(minilm):
    train, test = tag_rows()
    result = logreg(minilm, train, test, test, CPU)
    assert result.settings["C"] in C_GRID
    assert result.dev is not None and result.test >= 0.9  # token accuracy over the test sentences' 12 words


def test_setfit_trains_the_real_body_with_its_defaults_and_scores_test(minilm):
    train, test = topic_rows()
    result = setfit(str(default_encoder_path()), train, test, seed=0, device=CPU)
    assert result.dev is None  # SetFit has no dev split: it trains on every row
    assert result.test >= 0.9
    assert set(result.settings) == {"setfit", "sentence-transformers"}


def test_a_few_sample_floor_fits_the_train_part_of_the_draw_and_picks_c_on_its_dev_part(minilm):
    train, test = topic_rows()
    result = run_baseline("logreg", minilm, train, test, seed=0, device=CPU)
    # 16 rows: the trainer's carve leaves 2 for dev, so dev accuracy is one of 0, 1/2, 1
    assert result.dev in (0.0, 0.5, 1.0) and result.test >= 0.9


def test_baseline_runs_count_as_current_and_show_what_they_are_in_the_few_sample_table(tmp_path):
    run = {"set": "trec", "rows": 256, "metric": "accuracy", "device": "cpu"}
    runs = [
        run | {"mode": "setfit", "seed": s, "test": t, "dev": None, "settings": {"setfit": "1.2.0"}, "seconds": 600}
        for s, t in ((0, 0.9), (1, 0.8))
    ]
    runs.append(run | {"mode": "logreg", "seed": 0, "test": 0.7, "dev": 0.6, "settings": {"C": 10.0}, "seconds": 6})
    assert all(is_current(r) for r in runs)
    assert differences(runs[0]) == "SetFit's defaults, trained on every row (dev included)"
    write_table(runs, tmp_path / "t.md", "cmd")
    text = (tmp_path / "t.md").read_text()
    assert "| trec | 256 | setfit | SetFit's defaults, trained on every row (dev included) | 85.0 ± 7.1 | - |" in text
    assert "| - / - | - | 2 | 10.0 | cpu |" in text
    assert "C chosen on dev | 70.0 | - | 60.0 | - | - | - / - | - | 1 | 0.1 | cpu |" in text


def test_the_quality_table_shows_the_floor_of_each_set_beside_the_trained_modes(tmp_path):
    h100 = {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3"}
    trained = {"set": "trec", "mode": "bitfit", "metric": "accuracy", "dev": 0.95, "seconds": 60}
    trained |= {"settings": default_settings("bitfit")} | h100
    runs = [trained | {"seed": s, "test": t} for s, t in ((0, 0.96), (1, 0.97))]
    floor = {"mode": "logreg", "seed": 0, "metric": "accuracy", "dev": 0.85, "settings": {"C": 10.0}, "seconds": 90}
    runs += [floor | {"set": "trec", "test": 0.904, "device": "cpu"}, floor | {"set": "stsb", "test": 0.82} | h100]
    write_quality_table(runs, tmp_path / "q.md", "cmd")
    text = (tmp_path / "q.md").read_text()
    h100_table, cpu_table = text.split("## cpu")
    # the H100's own floor where it has one, else the CPU's, named; the floor is not a trained run
    assert "| trec | accuracy | 96.5 ± 0.7 (n=2) | - | - | - | 90.4 (cpu) | - | - | - | 2 | 1.0 / - / - |" in h100_table
    assert "| stsb | - | - | - | - | - | 82.0 | - | - | - | 0 | - |" in h100_table
    assert "Runs at today's defaults: 2 of 60" in h100_table
    assert "| trec | - | - | - | - | - | 90.4 | - | - | - | 0 | - |" in cpu_table
    assert "Runs at today's defaults: 0 of 60" in cpu_table
