"""The packed engine: every fold is exact, padding never leaks into a row, heads live in one bank, graphs on CUDA."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from patchserve.patches.encoder import load_encoder
from patchserve.patches.model import TaskModel, pool
from patchserve.patches.packed import PackedBert, packed_unsupported
from patchserve.patches.packed_attention import length_groups
from patchserve.server.engine.packed_backend import PackedBackend
from patchserve.server.engine.protocol import Row
from patchserve.server.engine.rows import RowBlock
from patchserve.server.engine.runner import DTYPES, Runner
from patchserve.server.engine.slotted import SlottedBackend
from tests.helpers import make_patch
from tests.test_engine import SENTENCES, _reference, _rows

FOLDS = {  # (drop b_k, fold b_v into b_o, fold every LayerNorm beta forward)
    "none": (False, False, False),
    "drop-k": (True, False, False),
    "fold-v": (False, True, False),
    "fold-ln": (False, False, True),
    "all": (True, True, True),
}


def _mixed_rows(encoder, patches, n=30, seed=0):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        rows += _rows(encoder, patches[i % len(patches)], [rng.choice(SENTENCES)])
    rng.shuffle(rows)
    return rows


def _base_embedding(encoder, row):
    ids = torch.tensor([row.input_ids])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = encoder.model(input_ids=ids, attention_mask=mask, token_type_ids=torch.tensor([row.token_type_ids]))
    return pool(encoder.default_pooling, out.last_hidden_state, mask, None)[0]


@pytest.mark.parametrize("fold", list(FOLDS), ids=list(FOLDS))
def test_each_fold_is_exact_in_a_mixed_batch(tiny_bert_dir, tiny_encoder, task_patches, fold):
    drop_k, fold_v, fold_ln = FOLDS[fold]
    runner = Runner(
        load_encoder(str(tiny_bert_dir)),
        device="cpu",
        slots=8,
        engine="packed",
        drop_key_bias=drop_k,
        fold_value_bias=fold_v,
        fold_ln_bias=fold_ln,
    )
    assert isinstance(runner.backend, PackedBackend)
    rows = _mixed_rows(tiny_encoder, task_patches)
    rows.append(Row(rows[0].input_ids, rows[0].token_type_ids, None, output="embedding"))  # the base encoder
    rows.append(Row(rows[1].input_ids, rows[1].token_type_ids, rows[1].patch, output="embedding"))
    got = runner.run(rows)
    assert len(got) == len(rows)
    for row, out in zip(rows[:-2], got, strict=False):
        torch.testing.assert_close(out, _reference(tiny_encoder.model, row.patch, row), rtol=0, atol=1e-5)
    torch.testing.assert_close(got[-2], _base_embedding(tiny_encoder, rows[-2]), rtol=0, atol=1e-5)
    tuned = TaskModel.from_patch(copy.deepcopy(tiny_encoder.model), rows[-1].patch).eval()
    ids = torch.tensor([rows[-1].input_ids])
    with torch.no_grad():
        out = tuned.encoder(input_ids=ids, attention_mask=torch.ones_like(ids))
    want = pool(rows[-1].patch.meta.pooling, out.last_hidden_state, torch.ones_like(ids), out.pooler_output)[0]
    torch.testing.assert_close(got[-1], want, rtol=0, atol=1e-5)


def test_rows_of_far_apart_lengths_attend_in_groups_exactly(tiny_bert_dir, tiny_encoder, task_patches):
    """On the CPU a batch's rows attend grouped by length (each group padded to its own longest row): rows from 3 to
    64 (the tiny model's positions) in one batch, several groups, each row what the plain model gives it alone."""
    runner = Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=8, engine="packed")
    texts = [" ".join([SENTENCES[i % len(SENTENCES)]] * (1 + (7 * i) % 11)) for i in range(24)]
    enc = tiny_encoder.tokenizer(texts, truncation=True, max_length=64)
    rows = [
        Row(ids, tt, task_patches[i % len(task_patches)])
        for i, (ids, tt) in enumerate(zip(enc["input_ids"], enc["token_type_ids"], strict=True))
    ]
    lengths = [len(r.input_ids) for r in rows]
    assert min(lengths) < 10 and max(lengths) == 64 and len(length_groups(lengths)) >= 3
    for row, out in zip(rows, runner.run(rows), strict=True):
        torch.testing.assert_close(out, _reference(tiny_encoder.model, row.patch, row), rtol=0, atol=1e-5)


