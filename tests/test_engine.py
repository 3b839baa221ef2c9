"""The batched multi-task engine against the plain HF reference, row by row."""

from __future__ import annotations

import copy
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from patchserve.patches.encoder import load_encoder
from patchserve.patches.model import TaskModel
from patchserve.server.engine.packed_backend import PackedBackend
from patchserve.server.engine.patch_cache import PatchCache, footprint
from patchserve.server.engine.protocol import Row
from patchserve.server.engine.runner import DTYPES, Runner
from patchserve.server.engine.slots import SlotManager, SlotsExhaustedError
from patchserve.server.engine.slotted import SlottedBackend, SlottedLinear
from tests.helpers import make_patch

SENTENCES = [
    "the movie was good",
    "what a boring plot",
    "who is the actor",
    "the cat runs quickly and the dog runs slowly",
    "big",
    "where is the city",
    "not very fun really",
    "i love the red film",
]


def _rows(encoder, patch, texts, pair=None):
    enc = encoder.tokenizer(texts, pair, truncation=True, max_length=32)
    return [Row(ids, tt, patch) for ids, tt in zip(enc["input_ids"], enc["token_type_ids"], strict=True)]


def _reference(plain_model, patch, row):
    model = TaskModel.from_patch(copy.deepcopy(plain_model), patch).eval()
    ids = torch.tensor([row.input_ids])
    with torch.no_grad():
        out = model(ids, torch.ones_like(ids), torch.tensor([row.token_type_ids]))
    return out[0]


@pytest.mark.parametrize("engine", ["packed", "slotted"])
@pytest.mark.parametrize("simplify", [True, False], ids=["drop-k+fold-v", "plain-banks"])
def test_mixed_batch_equals_each_task_alone(tiny_bert_dir, tiny_encoder, task_patches, simplify, engine):
    runner = Runner(
        load_encoder(str(tiny_bert_dir)),
        device="cpu",
        slots=8,
        engine=engine,
        drop_key_bias=simplify,
        fold_value_bias=simplify,
    )
    rng = random.Random(0)
    rows = []
    for i in range(24):
        patch = task_patches[i % len(task_patches)]
        rows += _rows(tiny_encoder, patch, [rng.choice(SENTENCES)])
    rng.shuffle(rows)
    got = runner.run(rows)
    assert len(got) == len(rows)
    for row, out in zip(rows, got, strict=True):
        torch.testing.assert_close(out, _reference(tiny_encoder.model, row.patch, row), rtol=0, atol=1e-5)
    # a task run alone gives the same as inside the mix
    alone = runner.run([rows[0]])[0]
    torch.testing.assert_close(alone, got[0], rtol=0, atol=1e-5)


def _scale_banks(runner: Runner) -> int:
    """How many per-slot (IA)^3 scale banks the engine holds."""
    if isinstance(runner.backend, PackedBackend):
        return sum(k.endswith((".s", ".si")) for k in runner.backend.packed.banks)
    assert isinstance(runner.backend, SlottedBackend)
    return sum(getattr(m, "scale", None) is not None for m in runner.backend.model.modules())


