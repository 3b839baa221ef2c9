"""bench/engine.py: one configuration measures every path on a tiny encoder, the pipelined timing included, with
the lora path's patches on the targets asked for, and LoRA's stacked form timed on a runner of its own."""

from __future__ import annotations

import argparse
import sys

import torch

from bench.engine import PATHS, Paths, measure
from patchserve.patches.packed_lora import STACKED_MAX_COLUMNS, LowRank


def test_a_configuration_measures_every_path_and_records_the_lora_targets(tiny_bert_dir, monkeypatch):
    forms: list[str | None] = []
    add = LowRank.add

    def spy(self, key, x, y):
        forms.append(self.form)
        return add(self, key, x, y)

    monkeypatch.setattr(LowRank, "add", spy)
    args = argparse.Namespace(
        model=str(tiny_bert_dir), device="cpu", dtype="auto", lora_targets=["query", "value"], lora_stacked=True
    )
    paths = Paths(args, n_tasks=5)  # 5 LoRA tasks: 8 factor rows of rank 8, past the stacked form's 32 columns
    assert all(set(p.lora) for p in paths.twin_of["engine_lora"].values())
    names = [n for p in paths.twin_of["engine_lora"].values() for n in p.lora]
    assert all(".query." in n or ".value." in n for n in names) and any(".value." in n for n in names)
    texts = ["a fine film", "who wrote it", "the plot was thin and slow", "where is the station"]
    result = measure(paths, texts, batch=4, n_tasks=5, dist="uniform", iters=2, seed=0)
    assert result["lora_targets"] == ["query", "value"]
    assert result["ms_engine_pipelined"] > 0 and all(result[f"ms_{p}"] > 0 for p in PATHS)
    assert result["ratio_bf16_vs_engine"] > 0  # the CPU in float32: the bfloat16 runner is timed too
    assert result["ratio_lora_stacked_vs_engine"] > 0
    # the engine's own choice past 32 columns (per segment on the CPU) and the stacked runner's, on the same patches
    lora, stacked = (paths.twin_runners[p].backend.packed.lora for p in ("engine_lora", "engine_lora_stacked"))
    assert lora is not None and stacked is not None and lora.capacity * lora.rank > STACKED_MAX_COLUMNS
    assert paths.twin_runners["engine_lora_stacked"].backend.packed.lora_stacked_max_columns == sys.maxsize
    assert {"segments", "stacked"} <= set(forms)
    rows = paths._twin_rows[next(k for k in paths._twin_rows if k[0] == "engine_lora")][1]
    runs = [paths.twin_runners[p].run(rows) for p in ("engine_lora", "engine_lora_stacked")]
    assert len(rows) == 4 and any(r.patch is not None and r.patch.lora for r in rows)
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_the_cpu_times_the_stacked_form_only_when_asked(tiny_bert_dir):
    args = argparse.Namespace(model=str(tiny_bert_dir), device="cpu", dtype="auto", lora_targets=["query"])
    paths = Paths(args, n_tasks=2)
    assert "engine_lora_stacked" not in paths.fns() and "engine_lora_stacked" not in paths.twin_runners
