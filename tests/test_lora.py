"""The lora patch kind: its format, and every row of a batch mixing bitfit, bitfit-ia3 and lora patches served as the
plain Hugging Face model with that task's values applied, on both engines (float32, CPU)."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from patchserve.patches.errors import PatchKeysError, PatchMetadataError, PatchShapeError
from patchserve.patches.format import LORA_A, LORA_B, Patch
from patchserve.patches.lora import targets_of
from patchserve.patches.packed import PackedBert
from patchserve.patches.packed_layout import add_exact_attention, batch_views, fill_layout, layout_size
from patchserve.patches.packed_lora import ROLE_SITE, LowRank
from patchserve.server.engine.rows import RowBlock
from patchserve.server.engine.runner import Runner
from tests.helpers import make_patch
from tests.test_engine import _reference, _rows
from tests.test_packed import _mixed_rows

ALL = ("query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense")


@pytest.fixture(scope="module")
def mixed_patches(tiny_encoder):
    return [
        make_patch(tiny_encoder, "plain", seed=1),
        make_patch(tiny_encoder, "qv", seed=2, lora_rank=4, pooling="cls", labels=["a", "b", "c"]),
        make_patch(tiny_encoder, "every", seed=3, lora_rank=2, lora_targets=ALL, kind="regression", pooling="pooler"),
        make_patch(tiny_encoder, "ia3", seed=4, ia3_scale=0.3),
        make_patch(
            tiny_encoder, "tags", seed=5, lora_rank=3, kind="token-classification", lora_targets=("key", "output.dense")
        ),
    ]


def test_lora_changes_the_outputs(tiny_encoder, mixed_patches):
    """The reference applies the factors: without them the same patch gives other outputs (so equality below is not
    two paths ignoring LoRA alike)."""
    patch = mixed_patches[2]
    row = _rows(tiny_encoder, patch, ["the movie was good"])[0]
    stripped = replace(patch, lora={}, meta=replace(patch.meta, patch_type="bitfit"))
    gap = (_reference(tiny_encoder.model, patch, row) - _reference(tiny_encoder.model, stripped, row)).abs().max()
    assert gap > 1e-2


@pytest.mark.parametrize("engine", ["packed", "slotted"])
@pytest.mark.parametrize("simplify", [True, False], ids=["folds", "no-folds"])
def test_mixed_batch_of_lora_ia3_and_bitfit_rows(tiny_bert_dir, tiny_encoder, mixed_patches, engine, simplify):
    from patchserve.patches.encoder import load_encoder

    folds = {"drop_key_bias": simplify, "fold_value_bias": simplify}
    if engine == "packed":
        folds["fold_ln_bias"] = simplify
    runner = Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=8, engine=engine, **folds)
    rows = _mixed_rows(tiny_encoder, mixed_patches)
    for row, out in zip(rows, runner.run(rows), strict=True):
        torch.testing.assert_close(out, _reference(tiny_encoder.model, row.patch, row), rtol=0, atol=1e-5)


def test_bitfit_server_holds_no_lora_until_a_lora_patch(tiny_encoder, mixed_patches):
    packed = PackedBert(copy.deepcopy(tiny_encoder.model), 4)
    packed.write_slots([0, 1], [mixed_patches[0].values, mixed_patches[3].values])
    assert packed.lora is None
    generation = packed.generation
    packed.write_slots([2], [mixed_patches[1].values])
    assert packed.lora is not None and packed.lora.resident == 1 and packed.generation > generation
    packed.write_slots([2], [mixed_patches[0].values])  # the slot reused by a BitFit task: its LoRA row is freed
    assert packed.lora.resident == 0 and int(packed.lora.rows[2]) == 0


def test_slots_keep_their_factors_when_the_bank_grows(tiny_bert_dir, tiny_encoder, mixed_patches):
    """A larger rank, a new site and more rows than the bank had reallocate it; the tasks loaded before still serve
    exactly."""
    from patchserve.patches.encoder import load_encoder

    runner = Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=16, engine="packed")
    first = _rows(tiny_encoder, mixed_patches[1], ["what a boring plot"])
    runner.run(first)
    more = [
        make_patch(tiny_encoder, f"t{i}", seed=10 + i, lora_rank=1 + i, lora_targets=ALL[i % 6 :]) for i in range(6)
    ]
    rows = first + [r for p in more for r in _rows(tiny_encoder, p, ["who is the actor"])]
    for row, out in zip(rows, runner.run(rows), strict=True):
        torch.testing.assert_close(out, _reference(tiny_encoder.model, row.patch, row), rtol=0, atol=1e-5)


def test_the_three_forms_of_the_low_rank_products_agree(tiny_encoder, mixed_patches):
    """The per-token gather (GPUs and CUDA graphs use it) and the stacked form (few factor rows) compute what the
    per-segment form (the CPU's) does; a batch without LoRA rows takes no product."""
    packed = PackedBert(copy.deepcopy(tiny_encoder.model), 6)
    packed.write_slots(list(range(5)), [p.values for p in mixed_patches])
    rows = _mixed_rows(tiny_encoder, mixed_patches, n=8, seed=3)
    block = RowBlock.from_rows(rows)
    slots = np.array([mixed_patches.index(r.patch) for r in rows])
    n, r = block.n_tokens, len(rows)
    flat = torch.empty(layout_size(n, r), dtype=torch.int32)
    fill_layout(flat.numpy(), block, slots, np.zeros(r, dtype=np.int64), n, r, 5)
    batch = batch_views(flat, n, r, int(block.lengths.max()))
    add_exact_attention(batch, block.lengths.tolist())
    assert packed.lora is not None
    segments = LowRank(packed.lora.factors, batch, form="segments")
    per_token = LowRank(packed.lora.factors, batch, form="tokens")
    stacked = LowRank(packed.lora.factors, batch, form="stacked")
    assert (segments.form, per_token.form, stacked.form) == ("segments", "tokens", "stacked")
    lora_rows = [i for i, r in enumerate(rows) if r.patch.lora]
    assert 0 < len(lora_rows) < len(rows)  # mixed: the BitFit rows have no segment
    assert {row for _, _, row in segments.segments} == {int(packed.lora.rows[int(slots[i])]) for i in lora_rows}
    layer = packed.layers[0]
    dims = {"qkv": layer.wqkv.shape, "o": layer.wo.shape, "i": layer.wi.shape, "f": layer.wf.shape}  # [out, in]
    sites = {f"{k.split('.')[0]}.{ROLE_SITE[k.split('.')[1]][0]}" for k in packed.lora.factors.a}
    assert {s.split(".")[1] for s in sites} == {"qkv", "o", "i", "f"}
    for key in sites:
        out_f, in_f = dims[key.split(".")[1]]
        x, zero = torch.randn(n, in_f), torch.zeros(n, out_f)
        got = per_token.add(key, x, zero)
        assert got.abs().max() > 0, key
        torch.testing.assert_close(got, segments.add(key, x, zero.clone()), rtol=0, atol=1e-5)
        torch.testing.assert_close(stacked.add(key, x, zero), got, rtol=0, atol=1e-5)
    bitfit_only = replace(packed.lora.factors, rows=torch.zeros_like(packed.lora.rows))  # every slot without LoRA
    none = LowRank(bitfit_only, batch, form="segments")
    assert none.form is None and none.add(next(iter(sites)), x, zero) is zero


def test_format_round_trip_and_summary(tiny_encoder, mixed_patches):
    from patchserve.patches.cli import patch_summary

    patch = mixed_patches[2]
    again = Patch.from_bytes(patch.data)
    assert again.patch_id == patch.patch_id and again.lora.keys() == patch.lora.keys()
    assert again.lora_rank == 2 and len(again.lora) == 2 * 6 * len(tiny_encoder.model.encoder.layer)
    again.check_compatible(tiny_encoder.spec)
    info = patch_summary(again)
    assert info["patch_type"] == "lora" and info["lora_rank"] == 2 and info["n_lora_tensors"] == len(again.lora)


def test_malformed_lora_patches_are_refused(tiny_encoder, mixed_patches):
    patch = mixed_patches[1]
    module = targets_of(tiny_encoder.model, ["query"])[0]
    a, b = patch.lora[module + LORA_A], patch.lora[module + LORA_B]
    lone = {k: v for k, v in patch.lora.items() if k != module + LORA_B}
    with pytest.raises(PatchKeysError, match=r"no \.lora_B pair"):
        replace(patch, lora=lone)
    with pytest.raises(PatchShapeError, match="one rank"):
        replace(patch, lora={**patch.lora, module + LORA_B: b[:, :-1]})
    with pytest.raises(PatchKeysError, match=r"needs 'lora\."):
        replace(patch, lora={})
    with pytest.raises(PatchKeysError, match=r"has no 'lora\."):
        replace(patch, meta=replace(patch.meta, patch_type="bitfit"))
    wide = replace(patch, lora={**patch.lora, module + LORA_A: torch.zeros(a.shape[0], a.shape[1] + 1)})
    with pytest.raises(PatchShapeError, match="this encoder needs"):
        wide.check_compatible(tiny_encoder.spec)
    pooler = {"pooler.dense" + LORA_A: a, "pooler.dense" + LORA_B: b}
    with pytest.raises(PatchKeysError, match="not a linear layer this encoder serves LoRA on"):
        replace(patch, lora={**patch.lora, **pooler}).check_compatible(tiny_encoder.spec)
    with pytest.raises(PatchMetadataError, match="not supported"):
        Patch.from_bytes(patch.data.replace(b'\\"patch_type\\":\\"lora\\"', b'\\"patch_type\\":\\"lorx\\"'))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_serve_lora_rows_as_closely_as_the_plain_model(minilm):
    """float16 with CUDA graphs (the per-token form): LoRA patches join after a BitFit batch (their factor banks
    replace the graphs' inputs: captured again), then grow the rank; every row is about as far from the float32
    reference as the plain HF model of its task in float16."""
    from patchserve.patches.encoder import load_encoder
    from patchserve.patches.model import TaskModel
    from patchserve.server.engine.runner import DTYPES

    runner = Runner(load_encoder("default"), device="cuda", dtype="float16", slots=16)
    assert runner.backend.graphs is not None
    plain_patches = [make_patch(minilm, f"b{i}", seed=i, scale=0.05) for i in range(3)]
    lora = [
        make_patch(
            minilm,
            f"l{i}",
            seed=10 + i,
            scale=0.05,
            lora_rank=4 + 4 * i,
            lora_targets=ALL[: 2 + 2 * i],
            lora_scale=0.05,
        )
        for i in range(3)
    ]
    errors: dict[str, list[float]] = {"engine": [], "plain": []}
    for trial, pool in enumerate((plain_patches, plain_patches + lora[:1], plain_patches + lora)):
        generation = runner.backend.graphs.generation
        rows = _mixed_rows(minilm, pool, n=24, seed=trial)
        got = runner.run(rows)
        assert runner.backend.graphs is not None, "CUDA graphs were turned off (a capture failed: see the log)"
        if trial > 0:
            assert runner.backend.graphs.generation != generation
        for row, out in zip(rows, got, strict=True):
            ref = _reference(minilm.model, row.patch, row)
            model = TaskModel.from_patch(copy.deepcopy(minilm.model), row.patch).eval().to("cuda", DTYPES["float16"])
            ids = torch.tensor([row.input_ids], device="cuda")
            with torch.no_grad():
                alone = model(ids, torch.ones_like(ids), torch.zeros_like(ids)).float().cpu()[0]
            errors["engine"].append(((out - ref).norm() / ref.norm()).item())
            errors["plain"].append(((alone - ref).norm() / ref.norm()).item())
    mean = {k: sum(v) / len(v) for k, v in errors.items()}
    assert mean["engine"] <= 1.25 * mean["plain"], mean