@pytest.mark.parametrize("simplify", [True, False], ids=["drop-k+fold-v", "plain-banks"])
@pytest.mark.parametrize("engine", ["packed", "slotted"])
def test_scaled_patches_serve_exactly_beside_bias_patches(tiny_bert_dir, tiny_encoder, task_patches, engine, simplify):
    """bitfit-ia3 ((IA)^3 scales on keys, values, intermediates) patches in mixed batches with BitFit ones: every
    row as the plain model with that patch applied gives it."""
    runner = Runner(
        load_encoder(str(tiny_bert_dir)),
        device="cpu",
        slots=12,
        engine=engine,
        drop_key_bias=simplify,
        fold_value_bias=simplify,
    )
    rng = random.Random(1)
    plain_rows = [r for p in task_patches for r in _rows(tiny_encoder, p, [rng.choice(SENTENCES)])]
    before = runner.run(plain_rows)
    assert _scale_banks(runner) == 0  # BitFit patches alone: nothing per slot but the biases
    noise = {"ia3_scale": 0.3}
    scaled = [
        make_patch(tiny_encoder, "g-sent", seed=11, **noise),
        make_patch(tiny_encoder, "g-pos", seed=12, kind="token-classification", **noise),
        make_patch(tiny_encoder, "g-score", seed=13, kind="regression", pooling="pooler", **noise),
    ]
    rows = []
    for i in range(24):
        rows += _rows(tiny_encoder, [*task_patches, *scaled][i % 8], [rng.choice(SENTENCES)])
    rng.shuffle(rows)
    got = runner.run(rows)
    layers = tiny_encoder.model.config.num_hidden_layers
    # the packed engine: a qkv scale and an intermediate one per layer; slotted: key, value, output.dense
    assert _scale_banks(runner) == (2 if engine == "packed" else 3) * layers
    for row, out in zip(rows, got, strict=True):
        torch.testing.assert_close(out, _reference(tiny_encoder.model, row.patch, row), rtol=0, atol=1e-5)
    # the slots loaded before the scale banks existed keep no scale
    for was, now in zip(before, runner.run(plain_rows), strict=True):
        torch.testing.assert_close(now, was, rtol=0, atol=1e-5)
    # the scales matter: the same patch without them answers otherwise
    row = next(r for r in rows if r.patch is scaled[0])
    without = replace(scaled[0], meta=replace(scaled[0].meta, patch_type="bitfit"), scales={})
    assert (
        _reference(tiny_encoder.model, row.patch, row) - _reference(tiny_encoder.model, without, row)
    ).abs().max() > 1e-2
    # a slot that held a scaled patch and is loaded with a BitFit one serves it unscaled
    small = Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=1, engine=engine)
    for patch in (scaled[0], task_patches[0], scaled[1]):
        row = _rows(tiny_encoder, patch, ["the movie was good"])[0]
        torch.testing.assert_close(small.run([row])[0], _reference(tiny_encoder.model, patch, row), rtol=0, atol=1e-5)


def test_two_patches_give_different_outputs(tiny_bert_dir, tiny_encoder):
    runner = Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=4)
    a = make_patch(tiny_encoder, "x", seed=1)
    b = copy.deepcopy(a)
    b.biases = {k: v + 0.3 for k, v in a.biases.items()}  # same head, other biases
    b.__dict__.pop("data", None)
    b.__dict__.pop("patch_id", None)
    outs = runner.run(_rows(tiny_encoder, a, ["the movie"]) + _rows(tiny_encoder, b, ["the movie"]))
    assert (outs[0] - outs[1]).abs().max() > 1e-2


def test_sentence_pairs(tiny_bert_dir, tiny_encoder):
    runner = Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=2)
    patch = make_patch(tiny_encoder, "sts", kind="regression", seed=7)
    rows = _rows(tiny_encoder, patch, ["a cat runs", "the film"], ["a dog runs", "the movie was good"])
    assert any(1 in r.token_type_ids for r in rows)
    for row, out in zip(rows, runner.run(rows), strict=True):
        torch.testing.assert_close(out, _reference(tiny_encoder.model, patch, row), rtol=0, atol=1e-5)


def test_key_bias_is_dropped_and_value_bias_folded(tiny_bert_dir):
    runner = Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=2, engine="slotted")
    assert isinstance(runner.backend, SlottedBackend)
    layer = runner.backend.model.encoder.layer[0]
    assert isinstance(layer.attention.self.key, SlottedLinear) and layer.attention.self.key.bank is None
    assert layer.attention.self.value.bank is None
    assert layer.attention.self.query.bank is not None and layer.attention.output.dense.bank is not None


