"""PEFT adapters in and out, against Hugging Face PEFT itself (from PyPI): an adapter trained by PEFT serves with PEFT's
outputs, and a patch exported for PEFT gives the server's outputs when PEFT loads it (float32, CPU, 1e-5)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model
from transformers import BertForSequenceClassification, BertForTokenClassification

from patchserve.patches.encoder import load_encoder
from patchserve.patches.model import mean_pool
from patchserve.patches.peft_io import HEAD_FILE, PeftImportError, export_peft, import_peft
from patchserve.server.engine.protocol import Row
from patchserve.server.engine.runner import Runner
from tests.helpers import make_patch

TEXTS = ["the movie was good", "what a boring plot and a bad actor", "who is the actor", "not very fun"]


def _peft_model(base_dir, config, *, tagger=False, labels=3, seed=1):
    """A PEFT model over the tiny BERT whose trainable values (adapter, biases, classifier) are moved off their
    initial values, as training would."""
    torch.manual_seed(0)
    cls = BertForTokenClassification if tagger else BertForSequenceClassification
    model = get_peft_model(cls.from_pretrained(base_dir, num_labels=labels), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _served(encoder_dir, patches_and_texts, engine="packed"):
    encoder = load_encoder(str(encoder_dir))
    runner = Runner(encoder, device="cpu", slots=8, engine=engine)
    rows = []
    for patch, texts in patches_and_texts:
        enc = encoder.tokenizer(texts)
        rows += [Row(i, t, patch) for i, t in zip(enc["input_ids"], enc["token_type_ids"], strict=True)]
    return runner.run(rows)


def _logits(model, tokenizer, texts):
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits, batch["attention_mask"]


LORA = LoraConfig(
    task_type="SEQ_CLS",
    r=4,
    lora_alpha=8,
    bias="all",
    target_modules=["query", "value", "intermediate.dense"],
    use_rslora=True,
    rank_pattern={"intermediate.dense": 2},
    alpha_pattern={"value": 3},
)
IA3 = IA3Config(
    task_type="SEQ_CLS",
    target_modules=["query", "key", "value", "output.dense"],
    feedforward_modules=["output.dense"],  # the feed-forward's and the attention's output.dense: input scales
)


@pytest.mark.parametrize("config", [LORA, IA3], ids=["lora", "ia3"])
@pytest.mark.parametrize("engine", ["packed", "slotted"])
def test_a_peft_adapter_serves_with_peft_outputs(tmp_path, tiny_bert_dir, tiny_encoder, config, engine):
    model = _peft_model(tiny_bert_dir, config)
    model.save_pretrained(tmp_path / "adapter")
    want, _ = _logits(model, tiny_encoder.tokenizer, TEXTS)
    patch = import_peft(tmp_path / "adapter", tiny_encoder, "imported", labels=["neg", "neu", "pos"])
    assert patch.meta.patch_type == ("lora" if config is LORA else "bitfit-ia3") and patch.meta.pooling == "pooler"
    other = make_patch(tiny_encoder, "other", seed=7)  # served in the same batch
    got = _served(tiny_bert_dir, [(patch, TEXTS), (other, TEXTS[:2])], engine)[: len(TEXTS)]
    torch.testing.assert_close(torch.stack(got), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("task_type", ["SEQ_CLS", "TOKEN_CLS"])
@pytest.mark.parametrize("config_type", [LoraConfig, IA3Config], ids=["lora", "ia3"])
def test_an_adapter_of_peft_defaults_serves_with_peft_outputs(
    tmp_path, tiny_bert_dir, tiny_encoder, config_type, task_type
):
    """PEFT's own defaults for the task type (its target modules for BERT, its modules_to_save, which may list head
    modules the model does not have): so a change of PEFT's defaults shows here first."""
    tagger = task_type == "TOKEN_CLS"
    model = _peft_model(tiny_bert_dir, config_type(task_type=task_type), tagger=tagger, labels=3)
    model.save_pretrained(tmp_path / "adapter")
    patch = import_peft(tmp_path / "adapter", tiny_encoder, "defaults")
    assert patch.meta.kind == ("token-classification" if tagger else "classification")
    other = make_patch(tiny_encoder, "other", seed=7)  # served in the same batch
    got = _served(tiny_bert_dir, [(patch, TEXTS), (other, TEXTS[:2])])[: len(TEXTS)]
    for text, out in zip(TEXTS, got, strict=True):
        want, _ = _logits(model, tiny_encoder.tokenizer, [text])
        torch.testing.assert_close(out, want[0], rtol=0, atol=1e-5)


def test_modules_to_save_without_weights_are_ignored(tmp_path, tiny_bert_dir, tiny_encoder):
    """A module the config lists but the adapter holds no weights of (PEFT 0.22 lists pre_classifier for every
    classifier) changes nothing: the same patch as without it."""
    _peft_model(tiny_bert_dir, LORA).save_pretrained(tmp_path / "adapter")
    plain = import_peft(tmp_path / "adapter", tiny_encoder, "x")
    _edit_config(tmp_path / "adapter", modules_to_save=["classifier", "score", "pre_classifier", "pooler"])
    again = import_peft(tmp_path / "adapter", tiny_encoder, "x")
    again.meta.created_at = plain.meta.created_at  # the one field that may differ: the second the import ran
    assert again.data == plain.data


