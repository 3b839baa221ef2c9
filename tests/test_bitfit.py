"""BitFit targets across architectures; extract -> apply reproduces a trained model; a zero patch is a no-op."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertModel, MPNetConfig, MPNetModel, RobertaConfig, RobertaModel

from patchserve.patches.bitfit import (
    BIAS_SUBSETS,
    ROLE_ORDER,
    apply_values,
    base_biases,
    bias_parameters,
    bias_roles,
    extract_patch,
    target_names,
)
from patchserve.patches.errors import EncoderError, PatchKeysError
from patchserve.patches.format import BaseRef, Patch, PatchMeta
from patchserve.patches.model import TaskModel
from tests.helpers import make_patch

TINY = {
    "vocab_size": 60,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 40,
}


def _tiny(arch: str) -> nn.Module:
    torch.manual_seed(0)
    if arch == "bert":
        return BertModel(BertConfig(**TINY))
    if arch == "roberta":
        return RobertaModel(RobertaConfig(**TINY, pad_token_id=1))
    return MPNetModel(MPNetConfig(**TINY, pad_token_id=1))


@pytest.mark.parametrize("arch", ["bert", "roberta", "mpnet"])
def test_every_bias_has_a_role_and_subsets_select_by_role(arch):
    model = _tiny(arch)
    roles = bias_roles(model)
    assert set(roles) == set(bias_parameters(model)), "a bias without a naming rule"
    layers = model.config.num_hidden_layers
    per_role = {r: sum(1 for x in roles.values() if x.role == r) for r in ROLE_ORDER}
    for role in ("q", "k", "v", "m1", "ln1", "m2", "m3", "ln2"):
        assert per_role[role] == layers, (arch, role)
    assert per_role["emb_ln"] == 1 and per_role["pooler"] == 1
    assert target_names(model, "all") == list(bias_parameters(model))
    qi = target_names(model, "query-intermediate")
    assert len(qi) == 2 * layers
    assert {roles[n].role for n in qi} == {"q", "m2"}
    assert sorted({roles[n].layer for n in qi}) == list(range(layers))


def test_unknown_subset_and_architecture():
    model = _tiny("bert")
    with pytest.raises(ValueError, match="unknown bias subset"):
        target_names(model, "everything")
    model.config.model_type = "mystery"
    assert len(target_names(model, "all")) == len(bias_parameters(model))  # needs no naming rules
    with pytest.raises(EncoderError, match="has no bias roles described"):
        target_names(model, "query-intermediate")


def _meta(task: str = "t", subset: str = "all") -> PatchMeta:
    return PatchMeta(
        task=task,
        kind="classification",
        labels=["a", "b", "c"],
        base=BaseRef("tiny", "sha256:" + "1" * 64),
        bias_subset=subset,
        pooling="mean",
        max_seq_length=16,
    )


@pytest.mark.parametrize("arch", ["bert", "roberta", "mpnet"])
@pytest.mark.parametrize("subset", sorted(BIAS_SUBSETS))
def test_apply_of_extract_reproduces_the_trained_model(arch, subset):
    base = _tiny(arch).eval()
    trained = copy.deepcopy(base)
    names = target_names(trained, subset)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # "training": move exactly the target biases
        for n in names:
            p = bias_parameters(trained)[n]
            p.add_(torch.randn(p.shape, generator=gen))
    head = nn.Linear(32, 3)
    patch = Patch.from_bytes(extract_patch(trained, head, _meta(subset=subset)).data)
    assert sorted(patch.biases) == sorted(names)

    ids = torch.randint(3, 60, (4, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    expected = TaskModel(trained, head, "classification", "mean")(ids, mask)
    served = TaskModel.from_patch(copy.deepcopy(base), patch).eval()
    got = served(ids, mask)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    plain = TaskModel(base, head, "classification", "mean")(ids, mask)
    assert (got - plain).abs().max() > 1e-3, "the patch must change the outputs"


def test_zero_patch_is_the_plain_model(tiny_encoder):
    model = tiny_encoder.model
    before = {n: p.clone() for n, p in model.named_parameters()}
    ids = torch.randint(5, 60, (3, 7))
    mask = torch.ones_like(ids)
    plain = model(input_ids=ids, attention_mask=mask).last_hidden_state
    patched = copy.deepcopy(model)
    apply_values(patched, base_biases(model))
    torch.testing.assert_close(patched(input_ids=ids, attention_mask=mask).last_hidden_state, plain, rtol=0, atol=0)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_extract_reads_task_models_and_refuses_unknown_biases(tiny_encoder):
    from transformers import BertForSequenceClassification

    config = copy.deepcopy(tiny_encoder.model.config)
    config.num_labels = 3
    task_model = BertForSequenceClassification(config)
    patch = extract_patch(task_model, task_model.classifier, _meta())  # bert.* prefix is stripped
    assert "encoder.layer.0.attention.self.query.bias" in patch.biases
    with pytest.raises(PatchKeysError):
        apply_values(copy.deepcopy(tiny_encoder.model), {"encoder.layer.9.attention.self.query.bias": torch.zeros(32)})


def test_patch_sizes_for_bert_base_dimensions():
    """The paper: 12 layers x 8,448 = 101,376 layer biases in BERT-base (+ embedding LN and pooler)."""
    with torch.device("meta"):
        model = BertModel(BertConfig())  # bert-base dimensions, no memory
    layer_biases = sum(p.numel() for n, p in bias_parameters(model).items() if n.startswith("encoder."))
    assert layer_biases == 101_376
    assert sum(bias_parameters(model)[n].numel() for n in target_names(model, "all")) == 101_376 + 2 * 768
    assert sum(bias_parameters(model)[n].numel() for n in target_names(model, "query-intermediate")) == 12 * (
        768 + 3072
    )


def test_patch_helper_targets_only_the_subset(tiny_encoder):
    patch = make_patch(tiny_encoder, subset="query-intermediate")
    assert all(".query." in n or ".intermediate." in n for n in patch.biases)