def test_slot_eviction_reloads_correctly(tiny_bert_dir, tiny_encoder):
    """Tasks of every kind, pooling and head width take turns in 2 slots: what a slot's new task needs (its pooling,
    its head's width, per-token answers or one) replaces what the last one needed."""
    runner = Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=2)
    patches = [
        make_patch(tiny_encoder, "t0", seed=20),
        make_patch(tiny_encoder, "t1", seed=21, kind="token-classification", pooling="cls"),
        make_patch(tiny_encoder, "t2", seed=22, kind="regression", pooling="pooler"),
        make_patch(tiny_encoder, "t3", seed=23, labels=["a", "b", "c", "d", "e"], pooling="cls"),
    ]
    for _ in range(2):
        for p in patches:
            row = _rows(tiny_encoder, p, ["the movie was good"])[0]
            torch.testing.assert_close(runner.run([row])[0], _reference(tiny_encoder.model, p, row), rtol=0, atol=1e-5)
    assert runner.slots.stats.evictions >= 6


def test_a_failed_load_leaves_the_slots_as_they_were(tiny_bert_dir, tiny_encoder):
    """Loading a batch's cold patch fails: the batch fails, the cold patch holds no slot, the warm ones are unpinned,
    and the next batches (the same patches included) run and give what their tasks give alone."""
    runner = Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=2)
    warm, cold = make_patch(tiny_encoder, "warm", seed=30), make_patch(tiny_encoder, "cold", seed=31)
    rows = {p.meta.task: _rows(tiny_encoder, p, ["the movie was good"])[0] for p in (warm, cold)}
    runner.run([rows["warm"]])
    load = runner.backend.load

    def failing(items):
        raise RuntimeError("device out of memory")

    runner.backend.load = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="out of memory"):
        runner.run([rows["warm"], rows["cold"]])
    assert cold.patch_id not in runner.slots and warm.patch_id in runner.slots
    assert not runner.slots._pins, "a failed batch left slots pinned"
    runner.backend.load = load  # type: ignore[method-assign]
    for _ in range(2):
        for p in (warm, cold):
            got = runner.run([rows[p.meta.task]])[0]
            torch.testing.assert_close(got, _reference(tiny_encoder.model, p, rows[p.meta.task]), rtol=0, atol=1e-5)


def test_slot_manager_never_evicts_pinned_slots():
    sm = SlotManager(2)
    m1, load1 = sm.acquire(["a", "b"])
    assert sorted(m1.values()) == [0, 1] and len(load1) == 2
    with pytest.raises(SlotsExhaustedError):
        sm.acquire(["c"])  # both pinned by the in-flight batch
    sm.release(["a", "b"])
    m2, load2 = sm.acquire(["b", "c"])  # "a" is the least recently used idle slot
    assert m2["b"] == m1["b"] and m2["c"] == m1["a"] and load2 == [("c", m1["a"])]
    assert (sm.stats.hits, sm.stats.misses, sm.stats.evictions) == (1, 3, 1)
    with pytest.raises(SlotsExhaustedError):
        sm.acquire(["x", "y", "z"])


def test_patch_cache_is_bounded_in_bytes(tiny_encoder):
    patches = [make_patch(tiny_encoder, seed=i) for i in range(3)]
    cache = PatchCache(max_bytes=2 * footprint(patches[0]))
    for p in patches:
        cache.put(p)
    assert cache.get(patches[0].patch_id) is None
    assert cache.get(patches[2].patch_id) is patches[2]
    assert cache.bytes == 2 * footprint(patches[0]) and len(cache) == 2
    # a hit is a patch found; a miss is counted by whoever had to fetch one (the catalog, the engine's parse)
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 0, 1)


def test_default_minilm_mixed_batch(minilm):
    """The real packaged encoder: a mixed batch matches the reference for each row."""
    runner = Runner(load_encoder("default"), device="cpu", slots=4)
    patches = [
        make_patch(minilm, "a", seed=1, scale=0.05),
        make_patch(minilm, "b", seed=2, scale=0.05, subset="query-intermediate"),
        make_patch(minilm, "c", seed=3, scale=0.05, ia3_scale=0.1),  # a bitfit-ia3 patch
    ]
    rows = []
    for i, text in enumerate(["A plane is taking off.", "What is the capital of Chile?", "Great film!"] * 2):
        rows += _rows(minilm, patches[i % 3], [text])
    for row, out in zip(rows, runner.run(rows), strict=True):
        torch.testing.assert_close(out, _reference(minilm.model, row.patch, row), rtol=0, atol=1e-4)