def test_weights_beyond_the_task_head_are_refused_naming_the_modules(tmp_path, tiny_bert_dir, tiny_encoder):
    config = LoraConfig(task_type="SEQ_CLS", target_modules=["query"], modules_to_save=["pooler", "LayerNorm"])
    _peft_model(tiny_bert_dir, config).save_pretrained(tmp_path / "a")
    with pytest.raises(
        PeftImportError, match=r"weights of embeddings\.LayerNorm, .*pooler\.dense, which would replace"
    ):
        import_peft(tmp_path / "a", tiny_encoder, "x")


def test_a_head_of_two_layers_is_refused(tmp_path, tiny_bert_dir, tiny_encoder):
    """DistilBertForSequenceClassification's head (pre_classifier + classifier), as PEFT's defaults save it."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    cfg = DistilBertConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, hidden_dim=64, max_position_embeddings=64)
    lora = LoraConfig(task_type="SEQ_CLS", target_modules=["q_lin", "v_lin"])  # (PEFT has no default for it)
    model = get_peft_model(DistilBertForSequenceClassification(cfg), lora)
    model.save_pretrained(tmp_path / "a")
    _edit_config(tmp_path / "a", base_model_name_or_path=str(tiny_bert_dir))  # past the base check to the head's
    with pytest.raises(PeftImportError, match=r"task head has more than one layer \(pre_classifier"):
        import_peft(tmp_path / "a", tiny_encoder, "x")


def test_a_peft_tagger_serves_with_peft_outputs(tmp_path, tiny_bert_dir, tiny_encoder):
    config = LoraConfig(task_type="TOKEN_CLS", r=3, lora_alpha=6, bias="all", target_modules=["key", "output.dense"])
    model = _peft_model(tiny_bert_dir, config, tagger=True, labels=4)
    model.save_pretrained(tmp_path / "tagger")
    patch = import_peft(tmp_path / "tagger", tiny_encoder, "tags")
    assert patch.meta.kind == "token-classification" and patch.meta.labels == [f"LABEL_{i}" for i in range(4)]
    got = _served(tiny_bert_dir, [(patch, TEXTS)])
    for text, out in zip(TEXTS, got, strict=True):
        want, _ = _logits(model, tiny_encoder.tokenizer, [text])
        torch.testing.assert_close(out, want[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("config", [LORA, IA3], ids=["lora", "ia3"])
def test_peft_round_trip(tmp_path, tiny_bert_dir, tiny_encoder, config):
    """PEFT -> patchserve -> PEFT: the outputs of the adapter PEFT loads back equal the original's."""
    model = _peft_model(tiny_bert_dir, config, labels=2)
    model.save_pretrained(tmp_path / "adapter")
    want, _ = _logits(model, tiny_encoder.tokenizer, TEXTS)
    export_peft(import_peft(tmp_path / "adapter", tiny_encoder, "rt"), tmp_path / "back", tiny_encoder)
    base = BertForSequenceClassification.from_pretrained(tiny_bert_dir, num_labels=2)
    again, _ = _logits(PeftModel.from_pretrained(base, tmp_path / "back").eval(), tiny_encoder.tokenizer, TEXTS)
    torch.testing.assert_close(again, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["lora", "ia3", "lora-mean"])
def test_an_exported_patch_loaded_by_peft_gives_the_server_outputs(tmp_path, tiny_bert_dir, tiny_encoder, kind):
    """Patches made here (every bias trained, as a BitFit patch's) exported: PEFT reproduces what the server serves."""
    if kind == "ia3":
        patch = make_patch(tiny_encoder, "x", seed=3, ia3_scale=0.3, pooling="pooler")
    else:
        pooling = "mean" if kind == "lora-mean" else "pooler"
        patch = make_patch(
            tiny_encoder, "x", seed=3, lora_rank=3, pooling=pooling, lora_targets=("query", "output.dense")
        )
    served = torch.stack(_served(tiny_bert_dir, [(patch, TEXTS)]))
    export_peft(patch, tmp_path / "out", tiny_encoder)
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    if kind == "lora-mean":  # the bare encoder's adapter; pooling and head beside it
        from safetensors.torch import load_file
        from transformers import BertModel

        assert config["task_type"] == "FEATURE_EXTRACTION"
        peft = PeftModel.from_pretrained(BertModel.from_pretrained(tiny_bert_dir), tmp_path / "out").eval()
        batch = tiny_encoder.tokenizer(TEXTS, padding=True, return_tensors="pt")
        with torch.no_grad():
            pooled = mean_pool(peft(**batch).last_hidden_state, batch["attention_mask"])
        head = load_file(tmp_path / "out" / HEAD_FILE)
        got = pooled @ head["weight"].t() + head["bias"]
    else:
        base = BertForSequenceClassification.from_pretrained(tiny_bert_dir, num_labels=2)
        got, _ = _logits(PeftModel.from_pretrained(base, tmp_path / "out").eval(), tiny_encoder.tokenizer, TEXTS)
    torch.testing.assert_close(got, served, rtol=0, atol=1e-5)


