"""LoRA on the packed trainer: logits and gradients (biases, factors, head) equal the plain padded model's with the
same factors (float32); a lora patch trains, serves as trained, and runs in one batch equal the runs one by one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from patchserve.patches import packed_lora
from patchserve.patches.bitfit import apply_values, bias_parameters
from patchserve.patches.errors import EncoderError
from patchserve.patches.format import LORA_A, LORA_B
from patchserve.patches.lora import LoraSpec, lora_shapes, targets_of
from patchserve.patches.model import TaskModel
from patchserve.patches.packed_model import PackedTaskModel
from patchserve.server.engine.protocol import Row
from patchserve.server.engine.runner import Runner
from patchserve.trainer.models import set_dropout
from patchserve.trainer.runs import loss_fn
from patchserve.trainer.train import train_patch
from tests.helpers import train_config, training_data
from tests.test_packed_training import _batch, _dev_logits, _perturbed

ALL = ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"]
CASES = {  # kind, pooling, outputs, targets
    "classification-qv": ("classification", "mean", 3, ["query", "value"]),
    "regression-every": ("regression", "pooler", 1, ALL),
    "tagging-ko": ("token-classification", "cls", 4, ["key", "output.dense"]),
}


def _factors(encoder, spec, seed):
    """Starting factors away from PEFT's (B nonzero), so that every factor gets a gradient."""
    g = torch.Generator().manual_seed(seed)
    shapes = lora_shapes(encoder)
    out = {}
    for m in spec.modules:
        out_f, in_f = shapes[m]
        out[m + LORA_A] = 0.3 * torch.randn(spec.rank, in_f, generator=g)
        out[m + LORA_B] = 0.3 * torch.randn(out_f, spec.rank, generator=g)
    return out


