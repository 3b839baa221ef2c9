"""Loading encoders and their fingerprints."""

from __future__ import annotations

import json

import pytest
import torch

from patchserve.patches.bitfit import target_names
from patchserve.patches.encoder import fingerprint_model, load_encoder
from patchserve.patches.errors import EncoderError
from tests.helpers import make_tiny_bert_folder


def test_fingerprint_is_stable_and_sensitive(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = make_tiny_bert_folder(tmp_path / "m")
    a, b = load_encoder(str(folder)), load_encoder(str(folder))
    assert a.fingerprint == b.fingerprint == fingerprint_model(a.model)
    assert a.fingerprint.startswith("sha256:") and len(a.fingerprint) == 7 + 64
    cache = json.loads((tmp_path / "cache" / "patchserve" / "fingerprints.json").read_text())
    assert a.fingerprint in cache.values()
    with torch.no_grad():
        a.model.encoder.layer[0].output.dense.weight[0, 0] += 1e-3
    assert fingerprint_model(a.model) != b.fingerprint
    other = make_tiny_bert_folder(tmp_path / "other", seed=1)
    assert load_encoder(str(other)).fingerprint != b.fingerprint


def test_loaded_encoder_is_frozen_and_in_eval_mode(tiny_encoder):
    assert not tiny_encoder.model.training
    assert not any(p.requires_grad for p in tiny_encoder.model.parameters())
    spec = tiny_encoder.spec
    assert spec.hidden_size == 32 and spec.fingerprint == tiny_encoder.fingerprint
    assert spec.bias_shapes["encoder.layer.1.intermediate.dense.bias"] == (64,)


def test_bad_sources_say_what_to_do(tmp_path):
    with pytest.raises(EncoderError, match="does not exist"):
        load_encoder("./no/such/folder")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EncoderError, match=r"no config\.json"):
        load_encoder(str(tmp_path / "empty"))


def test_default_packaged_minilm(minilm):
    """The real default encoder loads offline from its PyPI package and is a 6-layer, 384-wide BERT."""
    assert minilm.name == "sentence-transformers/all-MiniLM-L6-v2"
    assert minilm.default_pooling == "mean"
    assert minilm.hidden_size == 384 and minilm.model.config.num_hidden_layers == 6
    shapes = minilm.spec.bias_shapes
    all_values = sum(shapes[n][0] for n in target_names(minilm.model, "all"))
    qi_values = sum(shapes[n][0] for n in target_names(minilm.model, "query-intermediate"))
    assert (all_values, qi_values) == (26_112, 6 * (384 + 1536))
    enc = minilm.tokenizer(["a plane is taking off"], return_tensors="pt")
    out = minilm.model(**enc).last_hidden_state
    assert out.shape == (1, enc["input_ids"].shape[1], 384) and torch.isfinite(out).all()


def test_loading_prints_no_progress_bar(tiny_bert_dir, capfd):
    """transformers' "Loading weights" bar used to land in every server and worker log."""
    load_encoder(str(tiny_bert_dir))
    captured = capfd.readouterr()
    assert "Loading weights" not in captured.err and "it/s" not in captured.err