def _edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"base_model_name_or_path": "bert-base-uncased"}, "trained on 'bert-base-uncased'"),
        ({"task_type": "FEATURE_EXTRACTION"}, "has no task head"),
        ({"peft_type": "PREFIX_TUNING"}, "is not served"),
    ],
)
def test_unservable_adapters_are_refused_with_the_reason(tmp_path, tiny_bert_dir, tiny_encoder, changes, why):
    folder = tmp_path / "adapter"
    _peft_model(tiny_bert_dir, LORA).save_pretrained(folder)
    _edit_config(folder, **changes)
    with pytest.raises(PeftImportError, match=why):
        import_peft(folder, tiny_encoder, "x")


def test_adapters_on_what_cannot_be_served_exactly_are_refused(tmp_path, tiny_bert_dir, tiny_encoder):
    _peft_model(tiny_bert_dir, LoraConfig(task_type="SEQ_CLS", target_modules=["dense"])).save_pretrained(
        tmp_path / "a"
    )
    with pytest.raises(PeftImportError, match=r"pooler\.dense"):  # "dense" takes the pooler too
        import_peft(tmp_path / "a", tiny_encoder, "x")
    ia3 = IA3Config(task_type="SEQ_CLS", target_modules=["intermediate.dense"], feedforward_modules=[])
    _peft_model(tiny_bert_dir, ia3).save_pretrained(tmp_path / "b")
    with pytest.raises(PeftImportError, match="cannot be served exactly"):  # a scale before the activation
        import_peft(tmp_path / "b", tiny_encoder, "x")
    _peft_model(tiny_bert_dir, LORA).save_pretrained(tmp_path / "c")
    with pytest.raises(PeftImportError, match="3 outputs but 2 labels"):
        import_peft(tmp_path / "c", tiny_encoder, "x", labels=["a", "b"])
    (tmp_path / "c" / "adapter_model.safetensors").rename(tmp_path / "c" / "adapter_model.bin")
    with pytest.raises(PeftImportError, match="pickle, which is never loaded"):
        import_peft(tmp_path / "c", tiny_encoder, "x")
    shutil.rmtree(tmp_path / "c")
    with pytest.raises(PeftImportError, match="not a PEFT adapter folder"):
        import_peft(tmp_path / "c", tiny_encoder, "x")


def test_the_cli_imports_registers_and_exports(tmp_path, tiny_bert_dir, tiny_encoder, capsys):
    from patchserve.__main__ import main
    from patchserve.patches.format import Patch

    _peft_model(tiny_bert_dir, LORA).save_pretrained(tmp_path / "adapter")
    out, model = tmp_path / "sst.safetensors", str(tiny_bert_dir)
    args = ["import-peft", str(tmp_path / "adapter"), "--task", "sst", "--labels", "a,b,c", "--model", model]
    assert main([*args, "--out", str(out)]) == 0
    assert main(["inspect", "--json", str(out)]) == 0
    info = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert info["patch_type"] == "lora" and info["labels"] == ["a", "b", "c"] and info["lora_rank"] == 4
    assert main([*args, "--registry", f"disk://{tmp_path}/reg"]) == 0
    assert "registered sst v1" in capsys.readouterr().out
    assert main(["export-peft", str(out), str(tmp_path / "back"), "--model", model]) == 0
    assert (tmp_path / "back" / "adapter_config.json").is_file()
    bitfit = tmp_path / "bitfit.safetensors"
    bitfit.write_bytes(make_patch(tiny_encoder, "b").data)
    assert main(["export-peft", str(bitfit), str(tmp_path / "no"), "--model", model]) == 1
    assert "has no PEFT form" in capsys.readouterr().err
    assert main([*args[:-2], "--model", model, "--labels", "x"]) == 1  # a refusal: exit 1 with the reason
    assert "3 outputs but 1 labels" in capsys.readouterr().err
    assert Patch.read(out).meta.training["source"] == "peft"


def test_an_adapter_of_the_packaged_model_serves_with_peft_outputs(tmp_path, minilm):
    """The real default encoder: a PEFT LoRA adapter over BertForSequenceClassification loaded from its folder (its
    base recorded as that folder: checked by fingerprint)."""
    from patchserve.patches.encoder import default_encoder_path

    model = _peft_model(
        default_encoder_path(),
        LoraConfig(task_type="SEQ_CLS", r=8, bias="all", target_modules=["query", "value"]),
        labels=2,
    )
    model.save_pretrained(tmp_path / "adapter")
    want, _ = _logits(model, minilm.tokenizer, TEXTS)
    patch = import_peft(tmp_path / "adapter", minilm, "rt")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    runner = Runner(minilm, device="cpu", slots=4, engine="packed")
    enc = minilm.tokenizer(TEXTS)
    rows = [Row(i, t, patch) for i, t in zip(enc["input_ids"], enc["token_type_ids"], strict=True)]
    torch.testing.assert_close(torch.stack(runner.run(rows)), want, rtol=0, atol=1e-5)
