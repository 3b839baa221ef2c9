"""bench/engine.py: one configuration measures every path on a tiny encoder, the pipelined timing included, with
the lora path's patches on the targets asked for."""

from __future__ import annotations

import argparse

from bench.engine import PATHS, Paths, measure


def test_a_configuration_measures_every_path_and_records_the_lora_targets(tiny_bert_dir):
    args = argparse.Namespace(model=str(tiny_bert_dir), device="cpu", dtype="auto", lora_targets=["query", "value"])
    paths = Paths(args, n_tasks=3)
    assert all(set(p.lora) for p in paths.twin_of["engine_lora"].values())
    names = [n for p in paths.twin_of["engine_lora"].values() for n in p.lora]
    assert all(".query." in n or ".value." in n for n in names) and any(".value." in n for n in names)
    texts = ["a fine film", "who wrote it", "the plot was thin and slow", "where is the station"]
    result = measure(paths, texts, batch=4, n_tasks=3, dist="uniform", iters=2, seed=0)
    assert result["lora_targets"] == ["query", "value"]
    assert result["ms_engine_pipelined"] > 0 and all(result[f"ms_{p}"] > 0 for p in PATHS)
    assert result["ratio_bf16_vs_engine"] > 0  # the CPU in float32: the bfloat16 runner is timed too