@pytest.mark.parametrize("form", ["stacked", "segments"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_lora_logits_and_gradients_equal_the_padded_model(tiny_encoder, case, form, monkeypatch):
    """In both forms the CPU trains with: stacked (a few runs' factors) and per segment (many)."""
    if form == "segments":
        monkeypatch.setattr(packed_lora, "STACKED_MAX_COLUMNS", 0)
    kind, pooling, n_out, targets = CASES[case]
    encoder = _perturbed(tiny_encoder.model, seed=1)
    spec = LoraSpec(tuple(targets_of(encoder, targets)), rank=3, alpha=6.0)
    start = _factors(encoder, spec, seed=2)
    torch.manual_seed(0)
    head = nn.Linear(tiny_encoder.hidden_size, n_out)
    padded = TaskModel(copy.deepcopy(encoder), copy.deepcopy(head), kind, pooling).train()
    set_dropout(padded.encoder, 0.0)
    padded.requires_grad_(False)
    apply_values(padded.encoder, {n: v.clone() for n, v in start.items()})  # the hooks, then factors with gradients
    leaves = {n: v.clone().requires_grad_(True) for n, v in start.items()}
    modules = dict(padded.encoder.named_modules())
    for m in spec.modules:
        modules[m].lora_factors = (leaves[m + LORA_A], leaves[m + LORA_B] * spec.scaling)
    params = bias_parameters(padded.encoder)
    for p in [*params.values(), *padded.head.parameters()]:
        p.requires_grad_(True)
    packed = PackedTaskModel(encoder, [head], kind, pooling, list(params), lora=spec, lora_start=[start]).train()

    batch = _batch(tiny_encoder.tokenizer, kind, n_out)
    args = (batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    want, got = padded(*args), packed(*args)
    keep = batch["labels"] != -100 if kind == "token-classification" else slice(None)
    torch.testing.assert_close(got[keep], want[keep], rtol=0, atol=1e-5)
    loss_fn(kind, want, batch["labels"]).backward()
    loss_fn(kind, got, batch["labels"]).backward()
    assert packed.bank.grad is not None
    grads = {n: packed.bank.grad[0, a:b].view(packed.shapes[n]) for n, (a, b) in packed.columns.items()}
    for name, leaf in leaves.items():
        assert leaf.grad is not None and leaf.grad.abs().max() > 0, name
        torch.testing.assert_close(grads[name], leaf.grad, rtol=1e-4, atol=1e-6, msg=name)
    for name, p in params.items():
        expected = torch.zeros_like(grads[name]) if p.grad is None else p.grad
        if name.endswith("attention.self.key.bias"):  # dropped by the packed model: softmax ignores it
            continue
        torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(packed.head_weight.grad[0], padded.head.weight.grad, rtol=1e-4, atol=1e-6)


def test_a_trained_lora_patch_serves_as_the_trained_model(tmp_path, tiny_encoder):
    train, dev = training_data(tmp_path, "classification", n_train=64, n_dev=16)
    result = train_patch(tiny_encoder, train, dev, train_config(min_steps=8, eval_every=4, lora_rank=2))
    patch = result.patch
    assert patch is not None and patch.meta.patch_type == "lora" and patch.lora_rank == 2
    n_layers = len(tiny_encoder.model.encoder.layer)
    assert len(patch.lora) == 6 * 2 * n_layers  # the default targets (every linear layer), A and B, every layer
    assert any(t.abs().max() > 0 for n, t in patch.lora.items() if n.endswith(LORA_B))  # B has moved off zero
    runner = Runner(tiny_encoder, device="cpu", slots=4, engine="packed")
    enc = tiny_encoder.tokenizer([e.text for e in dev.examples[:6]])
    rows = [Row(i, t, patch) for i, t in zip(enc["input_ids"], enc["token_type_ids"], strict=True)]
    want = torch.stack(
        [
            result.model(
                torch.tensor([r.input_ids]),
                torch.ones(1, len(r.input_ids), dtype=torch.long),
                torch.tensor([r.token_type_ids]),
            )[0]
            for r in rows
        ]
    ).detach()
    torch.testing.assert_close(torch.stack(runner.run(rows)), want, rtol=0, atol=1e-5)


def test_lora_runs_in_one_batch_equal_the_same_runs_one_by_one(tmp_path, tiny_encoder):
    """In float32: bfloat16's products round each run's rows differently in a batch of other rows."""
    train, dev = training_data(tmp_path, "classification", n_train=64, n_dev=16)
    common = {
        "min_steps": 12,
        "eval_every": 4,
        "dropout": 0.0,
        "lora_rank": 2,
        "lora_targets": ["query", "output.dense"],
        "precision": "float32",
    }
    together = train_patch(tiny_encoder, train, dev, train_config(**common, restarts=2))
    assert together.report["forward"] == "packed" and together.report["selection"]["tried"] == 2
    for run in together.report["runs"]:
        alone = train_patch(tiny_encoder, train, dev, train_config(**common, restarts=1, seed=run["seed"]))
        for k, v in alone.report["dev"].items():
            assert run["best_dev"][k] == pytest.approx(v, abs=1e-6)
        if run["seed"] == together.report["seed"]:
            assert together.patch is not None and alone.patch is not None
            for name, value in alone.patch.lora.items():
                torch.testing.assert_close(together.patch.lora[name], value, rtol=0, atol=1e-5, msg=name)
            torch.testing.assert_close(_dev_logits(together, tiny_encoder, dev), _dev_logits(alone, tiny_encoder, dev))


def test_lora_configs_that_cannot_train_are_refused(tmp_path, tiny_encoder):
    from patchserve.patches.errors import JobError

    with pytest.raises(JobError, match="lora or"):
        train_config(lora_rank=4, scales="ia3")
    with pytest.raises(JobError, match="drop lora_rank or full"):
        train_config(lora_rank=4, full=True)
    train, dev = training_data(tmp_path, "classification", n_train=32, n_dev=8)
    with pytest.raises(EncoderError, match="LoRA trains on the packed model"):
        train_patch(tiny_encoder, train, dev, train_config(lora_rank=2), packed=False)