def _spy_runner(tiny_bert_dir, slots):
    runner = Runner(load_encoder(str(tiny_bert_dir)), device="cpu", slots=slots)
    batches: list[list[Row]] = []
    real = runner.launch

    def spy(block):
        pending = real(block)
        batches.append(block.rows())
        return pending

    runner.launch = spy  # type: ignore[method-assign]
    return runner, batches


def _block(rows):
    from patchserve.server.engine.rows import RowBlock

    return RowBlock.from_rows(rows)


def test_batcher_mixes_tasks_and_drops_cancelled_rows(tiny_bert_dir, tiny_encoder):
    import asyncio

    from patchserve.server.engine.batcher import Batcher

    runner, batches = _spy_runner(tiny_bert_dir, slots=4)
    pa, pb = make_patch(tiny_encoder, "a", seed=1), make_patch(tiny_encoder, "b", seed=2)
    rows_a = _rows(tiny_encoder, pa, ["the good movie", "a bad film"])

    async def scenario():
        batcher = Batcher(runner, max_rows=8, max_wait_ms=200)
        batcher.start()
        ja = batcher.submit(_block(rows_a))
        jb = batcher.submit(_block(_rows(tiny_encoder, pb, ["the cat runs"])))
        ja.drop(slice(1, 2))  # what a client hang-up or timeout does to one request's rows
        outs = await asyncio.gather(ja.future, jb.future)
        await batcher.stop()
        return outs

    out_a, out_b = asyncio.run(scenario())
    assert len(batches) == 1 and len(batches[0]) == 2, "one mixed batch without the cancelled row"
    assert {r.patch.patch_id for r in batches[0]} == {pa.patch_id, pb.patch_id}
    assert out_a.sizes.tolist() == [2, 0] and out_b.sizes.tolist() == [2], "a dropped row answers nothing"
    torch.testing.assert_close(torch.from_numpy(out_a.data), runner.run(rows_a[:1])[0], rtol=0, atol=1e-5)


def test_batcher_respects_row_and_patch_bounds(tiny_bert_dir, tiny_encoder):
    import asyncio

    from patchserve.server.engine.batcher import Batcher

    runner, batches = _spy_runner(tiny_bert_dir, slots=2)
    patches = [make_patch(tiny_encoder, f"t{i}", seed=i) for i in range(3)]

    async def scenario():
        batcher = Batcher(runner, max_rows=4, max_wait_ms=50)
        batcher.start()
        jobs = [
            batcher.submit(_block(_rows(tiny_encoder, patches[i % 3], [SENTENCES[i % len(SENTENCES)]])))
            for i in range(10)
        ]
        outs = await asyncio.gather(*(j.future for j in jobs))
        await batcher.stop()
        return outs

    outs = asyncio.run(scenario())
    assert len(outs) == 10 and sum(len(b) for b in batches) == 10
    assert all(len(b) <= 4 for b in batches)
    assert all(len({r.patch.patch_id for r in b}) <= 2 for b in batches), "more patches than slots in a batch"


