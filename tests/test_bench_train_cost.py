"""bench/train_cost.py: each mode trains what it should, through the trainer's own step, and the report renders."""

from __future__ import annotations

import argparse
import json

from bench.train_cost import child, render
from tests.helpers import synthetic_rows, write_jsonl


def test_each_mode_trains_its_own_parameters_and_reports_cost(tiny_bert_dir, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", synthetic_rows("classification", 8, seed=1))
    got = {}
    for mode in ("bitfit", "full"):
        args = argparse.Namespace(
            child=mode, model=str(tiny_bert_dir), device="cpu", data=str(data), batch=4, steps=2, warmup=1
        )
        got[mode] = child(args)
    assert got["bitfit"]["trainable_params"] * 10 < got["full"]["trainable_params"]
    assert all(r["s_per_update"] > 0 and r["memory_bytes"] >= 0 for r in got.values())
    line = {
        "device": "cpu (2 threads)",
        "batch": 4,
        "trainable_bitfit": 1,
        "trainable_full": 2,
        "ms_per_update_bitfit": 1.0,
        "ms_per_update_full": 2.0,
        "update_ratio": 0.5,
        "memory_mb_bitfit": 1.0,
        "memory_mb_full": 2.0,
        "memory_ratio": 0.5,
    }
    out = tmp_path / "train_cost.jsonl"
    out.write_text(json.dumps(line) + "\n")
    render(out)
    assert "| cpu (2 threads) | 4 | 1 / 2 | 1.0 | 2.0 | 0.50x |" in (tmp_path / "train_cost.md").read_text()
