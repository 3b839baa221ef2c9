"""The family descriptions (patchserve.patches.arch) against the Hugging Face models they describe: every family in
the registry, through a tiny random config of each of its model types, so a family added to the registry is held
to the same checks with no other edit."""

from __future__ import annotations

import copy
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from torch import nn
from transformers import AutoConfig, AutoModel

from patchserve.patches.arch import ARCHS, DOCS_PAGE, FAMILIES, LAYER_SITES, arch_of, arch_of_sites
from patchserve.patches.bitfit import bias_parameters, bias_roles, ia3_roles, target_names
from patchserve.patches.encoder import load_encoder
from patchserve.patches.errors import EncoderError, PatchKeysError
from patchserve.patches.lora import lora_roles, targets_of
from patchserve.patches.model import TaskModel
from patchserve.patches.packed import packed_unsupported
from patchserve.patches.synthetic import random_patch
from patchserve.server.app import create_app
from patchserve.server.engine.protocol import Row
from patchserve.server.engine.runner import Runner
from patchserve.server.settings import ServerSettings
from tests.helpers import tiny_vocab

LAYERS = 2
MODEL_TYPES = sorted(ARCHS)


def _tiny(model_type: str, **overrides: object) -> nn.Module:
    settings: dict[str, object] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 40,
    }
    config = AutoConfig.for_model(model_type, **(settings | overrides))
    torch.manual_seed(0)
    return AutoModel.from_config(config).eval()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_site_is_a_module_of_the_family(model_type):
    model = _tiny(model_type)
    arch = arch_of(model)
    assert arch is not None and model_type in arch.model_types
    modules = dict(model.named_modules())
    for i in range(LAYERS):
        for site in LAYER_SITES:
            assert f"{arch.layer.format(i=i)}.{arch.sites[site]}" in modules, (site, i)
    for site, path in arch.top.items():
        assert path in modules, site
    # LoRA: six linear layers a layer; (IA)^3: the key, the value and the activated intermediate of each
    roles = lora_roles(model)
    assert len(roles) == 6 * LAYERS and all(isinstance(modules[n], nn.Linear) for n in roles)
    assert sorted(r.role for r in ia3_roles(model).values()) == sorted(["k", "v", "ff"] * LAYERS)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_bias_roles_name_every_bias_of_the_sites_once(model_type):
    model = _tiny(model_type)
    arch = arch_of(model)
    roles = bias_roles(model)
    per_role: dict[str, int] = {}
    for role in roles.values():
        per_role[role.role] = per_role.get(role.role, 0) + 1
    want = {r: LAYERS for r in ("q", "k", "v", "m1", "ln1", "m2", "m3", "ln2")}
    want |= {r: 1 for r, site in (("emb_ln", "emb_norm"), ("pooler", "pooler")) if site in arch.top}
    assert per_role == want
    # every bias of the model that sits on a described site has its role (what is left is no site's: ELECTRA's
    # embedding projection)
    sites = {n for n, _ in model.named_modules()}
    unroled = [n for n in bias_parameters(model) if n not in roles]
    assert all(n.removesuffix(".bias") in sites and "layer" not in n for n in unroled), unroled
    assert target_names(model, "query-intermediate") == [n for n, r in roles.items() if r.role in ("q", "m2")]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_max_positions_is_the_longest_input_the_model_embeds(model_type):
    """Counted as the family counts positions (RoBERTa's: from padding_idx + 1): the longest input runs, one token
    more does not fit the position table."""
    model = _tiny(model_type)
    longest = arch_of(model).max_positions(model.config)
    assert 0 < longest <= model.config.max_position_embeddings
    ids = torch.full((1, longest), 5)
    with torch.no_grad():
        assert model(input_ids=ids).last_hidden_state.shape[1] == longest
        with pytest.raises((IndexError, RuntimeError)):
            model(input_ids=torch.full((1, longest + 1), 5))


def test_a_spec_s_lora_sites_name_their_family():
    for arch in FAMILIES:
        model = _tiny(arch.model_types[0])
        found = arch_of_sites(set(lora_roles(model)))
        assert found is not None and found.lora_rules == arch.lora_rules
    assert arch_of_sites({"encoder.block.0.attn.wq"}) is None


def test_a_family_without_description_is_refused_with_the_described_ones():
    model = _tiny("bert")
    model.config.model_type = "nomic-bert-not-described"
    assert arch_of(model) is None
    with pytest.raises(EncoderError, match=rf"nomic-bert-not-described.*described: .*bert.*{re.escape(DOCS_PAGE)}"):
        bias_roles(model)
    with pytest.raises(PatchKeysError, match="has no LoRA sites described"):
        targets_of(model, ["query"])
    assert target_names(model, "all") == list(bias_parameters(model))  # the whole set needs no description


def test_the_docs_page_lists_every_described_model_type():
    page = (Path(__file__).parent.parent / DOCS_PAGE).read_text()
    for arch in FAMILIES:
        for model_type in arch.model_types:
            assert f"`{model_type}`" in page, model_type


def test_a_loaded_encoder_caps_inputs_at_its_family_s_longest(family_encoder):
    """load_encoder reads the cap from the description (CamemBERT and MPNet once took the whole table: HTTP 500 on
    inputs past it)."""
    encoder = load_encoder(str(family_encoder))
    assert encoder.max_positions == arch_of(encoder.model).max_positions(encoder.model.config)


TEXTS = ["the movie was good", "what a boring plot and a bad actor in the city", "big", "who is the actor"]