def test_all_folds_leave_four_vectors_per_layer(tiny_encoder):
    folded = PackedBert(copy.deepcopy(tiny_encoder.model), 2)
    plain = PackedBert(copy.deepcopy(tiny_encoder.model), 2, fold_ln_bias=False)
    assert folded.vectors_per_layer == 4 and plain.vectors_per_layer == 6
    assert "emb_ln" not in folded.banks and "out" in folded.banks


def test_row_alone_equals_row_in_the_mix(tiny_bert_dir, tiny_encoder, task_patches):
    runner = Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=8)
    rows = _mixed_rows(tiny_encoder, task_patches, n=16, seed=3)
    mixed = runner.run(rows)
    for row, out in zip(rows, mixed, strict=True):
        torch.testing.assert_close(runner.run([row])[0], out, rtol=0, atol=1e-5)


def test_head_bank_grows_for_a_task_with_more_labels(tiny_bert_dir, tiny_encoder):
    runner = Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=4)
    small = make_patch(tiny_encoder, "small", seed=1)
    wide = make_patch(tiny_encoder, "wide", seed=2, labels=[f"l{i}" for i in range(40)])
    first = runner.run(_rows(tiny_encoder, small, ["the movie"]))
    before = runner.backend.head_bank.generation
    rows = _rows(tiny_encoder, small, ["the movie"]) + _rows(tiny_encoder, wide, ["a bad film"])
    got = runner.run(rows)
    assert runner.backend.head_bank.generation > before and got[1].shape == (40,)
    torch.testing.assert_close(got[0], first[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], _reference(tiny_encoder.model, wide, rows[1]), rtol=0, atol=1e-5)


