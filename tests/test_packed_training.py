"""Packed training: the trainer's packed model gives the padded model's logits and gradients, runs in one batch keep
to their own biases and heads, and train_patch's runs in one batch equal the same runs trained one by one."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from patchserve.patches import packed_model
from patchserve.patches.bitfit import apply_values, bias_parameters, ia3_base, ia3_sites, scale_names, target_names
from patchserve.patches.errors import EncoderError
from patchserve.patches.model import TaskModel
from patchserve.patches.packed_attention import attention_groups, length_groups
from patchserve.patches.packed_layout import add_exact_attention
from patchserve.patches.packed_model import (
    PackedTaskModel,
    cpu_bfloat16_is_faster,
    cpu_has_bfloat16,
    joint_forward,
    training_bert,
    training_dtype,
)
from patchserve.patches.packed_ops import PRODUCT_BUCKET, dropout, half_product, keep_mask
from patchserve.trainer.features import Features, collate, featurize
from patchserve.trainer.models import set_dropout
from patchserve.trainer.runs import loss_fn
from patchserve.trainer.train import train_patch
from tests.helpers import train_config, training_data

SENTENCES = [
    "the cat sat",
    "a much longer sentence about dogs running in the park all day long",
    "hello",
    "bright red apples and green pears on the kitchen table",
    "one two three four five",
]
WORDS = [s.split() for s in SENTENCES]
CASES = {  # kind, pooling, bias subset, outputs, scales
    "classification-mean": ("classification", "mean", "all", 3, "none"),
    "classification-cls": ("classification", "cls", "all", 2, "none"),
    "regression-pooler": ("regression", "pooler", "all", 1, "none"),
    "tagging": ("token-classification", "mean", "all", 4, "none"),
    "subset": ("classification", "mean", "query-intermediate", 3, "none"),
    "ia3-classification": ("classification", "mean", "all", 3, "ia3"),
    "ia3-tagging": ("token-classification", "cls", "all", 4, "ia3"),
    "ia3-pooler": ("regression", "pooler", "query-intermediate", 1, "ia3"),
}


def _perturbed(encoder: nn.Module, seed: int) -> nn.Module:
    """A copy of ``encoder`` whose biases and LayerNorm gains are no longer the base ones (so every fold has something
    to carry, and no gain is 1)."""
    model = copy.deepcopy(encoder)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "LayerNorm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _batch(tokenizer, kind: str, n_out: int, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    if kind == "token-classification":
        enc = tokenizer(WORDS, is_split_into_words=True)
        labels = []
        for i in range(len(WORDS)):
            tags = torch.randint(n_out, (len(enc.word_ids(i)),), generator=g).tolist()
            labels.append([-100 if w is None else t for w, t in zip(enc.word_ids(i), tags, strict=True)])
    else:
        enc = tokenizer(SENTENCES)
        scores = torch.rand(len(SENTENCES), generator=g).tolist()
        labels = [scores[i] if kind == "regression" else i % n_out for i in range(len(SENTENCES))]
    feats = [
        Features(enc["input_ids"][i], enc["token_type_ids"][i], labels[i])  # type: ignore[arg-type]
        for i in range(len(SENTENCES))
    ]
    return collate(feats, int(tokenizer.pad_token_id or 0), kind, torch.device(device))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_logits_and_gradients_equal_the_padded_model(tiny_encoder, case):
    kind, pooling, subset, n_out, scales = CASES[case]
    encoder = _perturbed(tiny_encoder.model, seed=1)
    torch.manual_seed(0)
    head = nn.Linear(tiny_encoder.hidden_size, n_out)
    trained = target_names(encoder, subset) + scale_names(encoder, scales)
    padded = TaskModel(copy.deepcopy(encoder), copy.deepcopy(head), kind, pooling)
    set_dropout(padded.encoder, 0.0)
    padded.train()
    padded.requires_grad_(False)
    params: dict[str, torch.Tensor] = dict(bias_parameters(padded.encoder))
    start = {}
    if scales == "ia3":  # (IA)^3 scales away from 1 (so the value fold carries one), differentiable in the hooks
        g = torch.Generator().manual_seed(2)
        start = {n: v + 0.2 * torch.randn(v.shape, generator=g) for n, v in ia3_base(encoder).items()}
        apply_values(padded.encoder, start)
        for name, module in ia3_sites(padded.encoder).items():
            params[name] = module.ia3_scale
    for name in trained:
        params[name].requires_grad_(True)
    padded.head.requires_grad_(True)
    packed = PackedTaskModel(encoder, [head], kind, pooling, trained).train()
    with torch.no_grad():  # the run's scales start where the padded model's do
        for name, value in packed.values(0).items():
            if name in start:
                value.copy_(start[name])

    batch = _batch(tiny_encoder.tokenizer, kind, n_out)
    args = (batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    want, got = padded(*args), packed(*args)
    keep = batch["labels"] != -100 if kind == "token-classification" else slice(None)
    torch.testing.assert_close(got[keep], want[keep], rtol=0, atol=1e-5)
    loss_fn(kind, want, batch["labels"]).backward()
    loss_fn(kind, got, batch["labels"]).backward()
    assert packed.bank.grad is not None
    biases = {n: packed.bank.grad[0, a:b] for n, (a, b) in packed.columns.items()}
    if scales != "none":  # every scale is trained and gets a gradient from both models
        sites = [n for n in trained if n in ia3_sites(encoder)]
        assert sites and all(params[n].grad is not None and params[n].grad.abs().max() > 0 for n in sites)
    for name in trained:
        # None counts as zero: the key bias gets no gradient from the packed model (it is dropped: softmax ignores
        # it) and only rounding noise from the padded one; an unused pooler gets none from either
        actual = biases[name]
        expected = torch.zeros_like(actual) if params[name].grad is None else params[name].grad
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(packed.head_weight.grad[0], padded.head.weight.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(packed.head_bias.grad[0], padded.head.bias.grad, rtol=1e-4, atol=1e-6)


def test_runs_in_one_batch_keep_to_their_own_biases_and_leave_the_encoder_alone(tiny_encoder):
    encoder = copy.deepcopy(tiny_encoder.model)
    before = {n: p.detach().clone() for n, p in encoder.named_parameters()}
    heads = []
    for seed in range(3):
        torch.manual_seed(seed)
        heads.append(nn.Linear(tiny_encoder.hidden_size, 3))
    trained = target_names(encoder, "all")
    packed = PackedTaskModel(encoder, heads, "classification", "cls", trained)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for run in range(3):
            for value in packed.values(run).values():
                value.add_(0.2 * torch.randn(value.shape, generator=g))
    batch = _batch(tiny_encoder.tokenizer, "classification", 3)
    run = torch.tensor([2, 0, 1, 2, 0])
    packed.eval()
    got = packed(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], run=run)
    for i, r in enumerate(run.tolist()):
        alone = packed.task_model(r)
        row = batch["attention_mask"][i].bool()
        want = alone(batch["input_ids"][i : i + 1, row], batch["attention_mask"][i : i + 1, row])
        torch.testing.assert_close(got[i : i + 1], want, rtol=0, atol=1e-5)
    # a step trains the runs, never the shared encoder
    packed.train()
    loss_fn("classification", packed(batch["input_ids"], batch["attention_mask"], run=run), batch["labels"]).backward()
    assert all(p.grad is None for p in encoder.parameters())
    assert all(torch.equal(p, before[n]) for n, p in encoder.named_parameters())
    assert packed.head_weight.grad is not None and all(packed.head_weight.grad[r].any() for r in range(3))
    # a run with no row in the batch gets no gradient
    packed.zero_grad(set_to_none=True)
    only = torch.zeros(5, dtype=torch.long)
    loss_fn("classification", packed(batch["input_ids"], batch["attention_mask"], run=only), batch["labels"]).backward()
    assert packed.head_weight.grad is not None and packed.head_weight.grad[0].any()
    assert not packed.head_weight.grad[1].any() and not packed.bank.grad[1].any()


def test_models_of_several_jobs_encode_together_as_each_would_alone(tiny_encoder):
    """Three jobs' models (a classifier, a pooler regressor, a tagger; 2, 1 and 3 runs) over one training_bert: the
    joint forward gives each model its own forward's logits, and the summed losses each run's own gradients."""
    encoder = _perturbed(tiny_encoder.model, seed=2)
    shared = training_bert(encoder)
    jobs = [("classification", "mean", "all", 3, 2), ("regression", "pooler", "all", 1, 1)]
    jobs.append(("token-classification", "cls", "query-intermediate", 4, 3))
    models, batches, runs = [], [], []
    g = torch.Generator().manual_seed(7)
    for j, (kind, pooling, subset, n_out, n_runs) in enumerate(jobs):
        heads = []
        for r in range(n_runs):
            torch.manual_seed(10 * j + r)
            heads.append(nn.Linear(tiny_encoder.hidden_size, n_out))
        model = PackedTaskModel(encoder, heads, kind, pooling, target_names(encoder, subset), packed=shared)
        with torch.no_grad():
            for r in range(n_runs):
                for value in model.values(r).values():
                    value.add_(0.2 * torch.randn(value.shape, generator=g))
        models.append(model.train())
        batches.append(_batch(tiny_encoder.tokenizer, kind, n_out, seed=j))
        runs.append(torch.arange(len(SENTENCES)) % n_runs)
    parts = [
        (m, b["input_ids"], b["attention_mask"], b["token_type_ids"], r)
        for m, b, r in zip(models, batches, runs, strict=True)
    ]
    together = joint_forward(parts)
    sum(loss_fn(m.kind, out, b["labels"]) for m, out, b in zip(models, together, batches, strict=True)).backward()
    joint_grads = [[p.grad.clone() if p.grad is not None else None for p in m.parameters()] for m in models]
    for m, out, b, part, grads in zip(models, together, batches, parts, joint_grads, strict=True):
        m.zero_grad(set_to_none=True)
        alone = m(*part[1:])
        torch.testing.assert_close(out, alone, rtol=0, atol=1e-5)
        loss_fn(m.kind, alone, b["labels"]).backward()
        for p, joint_grad in zip(m.parameters(), grads, strict=True):
            want = torch.zeros_like(p) if p.grad is None else p.grad
            got = torch.zeros_like(p) if joint_grad is None else joint_grad
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="one PackedBert"):  # a model over its own PackedBert cannot join
        own = PackedTaskModel(encoder, [nn.Linear(tiny_encoder.hidden_size, 2)], "classification", "mean", [])
        joint_forward([parts[0], (own.train(), *parts[0][1:4], None)])
    with pytest.raises(ValueError, match="training_bert"):
        PackedTaskModel(
            tiny_encoder.model, [nn.Linear(tiny_encoder.hidden_size, 2)], "regression", "mean", [], packed=shared
        )


def test_packing_with_lengths_from_the_host_equals_reading_the_mask(tiny_encoder):
    """``collate``'s host-side lengths (the trainer's path: no read-back from the device) give the same packed batch
    as the attention mask, for a batch of several runs."""
    batch = _batch(tiny_encoder.tokenizer, "token-classification", 3)
    model = PackedTaskModel(
        tiny_encoder.model, [nn.Linear(tiny_encoder.hidden_size, 3)] * 2, "token-classification", "cls", []
    )
    run = torch.tensor([0, 1, 1, 0, 1])
    args = (batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], run)
    (a, len_a), (b, len_b) = model.pack(*args), model.pack(*args, batch["lengths"].tolist())
    assert len_a == len_b == batch["attention_mask"].sum(1).tolist() and a.max_len == b.max_len == max(len_a)
    for field in ("ids", "types", "pos", "tok_slot", "seg", "cu", "row_slot", "row_mode"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert a.cu.dtype == torch.int32  # flash attention's offsets
    assert torch.equal(a.ids, batch["input_ids"][batch["attention_mask"].bool()])
    assert torch.equal(a.tok_slot, run.repeat_interleave(batch["attention_mask"].sum(1)))


@pytest.mark.parametrize("scales", ["none", "ia3"])
def test_gathering_a_layers_banks_together_equals_one_gather_each(tiny_encoder, scales):
    """On a GPU the trainer gathers each layer's banks in one op (``gather_by_layer``): the same token states and
    the same gradients as a gather per bank."""
    encoder = _perturbed(tiny_encoder.model, seed=3)
    trained = target_names(encoder, "all") + scale_names(encoder, scales)
    heads = [nn.Linear(tiny_encoder.hidden_size, 2) for _ in range(3)]
    model = PackedTaskModel(encoder, heads, "classification", "mean", trained)
    with torch.no_grad():
        model.bank.add_(0.05 * torch.randn(model.bank.shape, generator=torch.Generator().manual_seed(4)))
    batch = _batch(tiny_encoder.tokenizer, "classification", 2)
    b, lengths = model.pack(batch["input_ids"], batch["attention_mask"], run=torch.tensor([0, 1, 2, 1, 0]))
    add_exact_attention(b, lengths)
    outs, grads = [], []
    for by_layer in (False, True):
        model.bank.grad = None
        x = model.packed.encode(b, "exact", banks=model.banks(), gather_by_layer=by_layer)
        x.backward(torch.arange(x.numel(), dtype=x.dtype).view_as(x).cos())
        outs.append(x)
        grads.append(model.bank.grad)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    assert grads[0] is not None and grads[0].abs().sum() > 0


def test_training_precision_on_the_cpu_is_bfloat16_where_its_products_are_faster(monkeypatch):
    for native in (True, False):
        monkeypatch.setattr(packed_model, "cpu_bfloat16_is_faster", lambda native=native: native)
        assert training_dtype(torch.device("cpu")) == (torch.bfloat16 if native else None)
        assert training_dtype(torch.device("cpu"), "float32") is None
    with pytest.raises(ValueError, match="precision"):
        training_dtype(torch.device("cpu"), "float16")


def test_a_cpu_without_bfloat16_instructions_trains_in_float32_without_measuring(monkeypatch):
    """Having the instructions is measured (``cpu_bfloat16_is_faster``); lacking them is not: torch's emulated
    bfloat16 is slower than float32 everywhere."""
    measured: list[str] = []
    monkeypatch.setattr(packed_model, "cpu_has_bfloat16", lambda: False)
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: measured.append("linear"))
    cpu_bfloat16_is_faster.cache_clear()
    try:
        assert cpu_bfloat16_is_faster() is False and training_dtype(torch.device("cpu")) is None
        assert measured == []
    finally:
        cpu_bfloat16_is_faster.cache_clear()


def test_the_cpu_bfloat16_measure_times_both_products_and_is_kept(monkeypatch):
    """Where the instructions exist the decision is a timing of both products (here on this CPU, whichever way it
    goes), taken once a process."""
    calls: list[torch.dtype] = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(packed_model, "cpu_has_bfloat16", lambda: True)
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w: calls.append(w.dtype) or linear(x, w))
    cpu_bfloat16_is_faster.cache_clear()
    try:
        first = cpu_bfloat16_is_faster()
        assert isinstance(first, bool) and set(calls) == {torch.float32, torch.bfloat16}
        assert calls.count(torch.float32) == calls.count(torch.bfloat16) >= 5
        n = len(calls)
        assert cpu_bfloat16_is_faster() is first and len(calls) == n  # kept: not measured again
    finally:
        cpu_bfloat16_is_faster.cache_clear()


def test_bfloat16_products_use_copies_of_the_frozen_weights_made_once(tiny_encoder):
    packed = training_bert(tiny_encoder.model)
    copies = packed.product_weights(torch.bfloat16)
    assert packed.product_weights(torch.bfloat16) is copies  # made once: the weights never change
    assert len(copies) == len(packed.layers)
    for layer, weights in zip(packed.layers, copies, strict=True):
        for w, full in zip(weights, (layer.wqkv, layer.wo, layer.wi, layer.wf), strict=True):
            assert w.dtype == torch.bfloat16 and not w.requires_grad and full.dtype == torch.float32
            torch.testing.assert_close(w.float(), full, rtol=2**-8, atol=0)


@pytest.mark.parametrize("n", [1, PRODUCT_BUCKET - 1, PRODUCT_BUCKET, 2 * PRODUCT_BUCKET + 5])
@pytest.mark.parametrize("bias_rows", ["per token", "one row"])
def test_a_half_product_over_padded_tokens_is_the_half_product_of_its_own_rows(n, bias_rows):
    """``half_product`` pads the tokens to a bucket for the product and cuts the padding off: every output row and
    every gradient is the unpadded bfloat16 product's (each row alone), the bias's gradient summed where one row was
    broadcast to every token."""
    torch.manual_seed(0)
    w32 = torch.randn(24, 16)
    w = w32.to(torch.bfloat16)
    x = torch.randn(n, 16, requires_grad=True)
    bias = torch.randn(n if bias_rows == "per token" else 1, 24, requires_grad=True)
    got = half_product(x, w, bias)
    assert got.shape == (n, 24) and got.dtype == torch.float32
    # each row by itself, in bfloat16, with its bias added in float32
    rows = torch.cat([F.linear(x[i : i + 1].detach().to(torch.bfloat16), w).float() for i in range(n)])
    torch.testing.assert_close(got, bias.detach() + rows, rtol=2**-7, atol=1e-6)
    grad = torch.randn(n, 24)
    got.backward(grad)
    assert x.grad is not None and bias.grad is not None and w.grad is None
    want_x = torch.cat([(grad[i : i + 1].to(torch.bfloat16) @ w).float() for i in range(n)])
    torch.testing.assert_close(x.grad, want_x, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(bias.grad, grad if bias_rows == "per token" else grad.sum(0, keepdim=True))
    # and the float32 product's to bfloat16's rounding
    assert _relative(got, bias.detach() + x.detach() @ w32.t()) < 0.01


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).detach().norm() / want.detach().norm().clamp(min=1e-12))


HALF_DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not cpu_has_bfloat16(), reason="this CPU has no bfloat16 instructions")
    ),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


@pytest.mark.parametrize("device", HALF_DEVICES)
@pytest.mark.parametrize("case", ["classification-mean", "regression-pooler", "tagging", "ia3-classification"])
def test_bfloat16_training_matches_the_exact_float32_model(tiny_encoder, case, device):
    """The trainer's default where the device has it: on CUDA bfloat16 autocast with variable-length flash attention
    and its backward; on the CPU the frozen weights' products in bfloat16, the rest float32. Its logits and every
    gradient are the exact float32 model's to bfloat16's rounding; with dropout it stays finite."""
    kind, pooling, subset, n_out, scales = CASES[case]
    encoder = _perturbed(tiny_encoder.model, seed=1).to(device)
    trained = target_names(encoder, subset) + scale_names(encoder, scales)
    torch.manual_seed(0)
    head = nn.Linear(tiny_encoder.hidden_size, n_out)
    shared = training_bert(encoder)
    exact = PackedTaskModel(encoder, [head], kind, pooling, trained, packed=shared).train()
    half = torch.bfloat16  # (on a CPU whose float32 products are faster, what precision=auto would not choose)
    fast = PackedTaskModel(encoder, [head], kind, pooling, trained, packed=shared, half_dtype=half).train()
    assert exact.joint_key() != fast.joint_key()
    batch = _batch(tiny_encoder.tokenizer, kind, n_out, device=device)
    args = (batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], None, batch["lengths"].tolist())
    want, got = exact(*args), fast(*args)
    keep = batch["labels"] != -100 if kind == "token-classification" else slice(None)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert 0 < _relative(got[keep], want[keep]) < 0.02  # rounded (so the half path ran), and only rounded
    loss_fn(kind, want, batch["labels"]).backward()
    loss_fn(kind, got, batch["labels"]).backward()
    assert fast.bank.grad is not None and exact.bank.grad is not None
    assert _relative(fast.bank.grad, exact.bank.grad) < 0.05
    assert _relative(fast.head_weight.grad, exact.head_weight.grad) < 0.05
    noisy = PackedTaskModel(
        encoder, [head], kind, pooling, trained, hidden_dropout=0.1, attention_dropout=0.1, half_dtype=half
    )
    noisy.train()
    first = noisy(*args)
    loss_fn(kind, first, batch["labels"]).backward()
    assert noisy.bank.grad is not None and torch.isfinite(noisy.bank.grad).all()
    assert not torch.equal(first, noisy(*args))  # the masks (attention's too) are drawn anew


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_train_patch_on_a_gpu_trains_in_bfloat16_unless_asked_for_float32(tmp_path, tiny_encoder):
    train, dev = training_data(tmp_path, "classification", n_train=64, n_dev=16)
    fast = train_patch(tiny_encoder, train, dev, train_config(min_steps=8, eval_every=4, device="cuda"))
    exact = train_patch(
        tiny_encoder, train, dev, train_config(min_steps=8, eval_every=4, device="cuda", precision="float32")
    )
    assert fast.report["precision"] == "bfloat16" and exact.report["precision"] == "float32"
    assert fast.patch is not None and exact.patch is not None
    assert set(fast.patch.biases) == set(exact.patch.biases)
    assert all(torch.isfinite(v).all() for v in fast.patch.biases.values())
    assert fast.report["steps"] == exact.report["steps"] == 8


def test_train_patch_on_the_cpu_trains_in_bfloat16_where_the_cpu_has_it(tmp_path, tiny_encoder, monkeypatch):
    """On a CPU with bfloat16 products the default run's report says bfloat16 and its patch differs from the
    float32 run's only by rounding; on one without (or with precision=float32) it trains in float32."""
    train, dev = training_data(tmp_path, "classification", n_train=64, n_dev=16)
    runs = {}
    for native, precision in ((True, "auto"), (False, "auto"), (True, "float32")):
        monkeypatch.setattr(packed_model, "cpu_bfloat16_is_faster", lambda native=native: native)
        config = train_config(min_steps=8, eval_every=4, precision=precision, checkpoint="last")
        runs[native, precision] = train_patch(tiny_encoder, train, dev, config)
    fast, plain, exact = runs[True, "auto"], runs[False, "auto"], runs[True, "float32"]
    assert fast.report["precision"] == "bfloat16"
    assert plain.report["precision"] == exact.report["precision"] == "float32"
    assert fast.patch is not None and exact.patch is not None and plain.patch is not None
    for name, value in exact.patch.biases.items():
        torch.testing.assert_close(plain.patch.biases[name], value)  # float32 either way: the same run
        assert torch.isfinite(fast.patch.biases[name]).all()
    moved = torch.cat([(fast.patch.biases[n] - v).flatten() for n, v in exact.patch.biases.items()])
    assert 0 < float(moved.abs().max()) < 0.05  # bfloat16's products: close to the float32 run, not equal