def _folder(folder: Path, tiny_bert_dir: Path, model_type: str, **overrides: object) -> Path:
    """A tiny random encoder of ``model_type`` saved as a Hugging Face folder with the tiny BERT's tokenizer."""
    _tiny(model_type, vocab_size=len(tiny_vocab()), **overrides).save_pretrained(folder)
    for f in tiny_bert_dir.iterdir():
        if "token" in f.name or f.name == "vocab.txt":
            shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="module", params=MODEL_TYPES)
def family_encoder(request, tmp_path_factory, tiny_bert_dir):
    """The folder of a tiny random encoder of each described model type, loaded as the server loads it."""
    return _folder(tmp_path_factory.mktemp(request.param), tiny_bert_dir, request.param)


def test_every_kind_serves_on_the_slotted_engine_as_on_the_plain_model(family_encoder):
    """A mixed batch of BitFit, (IA)^3 and LoRA patches (different lengths) on the slotted engine, each row against
    the plain Hugging Face model with that row's patch written in (1e-5, float32): the exact simplifications the
    family's description allows (the key bias dropped, the value bias folded) included."""

    enc = load_encoder(str(family_encoder))
    pooling = "pooler" if "pooler" in arch_of(enc.model).top else "cls"
    every_site = tuple(lora_roles(enc.model))
    patches = [
        random_patch(enc, "bitfit", seed=1, pooling=pooling),
        random_patch(enc, "ia3", seed=2, ia3_scale=0.3, pooling="mean"),
        random_patch(enc, "lora", seed=3, lora_rank=2, lora_targets=every_site, kind="token-classification"),
    ]
    runner = Runner(load_encoder(str(family_encoder)), device="cpu", slots=4, engine="slotted")
    rows = []
    for i, patch in enumerate(patches):
        tok = enc.tokenizer(TEXTS[i:] + TEXTS[:i])
        types = tok.get("token_type_ids") or [[0] * len(ids) for ids in tok["input_ids"]]  # (a family without them)
        rows += [Row(ids, tt, patch) for ids, tt in zip(tok["input_ids"], types, strict=True)]
    got = runner.run(rows)
    for row, out in zip(rows, got, strict=True):
        plain = TaskModel.from_patch(copy.deepcopy(enc.model), row.patch).eval()
        ids = torch.tensor([row.input_ids])
        with torch.no_grad():
            want = plain(ids, torch.ones_like(ids))[0]
        torch.testing.assert_close(out, want, rtol=0, atol=1e-5)


def test_readyz_metrics_and_the_start_up_line_say_what_serves_the_family(family_encoder, tmp_path, caplog):
    """The family, the engine path (packed only where the family's layers are packed), the dtype, the longest input
    and the patch types served, on /readyz, in patchserve_encoder_info and in the start-up line."""
    enc = load_encoder(str(family_encoder))
    family = enc.model.config.model_type
    path = "slotted" if packed_unsupported(enc.model) else "packed"
    settings = ServerSettings(model=str(family_encoder), registry=f"disk://{tmp_path}/reg", device="cpu", slots=4)
    with caplog.at_level(logging.INFO, logger="patchserve"), TestClient(create_app(settings)) as client:
        ready = client.get("/readyz").json()
        text = client.get("/metrics").text
    assert (ready["family"], ready["engine"], ready["dtype"]) == (family, path, "float32")
    assert ready["max_seq_length"] == min(settings.max_seq_length, enc.max_positions)
    assert ready["patch_types"] == ["bitfit", "bitfit-ia3", "lora"] == enc.spec.patch_types
    info = re.search(r"patchserve_encoder_info\{([^}]*)\} 1\.0", text)
    assert info and f'family="{family}"' in info.group(1) and f'engine="{path}"' in info.group(1), text
    assert any(f"({family}, " in r.message and f"{path} engine" in r.message for r in caplog.records)


_MODERNBERT_IDS = {"pad_token_id": 0, "cls_token_id": 2, "sep_token_id": 3, "bos_token_id": 2, "eos_token_id": 3}


@pytest.mark.parametrize(
    ("model_type", "args", "why"),
    [
        ("roberta", ["--lora-rank", "4"], r"LoRA trains on the packed model, which is off here"),
        ("distilbert", ["--scales", "ia3"], r"\(IA\)\^3 scales train on the packed model, which is off here"),
        ("modernbert", [], r"ModernBertModel\) has no bias parameters, so a BitFit patch has nothing to train"),
    ],
)
def test_the_trainer_refuses_what_a_family_cannot_train_before_reading_data(
    tmp_path, tiny_bert_dir, capsys, model_type, args, why
):
    """A message, no traceback, and before the data is read (the training file here does not exist)."""
    from patchserve.__main__ import main

    overrides = _MODERNBERT_IDS if model_type == "modernbert" else {}
    folder = _folder(tmp_path / model_type, tiny_bert_dir, model_type, **overrides)
    code = main(["train", "--task", "t", "--train", str(tmp_path / "absent.jsonl"), "--model", str(folder), *args])
    err = capsys.readouterr().err
    assert code != 0 and re.search(why, err), err
    assert "Traceback" not in err and "absent.jsonl" not in err


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_head_modules_are_the_family_s_classification_head(model_type):
    """What PEFT saves of a *ForSequenceClassification head (its modules_to_save) is what the description names."""
    from transformers import AutoModelForSequenceClassification

    config = _tiny(model_type).config
    config.num_labels = 3
    model = AutoModelForSequenceClassification.from_config(config)
    modules = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    heads = set(arch_of(config).heads)
    assert heads <= modules, heads - modules
    base = model.base_model_prefix
    assert {n for n in modules if not n.startswith(base + ".")} == heads  # every linear outside the encoder