def test_batcher_serves_a_deep_queue_once_each_oldest_first(tiny_bert_dir, tiny_encoder):
    """Jobs of many rows queued deep (a batch may take part of a job, a job spans batches): every live row runs
    exactly once and in arrival order, each batch holds the oldest live row, the bounds hold, dropped rows and a
    cancelled job never run, and every job's outputs are its live rows' outputs alone, in its order."""
    import asyncio

    from patchserve.server.engine.batcher import Batcher

    runner, batches = _spy_runner(tiny_bert_dir, slots=3)
    patches = [make_patch(tiny_encoder, f"t{i}", seed=i) for i in range(5)]
    rng = random.Random(0)
    rows = []
    for i in range(300):  # tokens 5 + i // 20 and 5 + i % 20 mark row i
        row = _rows(tiny_encoder, patches[i % 5], [" ".join(rng.choice(SENTENCES).split()[: rng.randint(1, 6)])])[0]
        ids = [row.input_ids[0], 5 + i // 20, 5 + i % 20, *row.input_ids[1:]]
        rows.append(replace(row, input_ids=ids, token_type_ids=[0, 0, *row.token_type_ids]))
    cuts = sorted(rng.sample(range(1, 300), 30))
    spans = list(zip([0, *cuts], [*cuts, 300], strict=True))
    dropped = set(range(7, 300, 11))
    whole = spans[3]  # a job cancelled as a whole

    async def scenario():
        batcher = Batcher(runner, max_rows=4, max_tokens=24, max_queue_rows=1000)
        jobs = [batcher.submit(_block(rows[a:b])) for a, b in spans]  # queued before the actor starts
        for (a, b), job in zip(spans, jobs, strict=True):
            for i in dropped & set(range(a, b)):
                job.drop(slice(i - a, i - a + 1))
        jobs[3].future.cancel()
        batcher.start()
        outs = await asyncio.gather(*(j.future for k, j in enumerate(jobs) if k != 3))
        await batcher.stop()
        return outs

    outs = asyncio.run(scenario())
    gone = dropped | set(range(*whole))
    ran = [(r.input_ids[1] - 5) * 20 + r.input_ids[2] - 5 for b in batches for r in b]
    assert ran == sorted(set(range(300)) - gone), "a live row ran twice, never or out of order, or a dropped one ran"
    for b in batches:
        assert len(b) <= 4 and len({r.patch.patch_id for r in b}) <= 3
        assert sum(len(r.input_ids) for r in b) <= 24 or len(b) == 1
    for (a, b), out in zip([s for k, s in enumerate(spans) if k != 3], outs, strict=True):
        live = [i for i in range(a, b) if i not in dropped]
        assert [int(x > 0) for x in out.sizes] == [int(i not in dropped) for i in range(a, b)]
        got = out.split([len(rows[i].input_ids) for i in range(a, b)], [False] * (b - a))
        want = [runner.run([rows[i]])[0] for i in live]
        for g, w in zip([g for g in got if g.size], want, strict=True):
            torch.testing.assert_close(torch.from_numpy(g), w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("turn_s", [0.0, 1e9])
def test_an_inline_batcher_runs_full_batches_back_to_back_then_lets_the_loop_in(
    tiny_bert_dir, tiny_encoder, monkeypatch, turn_s
):
    """Inline (the engine process on a CPU), while a full batch is still queued, batches run back to back until
    INLINE_TURN_S has passed since the loop was last let in; once less than a full batch is queued, the loop is let
    in after every batch (here: 40 rows, batches of 4)."""
    import asyncio

    from patchserve.server.engine import batcher as batching

    monkeypatch.setattr(batching, "INLINE_TURN_S", turn_s)
    runner, batches = _spy_runner(tiny_bert_dir, slots=2)
    rows = _rows(tiny_encoder, make_patch(tiny_encoder, "a", seed=1), [SENTENCES[i % 5] for i in range(40)])

    async def scenario():
        batcher = batching.Batcher(runner, max_rows=4, inline=True)
        job = batcher.submit(_block(rows))
        batcher.start()
        seen = []  # batches launched by each time the loop let this coroutine in
        while not job.future.done():
            await asyncio.sleep(0)
            seen.append(len(batches))
        await batcher.stop()
        return seen

    seen = asyncio.run(scenario())
    assert len(batches) == 10
    if turn_s == 0.0:
        assert seen == list(range(1, 11)), "the loop was not let in after every batch"
    else:
        assert seen[0] == 10, "the loop was let in while a full batch was still queued and the turn had not passed"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_default_minilm_mixed_batch_on_cuda(minilm, dtype):
    """On a GPU a mixed batch of 4 tasks matches each task's float32 CPU reference row by row: to 1e-4 in float32;
    in float16 (the GPU serving default) no worse than the plain HF model of that task in float16 on that GPU
    (float16 rounding alone moves small logits by a few percent; on an H100 both were at most about 4e-2)."""
    runner = Runner(load_encoder("default"), device="cuda", dtype=dtype, slots=8)
    patches = [
        make_patch(minilm, f"t{i}", seed=i, scale=0.05, subset=("all", "query-intermediate")[i % 2]) for i in range(4)
    ]
    rng = random.Random(0)
    texts = ["A plane is taking off.", "What is the capital of Chile?", "Great film!", *SENTENCES]
    rows = []
    for i in range(32):
        rows += _rows(minilm, patches[i % 4], [rng.choice(texts)])
    rng.shuffle(rows)
    got = runner.run(rows)
    plain = {
        p.patch_id: TaskModel.from_patch(copy.deepcopy(minilm.model), p).eval().to("cuda", DTYPES[dtype])
        for p in patches
    }
    for row, out in zip(rows, got, strict=True):
        assert out.device.type == "cpu" and torch.isfinite(out).all()
        ref = _reference(minilm.model, row.patch, row)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        if dtype == "float32":
            assert err < 1e-4
            continue
        ids = torch.tensor([row.input_ids], device="cuda")
        with torch.no_grad():
            alone = plain[row.patch.patch_id](
                ids, torch.ones_like(ids), torch.tensor([row.token_type_ids], device="cuda")
            )
        plain_err = ((alone[0].float().cpu() - ref).norm() / ref.norm()).item()
        assert err <= 2 * plain_err + 5e-3, (err, plain_err)


def test_slot_manager_acquire_is_all_or_nothing():
    """A batch that cannot get all its slots (others are pinned by a batch in flight) takes none of them, so it
    can be retried once that batch has finished."""
    sm = SlotManager(3)
    sm.acquire(["a", "b"])  # in flight
    with pytest.raises(SlotsExhaustedError):
        sm.acquire(["a", "c", "d"])
    assert "c" not in sm and len(sm) == 2
    sm.release(["a", "b"])
    mapping, to_load = sm.acquire(["c", "d", "e"])  # every slot is free to take again
    assert sorted(mapping.values()) == [0, 1, 2] and len(to_load) == 3


_FILL = """
import gc, os, sys
from dataclasses import replace
from patchserve.patches.format import Patch
from patchserve.patches.patch_file import content_id
from patchserve.patches.stored_patch import StoredPatch
from patchserve.server.engine.patch_cache import PatchCache

def rss():
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

t = Patch.read(sys.argv[1])
gc.collect()
before = rss()
cache = PatchCache(max_bytes=1 << 40)
for i in range(3000):
    data = Patch(replace(t.meta, task=f"t{i}"), t.biases, t.head_weight, t.head_bias).data
    pid = content_id(data)
    cache.put(Patch.from_bytes(data, patch_id=pid) if sys.argv[2] == "parsed" else StoredPatch.from_stored(data, pid))
gc.collect()
print(rss() - before, cache.bytes, len(cache))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the process's memory from /proc")
@pytest.mark.parametrize("held", ["parsed", "stored"])
def test_the_host_tier_counts_what_its_patches_take_in_memory(tiny_encoder, tmp_path, held):
    """--host-cache-mb bounds memory, not bytes on the wire: 3,000 patches as the engine holds them (parsed: a small
    patch's tensor objects outweigh its bytes several times) or as a front end does (a registry's StoredPatch, its
    tensors unparsed) grow a fresh process by about what the cache counts."""
    template = tmp_path / "t.safetensors"
    template.write_bytes(make_patch(tiny_encoder, "t", seed=1).data)
    out = subprocess.run([sys.executable, "-c", _FILL, str(template), held], capture_output=True, text=True, check=True)
    grown, counted, n = (int(x) for x in out.stdout.split())
    assert n == 3000 and 0.6 < grown / counted < 1.4, (grown, counted)