def test_dropout_is_applied_in_training_only(tiny_encoder):
    trained = target_names(tiny_encoder.model, "all")
    torch.manual_seed(0)
    head = nn.Linear(tiny_encoder.hidden_size, 2)
    noisy = PackedTaskModel(tiny_encoder.model, [head], "classification", "mean", trained, hidden_dropout=0.3)
    clean = PackedTaskModel(tiny_encoder.model, [head], "classification", "mean", trained)
    batch = _batch(tiny_encoder.tokenizer, "classification", 2)
    args = (batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    noisy.train()
    a, b = noisy(*args), noisy(*args)
    assert not torch.allclose(a, b)
    noisy.eval()
    torch.testing.assert_close(noisy(*args), clean.eval()(*args), rtol=0, atol=0)
    attention = PackedTaskModel(tiny_encoder.model, [head], "classification", "mean", trained, attention_dropout=0.3)
    attention.train()
    assert not torch.allclose(attention(*args), attention(*args))


def test_keep_masks_keep_each_element_independently_at_the_rate_asked():
    n = 4_000_000
    for keep in (0.9, 0.5, 0.03):
        torch.manual_seed(1)
        mask = keep_mask((n,), keep)
        sigma = (keep * (1 - keep) / n) ** 0.5
        assert abs(float(mask.float().mean()) - keep) < 5 * sigma, (keep, "all")
        # each of the four 16-bit quarters of a 64-bit draw (positions mod 4), and neighbours within and across draws
        quarters = mask.view(-1, 4).float()
        for q in range(4):
            assert abs(float(quarters[:, q].mean()) - keep) < 5 * sigma * 2, (keep, q)
        pair_sigma = 5 * (keep**2 * (1 - keep**2) / (n // 4)) ** 0.5
        for a, b in ((0, 1), (1, 2), (2, 3)):
            both = (quarters[:, a] * quarters[:, b]).mean()
            assert abs(float(both) - keep**2) < pair_sigma, (keep, a, b, both)
        across = (quarters[:-1, 3] * quarters[1:, 0]).mean()
        assert abs(float(across) - keep**2) < pair_sigma, (keep, "across", across)
    torch.manual_seed(7)
    first = keep_mask((3, 1001), 0.5)
    torch.manual_seed(7)
    assert torch.equal(keep_mask((3, 1001), 0.5), first)  # torch.manual_seed governs it
    assert first.shape == (3, 1001) and not torch.equal(keep_mask((3, 1001), 0.5), first)


def test_dropout_zeroes_and_rescales_and_its_gradient_uses_the_same_mask():
    x = torch.randn(64, 257, requires_grad=True)
    assert dropout(x, 0.0) is x
    y = dropout(x, 0.25)
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    assert 0.6 < kept.float().mean() < 0.9
    y.backward(torch.ones_like(y))
    assert x.grad is not None
    torch.testing.assert_close(x.grad, kept.float() / 0.75)


def test_attention_grouped_by_length_equals_the_padded_one(tiny_encoder):
    """A trainer's batch on the CPU attends with its rows grouped by length (patches/packed_attention.py), its
    dropout written out (so its mask is ``keep_mask``'s): at a rate that never drops it must give the padded fused
    path's values and gradients, rows of every length, padding tokens and masked keys included."""
    packed = training_bert(tiny_encoder.model)
    batch = _batch(tiny_encoder.tokenizer, "classification", 2)
    model = PackedTaskModel(tiny_encoder.model, [nn.Linear(tiny_encoder.hidden_size, 2)], "classification", "mean", [])
    b, lengths = model.pack(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    add_exact_attention(b, lengths)
    groups = attention_groups(lengths, packed.n_heads)
    assert len(set(lengths)) > 2 and 1 < len(groups.shapes) < len(lengths)  # grouped: neither one group nor a row each
    torch.manual_seed(0)
    qkv = torch.randn(sum(lengths), 3 * packed.hidden)
    outs, grads = [], []
    for rate, grouped in ((0.0, None), (1e-12, groups), (0.0, groups)):  # 1e-12: keep rounds to 1, no mask drops
        b.groups = grouped
        leaf = qkv.clone().requires_grad_()
        out = packed._attend(leaf, b, "exact", rate)
        out.backward(torch.arange(out.numel(), dtype=out.dtype).view_as(out).sin())
        outs.append(out)
        grads.append(leaf.grad)
    for out, grad in zip(outs[1:], grads[1:], strict=True):
        torch.testing.assert_close(out, outs[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(grad, grads[0], rtol=0, atol=1e-5)


def test_length_groups_cut_the_sorted_rows_where_the_work_is_least():
    """Each row in exactly one group, groups of consecutive lengths, and the cuts the cheapest of all cuts of the
    sorted rows (checked against every one of them)."""
    rng = random.Random(3)
    for _ in range(30):
        lengths = [rng.randint(1, 80) for _ in range(rng.randint(1, 10))]
        groups = length_groups(lengths, group_cost=500)
        assert sorted(int(i) for g in groups for i in g) == list(range(len(lengths)))
        spans = [(min(lengths[i] for i in g), max(lengths[i] for i in g)) for g in groups]
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))

        def cost(sizes: list[int], ordered: list[int]) -> float:
            total, start = 0.0, 0
            for size in sizes:
                total += 500 + size * ordered[start + size - 1] ** 2
                start += size
            return total

        ordered = sorted(lengths)
        n = len(ordered)
        best = min(
            cost([b - a for a, b in itertools.pairwise([0, *cuts, n])], ordered)
            for k in range(n)
            for cuts in itertools.combinations(range(1, n), k)
        )
        assert cost([len(g) for g in groups], ordered) == best


def test_train_patch_packs_bitfit_and_pads_full_fine_tuning(tmp_path, tiny_encoder):
    train, dev = training_data(tmp_path, "classification", n_train=64, n_dev=16)
    packed = train_patch(tiny_encoder, train, dev, train_config(min_steps=4, eval_every=2))
    assert packed.report["forward"] == "packed"
    assert packed.patch is not None
    assert isinstance(packed.model, TaskModel)  # the chosen run as a plain model
    full = train_patch(tiny_encoder, train, dev, train_config(min_steps=4, eval_every=2, full=True))
    assert full.report["forward"] == "padded"
    with pytest.raises(EncoderError, match="full fine-tuning"):
        train_patch(tiny_encoder, train, dev, train_config(full=True), packed=True)


def _dev_logits(result, encoder, dev):
    feats = featurize(encoder.tokenizer, dev, dev.labels, 128)
    b = collate(feats, 0, dev.kind, torch.device("cpu"))
    with torch.no_grad():
        return result.model(b["input_ids"], b["attention_mask"], b["token_type_ids"])


@pytest.mark.parametrize("patience", [100, 1])
def test_runs_in_one_batch_equal_the_same_runs_one_by_one(tmp_path, tiny_encoder, patience):
    """In float32: bfloat16's products round each run's rows differently in a batch of other rows."""
    train, dev = training_data(tmp_path, "classification", n_train=96, n_dev=32)
    exact = {"precision": "float32"}
    config = train_config(
        min_steps=24, eval_every=4, patience=patience, dropout=0.0, lr_search=[1e-2, 3e-3], restarts=2, **exact
    )
    together = train_patch(tiny_encoder, train, dev, config)
    assert together.report["selection"]["tried"] == 4
    assert together.report["forward"] == "packed"
    alone = {}
    for lr in (1e-2, 3e-3):
        for seed in (config.seed, config.seed + 1):
            one = train_config(
                min_steps=24, eval_every=4, patience=patience, dropout=0.0, lr=lr, seed=seed, restarts=1, **exact
            )
            alone[(lr, seed)] = train_patch(tiny_encoder, train, dev, one)
    for run in together.report["runs"]:
        ref = alone[(run["lr"], run["seed"])].report
        assert run["steps"] == ref["steps"] and run["best_step"] == ref["best_step"]
        for k, v in ref["dev"].items():
            assert run["best_dev"][k] == pytest.approx(v, abs=1e-6)
    best = alone[(together.report["lr"], together.report["seed"])]
    assert together.patch is not None and best.patch is not None
    # float32 rounds a run's rows differently in a batch of other rows, and Adam's normalised steps (24 of up to
    # 1e-2) carry that into the values: 1.1e-5 at most on an Intel Xeon (AVX-512, 2026-12-02), a thousandth of a step
    for name, value in best.patch.biases.items():
        torch.testing.assert_close(together.patch.biases[name], value, rtol=0, atol=3e-5, msg=name)
    torch.testing.assert_close(together.patch.head_weight, best.patch.head_weight, rtol=0, atol=3e-5)
    if patience == 100:  # the padded model, one run: the same predictions (its key biases drift on rounding noise,
        # which Adam scales up, but no output depends on them)
        one = train_config(min_steps=24, eval_every=4, dropout=0.0, lr=1e-2, seed=config.seed, restarts=1, **exact)
        padded = train_patch(tiny_encoder, train, dev, one, packed=False)
        assert padded.report["forward"] == "padded"
        ref = _dev_logits(alone[(1e-2, config.seed)], tiny_encoder, dev)
        torch.testing.assert_close(_dev_logits(padded, tiny_encoder, dev), ref, rtol=0, atol=1e-3)


def test_averaged_restarts_train_packed_as_padded_one_by_one(tmp_path, tiny_encoder):
    # small data: 3 automatic restarts, averaged; the padded model trains them one after another, each a model of
    # its own, and averages those models: the same patch as the packed runs' average
    train, dev = training_data(tmp_path, "classification", n_train=96, n_dev=32)
    config = train_config(min_steps=24, eval_every=4, dropout=0.0, restarts=None)
    packed = train_patch(tiny_encoder, train, dev, config)
    padded = train_patch(tiny_encoder, train, dev, config, packed=False)
    assert (packed.report["forward"], padded.report["forward"]) == ("packed", "padded")
    assert packed.report["merged"][0]["seeds"] == padded.report["merged"][0]["seeds"] == [0, 1, 2]
    torch.testing.assert_close(
        _dev_logits(padded, tiny_encoder, dev), _dev_logits(packed, tiny_encoder, dev), rtol=0, atol=1e-3
    )
    assert packed.patch is not None and padded.patch is not None
    torch.testing.assert_close(padded.patch.head_weight, packed.patch.head_weight, rtol=0, atol=1e-3)