def test_other_architectures_use_the_slotted_engine(tiny_bert_dir):
    assert packed_unsupported(torch.nn.Linear(2, 2)) is not None
    runner = Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=2, engine="slotted")
    assert isinstance(runner.backend, SlottedBackend)
    with pytest.raises(ValueError, match="engine must be one of"):
        Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=2, engine="fast")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_serve_any_mix_exactly(minilm):
    """float16 with CUDA graphs: rows of mixed batches (different mixes, row counts up to 200, lengths; one bucket
    reused) are about as far from the float32 reference as the plain HF model of their task in float16: within 1.25x
    its mean error. A bitfit-ia3 patch joins after the first batch: its scale banks replace the graphs' inputs, so they
    are captured again (into a fresh memory pool)."""
    runner = Runner(load_encoder("default"), device="cuda", dtype="float16", slots=16)
    assert runner.backend.graphs is not None
    patches = [
        make_patch(minilm, f"t{i}", seed=i, scale=0.05, subset=("all", "query-intermediate")[i % 2]) for i in range(6)
    ]
    patches.append(make_patch(minilm, "tags", seed=9, scale=0.05, kind="token-classification"))
    gained = make_patch(minilm, "scales", seed=11, scale=0.05, ia3_scale=0.05)
    texts = ["A plane is taking off.", "What is the capital of Chile?", "Great film!", *SENTENCES]
    plain = {
        p.patch_id: TaskModel.from_patch(copy.deepcopy(minilm.model), p).eval().to("cuda", DTYPES["float16"])
        for p in [*patches, gained]
    }
    errors: dict[str, list[float]] = {"engine": [], "plain": []}
    for trial, n in enumerate((32, 5, 31, 200)):  # 200: a GPU server batches up to 256 rows by default
        rng = random.Random(trial)
        rows = []
        for _ in range(n):
            rows += _rows(minilm, rng.choice(patches if trial == 0 else [*patches, gained]), [rng.choice(texts)])
        if trial > 0:
            rows += _rows(minilm, gained, [rng.choice(texts)])
        generation = runner.backend.graphs.generation
        got = runner.run(rows)
        assert runner.backend.graphs is not None, "CUDA graphs were turned off (a capture failed: see the log)"
        if trial == 1:  # the first bitfit-ia3 patch: scale banks, so the graphs read new tensors
            assert runner.backend.packed.scales and runner.backend.graphs.generation != generation
        for row, out in zip(rows, got, strict=True):
            ref = _reference(minilm.model, row.patch, row)
            ids = torch.tensor([row.input_ids], device="cuda")
            with torch.no_grad():
                alone = plain[row.patch.patch_id](ids, torch.ones_like(ids), torch.zeros_like(ids)).float().cpu()[0]
            assert out.shape == ref.shape and torch.isfinite(out).all()
            errors["engine"].append(((out - ref).norm() / ref.norm()).item())
            errors["plain"].append(((alone - ref).norm() / ref.norm()).item())
    mean = {k: sum(v) / len(v) for k, v in errors.items()}
    assert mean["engine"] <= 1.25 * mean["plain"], mean
    assert max(errors["engine"]) <= 2 * max(errors["plain"]), errors
    assert len(runner.backend.graphs._graphs) >= 1


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))],
)
def test_batcher_overlaps_two_batches(tiny_bert_dir, tiny_encoder, device):
    """With overlap_batches the batcher launches the next batch before it finishes the last one (on a GPU the host
    prepares it while the device runs), also when the two need more slots than there are (it finishes the first,
    then retries), and every row still gets what its task gives alone."""
    import asyncio

    from patchserve.server.engine.batcher import Batcher

    dtype = "float16" if device == "cuda" else "float32"
    runner = Runner(load_encoder(str(tiny_bert_dir)), device=device, dtype=dtype, slots=3, overlap_batches=True)
    patches = [make_patch(tiny_encoder, f"t{i}", seed=i) for i in range(5)]
    rng = random.Random(5)
    rows = []
    for _ in range(60):
        rows += _rows(tiny_encoder, rng.choice(patches), [rng.choice(SENTENCES)])
    alone = [runner.run([r])[0] for r in rows]
    in_flight, most = 0, 0
    launch, finish = runner.launch, runner.finish

    def counted_launch(batch):
        nonlocal in_flight, most
        pending = launch(batch)
        in_flight += 1
        most = max(most, in_flight)
        return pending

    def counted_finish(pending):
        nonlocal in_flight
        in_flight -= 1
        return finish(pending)

    runner.launch, runner.finish = counted_launch, counted_finish  # type: ignore[method-assign]

    async def scenario():
        batcher = Batcher(runner, max_rows=4, max_wait_ms=1)
        batcher.start()
        jobs = [batcher.submit(RowBlock.from_rows([r])) for r in rows]
        outs = [torch.from_numpy(o.data) for o in await asyncio.gather(*(j.future for j in jobs))]
        await batcher.stop()
        return outs

    outs = asyncio.run(scenario())
    assert most == 2, "the next batch was never launched while one was in flight"
    assert in_flight == 0
    for got, want in zip(outs, alone, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 if device == "cpu" else 2e-3)


def test_a_batch_behind_a_finished_one_does_not_wait_for_company(tiny_bert_dir, tiny_encoder):
    """With overlap_batches, rows that arrive while a batch is launched wait behind it only while the device runs
    it: on the CPU a launched batch is already done, so they go at once, not after max_wait (a minute here)."""
    import asyncio
    import threading

    from patchserve.server.engine.batcher import Batcher

    runner = Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=2, overlap_batches=True)
    patch = make_patch(tiny_encoder, "t", seed=3)
    first, second = (_rows(tiny_encoder, patch, [text])[0] for text in SENTENCES[:2])
    second_queued = threading.Event()
    launch = runner.launch

    def held_launch(block):  # the first launch finishes only once the second row is queued behind it
        second_queued.wait(10)
        return launch(block)

    runner.launch = held_launch  # type: ignore[method-assign]

    async def scenario():
        batcher = Batcher(runner, max_rows=32, max_wait_ms=60_000)
        batcher.start()
        a = batcher.submit(RowBlock.from_rows([first]))
        await asyncio.sleep(0.1)  # the first batch is being launched (on the runner's thread)
        b = batcher.submit(RowBlock.from_rows([second]))
        second_queued.set()
        outs = await asyncio.wait_for(asyncio.gather(a.future, b.future), 30)
        await batcher.stop()
        return outs

    outs = asyncio.run(scenario())
    for out, row in zip(outs, (first, second), strict=True):
        torch.testing.assert_close(torch.from_numpy(out.data), runner.run([row])[0], rtol=0, atol=1e-5)
