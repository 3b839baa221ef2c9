"""bench/train_cost.py: each mode trains what it should, through the trainer's own step; a default run of each mode
trains on its own forward; the report renders old and new rows."""

from __future__ import annotations

import argparse
import json

from bench.train_cost import child, jobs_child, render, run_child
from tests.helpers import synthetic_rows, write_jsonl


def tiny_bert_dir_config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def _args(tmp_path, tiny_bert_dir, mode):
    train = write_jsonl(tmp_path / "train.jsonl", synthetic_rows("classification", 24, seed=1))
    dev = write_jsonl(tmp_path / "dev.jsonl", synthetic_rows("classification", 8, seed=2))
    return argparse.Namespace(
        child=mode,
        model=str(tiny_bert_dir),
        device="cpu",
        data=str(train),
        dev=str(dev),
        batch=4,
        steps=2,
        warmup=1,
        run_rows=16,
        dev_rows=8,
        run_max_steps=6,
        concurrent_jobs=3,
        job_rows=8,
        job_dev_rows=8,
        job_max_steps=4,
    )


def test_each_mode_trains_its_own_parameters_and_reports_cost(tiny_bert_dir, tmp_path):
    modes = ("packed", "padded", "full", "packed-ia3", "packed-float32")
    got = {mode: child(_args(tmp_path, tiny_bert_dir, mode)) for mode in modes}
    assert got["packed-float32"]["trainable_params"] == got["packed"]["trainable_params"]  # the arithmetic differs
    assert got["packed"]["trainable_params"] == got["padded"]["trainable_params"]
    # (IA)^3: 3 scales a layer (key, value: hidden; intermediate: its width) on top of the biases
    config = tiny_bert_dir_config(tiny_bert_dir)
    scales = config["num_hidden_layers"] * (2 * config["hidden_size"] + config["intermediate_size"])
    assert got["packed-ia3"]["trainable_params"] == got["packed"]["trainable_params"] + scales
    assert got["packed"]["trainable_params"] * 10 < got["full"]["trainable_params"]
    assert all(r["s_per_update"] > 0 and r["memory_bytes"] >= 0 for r in got.values())
    # one update's ATen ops: the packed model's runs step in a few tensor ops, the padded model's AdamW per tensor
    assert all(r["ops_per_update"] > 0 for r in got.values())
    assert got["packed"]["ops_per_update"] < got["padded"]["ops_per_update"]


def test_default_runs_use_their_own_forward(tiny_bert_dir, tmp_path):
    runs = {mode: run_child(_args(tmp_path, tiny_bert_dir, mode)) for mode in ("run-bitfit", "run-padded", "run-full")}
    assert {m: r["forward"] for m, r in runs.items()} == {
        "run-bitfit": "packed",
        "run-padded": "padded",
        "run-full": "padded",
    }
    assert all(r["seconds"] > 0 and r["steps"] > 0 and 0 <= r["dev_accuracy"] <= 1 for r in runs.values())
    restarts = run_child(_args(tmp_path, tiny_bert_dir, "run-restarts3"))
    assert restarts["forward"] == "packed" and restarts["runs"] == 3 and restarts["seconds"] > 0


def test_concurrent_jobs_train_every_job_one_at_a_time_and_together(tiny_bert_dir, tmp_path):
    for mode in ("jobs-1", "jobs-k"):
        got = jobs_child(_args(tmp_path, tiny_bert_dir, mode))
        assert got["mode"] == mode and got["jobs"] == got["trained"] == 3
        assert got["jobs_per_hour"] > 0 and 0 <= got["dev_accuracy"] <= 1


def test_render_reads_rows_before_and_after_packed_training(tmp_path):
    old = {
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
    new = {
        "device": "cpu (2 threads)",
        "batch": 32,
        "trainable_bitfit": 1,
        "trainable_full": 2,
        "ms_update_packed": 400.0,
        "ms_update_padded": 720.0,
        "ms_per_update_full": 1000.0,
        "speedup_packed": 1.8,
        "update_ratio": 0.4,
        "memory_mb_packed": 1.0,
        "memory_mb_padded": 2.0,
        "memory_mb_full": 3.0,
        "run_rows": 1000,
        "dev_rows": 300,
        "run_s_bitfit": 100.0,
        "run_s_padded": 150.0,
        "run_s_full": 120.0,
        "run_steps_bitfit": 630,
        "run_steps_padded": 630,
        "run_steps_full": 600,
        "run_dev_accuracy_bitfit": 0.8,
        "run_dev_accuracy_padded": 0.8,
        "run_dev_accuracy_full": 0.79,
        "ratio_run": 0.833,
        "run_speedup_packed": 1.5,
    }
    quick = new | {"device": "NVIDIA H100 80GB HBM3", "note": "--quick, alone on the GPU"}  # how it was taken
    out = tmp_path / "train_cost.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in (old, new, quick)))
    render(out)
    md = (tmp_path / "train_cost.md").read_text()
    assert "| cpu (2 threads) | 4 | 1 / 2 | - | - | 1.0 | 2.0 | - | 0.50x |" in md
    assert "| cpu (2 threads) | 32 | 1 / 2 | 400.0 | - | 720.0 | 1000.0 | 1.80x | 0.40x | 1.0 | 2.0 | 3.0 |" in md
    assert "| NVIDIA H100 80GB HBM3 (--quick, alone on the GPU) | 32 | 1 / 2 | 400.0 |" in md
    runs = (
        "| 1,000 / 300 | 100.0 s, 630 steps, 80.0 | - | 150.0 s, 630 steps, 80.0 | 120.0 s, 600 steps, 79.0 | 0.83x |"
    )
    assert runs in md
    # a GPU row with the float32 update beside the default's, and default runs without the padded one
    gpu = quick | {"ms_update_packed_float32": 410.0, "note": "on a GPU"}
    for key in ("run_s_padded", "run_steps_padded", "run_dev_accuracy_padded", "run_speedup_packed"):
        gpu.pop(key)
    out.write_text(json.dumps(gpu) + "\n")
    render(out)
    md = (tmp_path / "train_cost.md").read_text()
    assert "| NVIDIA H100 80GB HBM3 (on a GPU) | 32 | 1 / 2 | 400.0 | 410.0 | 720.0 | 1000.0 |" in md
    assert "| 1,000 / 300 | 100.0 s, 630 steps, 80.0 | - | - | 120.0 s, 600 steps, 79.0 | 0.83x | - |" in md
    # a CPU with bfloat16 products: the packed run in float32 beside the default's
    cpu = new | {"ms_update_packed_float32": 410.0, "run_s_float32": 130.0, "run_steps_float32": 630}
    out.write_text(json.dumps(cpu | {"run_dev_accuracy_float32": 0.81, "run_half_speedup": 1.3}) + "\n")
    render(out)
    md = (tmp_path / "train_cost.md").read_text()
    assert "| 1,000 / 300 | 100.0 s, 630 steps, 80.0 | 130.0 s, 630 steps, 81.0 | 150.0 s, 630 steps, 80.0 |" in md
