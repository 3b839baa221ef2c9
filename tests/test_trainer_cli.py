"""`patchserve train` and `patchserve eval`: the command line around train_patch, its progress and its output."""

from __future__ import annotations

import json

import pytest
import redis

from patchserve.patches.data import DataError, DataFile, load_dataset, load_splits
from patchserve.patches.format import Patch
from patchserve.trainer.cli import register_commands  # noqa: F401 - the commands must import cleanly
from patchserve.trainer.progress import progress_logger
from tests.helpers import free_port, start_redis, synthetic_rows, write_jsonl


def test_cli_train_eval_and_report(tmp_path, tiny_bert_dir, capsys):
    from patchserve.__main__ import main

    train = write_jsonl(tmp_path / "train.jsonl", synthetic_rows("classification", 120, seed=1))
    test = write_jsonl(tmp_path / "test.jsonl", synthetic_rows("classification", 40, seed=3))
    out, report = tmp_path / "sent.safetensors", tmp_path / "report.json"
    rc = main(
        [
            "train",
            "--task",
            "sent",
            "--train",
            str(train),
            "--test",
            str(test),
            "--model",
            str(tiny_bert_dir),
            "--min-steps",
            "200",
            "--epochs",
            "1",
            "--lr",
            "1e-2",
            "--pooling",
            "mean",
            "--out",
            str(out),
            "--report",
            str(report),
            "--device",
            "cpu",
            "--eval-every",
            "20",
            "--dropout",
            "0",
            "--head-lr",
            "5e-3",
            "--metric",
            "macro_f1",
            "--restarts",
            "1",
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    # stderr is not a terminal here: plain progress lines instead of a bar, the last one at the final step
    assert "step 200/200 loss" in captured.err and "dev accuracy" in captured.err and "macro_f1" in captured.err
    assert summary["metric"] == "macro_f1" and set(summary["test"]) == {"accuracy", "macro_f1"}
    assert summary["selection"]["restarts"] == 1 and summary["selection"]["restarts_why"] == "set: restarts=1"
    assert summary["patch"]["file"] == str(out) and out.is_file()
    full = json.loads(report.read_text())
    assert full["test"] == summary["test"] and full["history"] and "bias_movement" in full
    assert (full["config"]["dropout"], full["head_lr"], full["config"]["patience"]) == (0, 5e-3, 40)  # 40: default
    assert main(["eval", "--patch", str(out), "--data", str(test), "--model", str(tiny_bert_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"] == summary["test"]
    reg = f"disk://{tmp_path}/reg"
    rc = main(
        [
            "train",
            "--task",
            "sent",
            "--train",
            str(train),
            "--model",
            str(tiny_bert_dir),
            "--min-steps",
            "5",
            "--registry",
            reg,
            "--device",
            "cpu",
            "--restarts-merge",
            "average",
        ]
    )
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["registered"]["version"] == 1
    assert summary["selection"]["restarts"] == 3 and summary["metric"] == "accuracy"  # 108 rows: automatic restarts
    assert summary["selection"]["restarts_merge"] == "average"  # the 3 restarts averaged into the registered patch


def test_progress_logger_prints_prefixed_lines_off_a_terminal_and_nothing_on_one(capsys, monkeypatch):
    """Off a terminal (nohup, logs) a long run prints a plain line now and then, naming the run it belongs to where
    several runs share one log (the benchmarks); on a terminal there is the progress bar and no logger."""
    log = progress_logger(every_s=3600, prefix="trec bitfit seed=1: ")
    assert log is not None  # pytest's captured stderr is not a terminal
    report = {"step": 1, "total_steps": 3, "loss": 0.5, "dev": {"accuracy": 0.75}, "seed": 1, "lr": 0.003}
    for step in (1, 2, 3):  # the second comes within every_s of the first; the last update is always shown
        log(report | {"step": step})
    assert capsys.readouterr().err.splitlines() == [
        "trec bitfit seed=1: step 1/3 loss 0.5000 dev accuracy 0.7500 (seed=1 lr=0.003)",
        "trec bitfit seed=1: step 3/3 loss 0.5000 dev accuracy 0.7500 (seed=1 lr=0.003)",
    ]

    class Terminal:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stderr", Terminal())
    assert progress_logger() is None


def test_cli_train_checks_where_the_patch_goes_first_and_never_loses_a_trained_patch(
    tmp_path, tiny_bert_dir, capsys, monkeypatch
):
    from patchserve.__main__ import main

    monkeypatch.chdir(tmp_path)
    train = write_jsonl(tmp_path / "train.jsonl", synthetic_rows("classification", 60, seed=1))
    argv = ["train", "--task", "sent", "--train", str(train), "--model", str(tiny_bert_dir), "--device", "cpu"]
    argv += ["--min-steps", "5"]
    # an unreachable registry or a missing folder is refused before any training
    assert main([*argv, "--registry", f"redis://127.0.0.1:{free_port()}/0"]) == 1
    err = capsys.readouterr().err
    assert "unreachable" in err and "step " not in err, err
    assert main([*argv, "--report", str(tmp_path / "no" / "report.json")]) == 2
    err = capsys.readouterr().err
    assert "--report" in err and "does not exist" in err and "step " not in err
    assert not (tmp_path / "sent.safetensors").exists()

    # a registry that answers but refuses the write (a full Redis): the trained patch is saved in a file
    proc, url = start_redis(tmp_path, "--maxmemory", "1", "--maxmemory-policy", "noeviction")
    try:
        assert main([*argv, "--registry", url]) == 1
        captured = capsys.readouterr()
        assert "trained but not registered" in captured.err and "out of memory" in captured.err
        assert f"patchserve register sent.safetensors --registry {url}" in captured.err
        saved = Patch.read("sent.safetensors")
        assert json.loads(captured.out)["patch"]["patch_id"] == saved.patch_id
        # the command it suggests works once the registry takes writes again
        redis.Redis.from_url(url).config_set("maxmemory", 0)
        assert main(["register", "sent.safetensors", "--registry", url]) == 0
        assert f"registered sent v1 ({saved.patch_id})" in capsys.readouterr().out
        # --registry and --out together do both
        assert main([*argv, "--registry", url, "--out", "copy.safetensors"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["registered"]["version"] == 2
        assert summary["registered"]["patch_id"] == Patch.read("copy.safetensors").patch_id
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_tag_only_dev_and_test_carry_joins_the_tag_set_and_counts_as_an_error(tmp_path, tiny_bert_dir, capsys):
    # Brown's part-of-speech dev and test files carry contractions (pn+bez...) that its training sentences lack:
    # the task must still train, and the tokens of such a tag count as errors, since the patch never learnt it
    from patchserve.__main__ import main

    def retag(rows: list[dict]) -> list[dict]:
        return [
            r | {"tags": ["NOUN" if t == "cat" else g for t, g in zip(r["tokens"], r["tags"], strict=True)]}
            for r in rows
        ]

    train = write_jsonl(tmp_path / "train.jsonl", synthetic_rows("token-classification", 200, seed=1))
    dev_rows, test_rows = (retag(synthetic_rows("token-classification", 60, seed=s)) for s in (2, 3))
    dev, test = write_jsonl(tmp_path / "dev.jsonl", dev_rows), write_jsonl(tmp_path / "test.jsonl", test_rows)
    splits = load_splits(*(DataFile.read(f) for f in (train, dev, test)))
    assert splits.untrained_tags == ["NOUN"]
    assert splits.train.labels == splits.dev.labels == splits.test.labels == ["ADJ", "NOUN", "OTHER"]
    with pytest.raises(DataError, match=r"labels \['NOUN'\] are not among the task's labels"):
        load_dataset(dev, labels=["ADJ", "OTHER"])  # a patch's own tag set, as `patchserve eval` reads a file

    out, report = tmp_path / "pos.safetensors", tmp_path / "report.json"
    args = ["train", "--task", "pos", "--train", str(train), "--dev", str(dev), "--test", str(test)]
    args += ["--model", str(tiny_bert_dir), "--min-steps", "300", "--out", str(out), "--report", str(report)]
    assert main([*args, "--device", "cpu"]) == 0
    assert "carry 1 tag(s) that no training sentence has (NOUN)" in capsys.readouterr().err
    assert Patch.from_bytes(out.read_bytes()).meta.labels == ["ADJ", "NOUN", "OTHER"]
    scores = json.loads(report.read_text())["test"]
    cats = sum(t == "NOUN" for r in test_rows for t in r["tags"])
    ceiling = 1 - cats / sum(len(r["tags"]) for r in test_rows)  # every NOUN token wrong, every other one right
    assert ceiling - 0.1 < scores["token_accuracy"] <= ceiling


def test_cli_train_takes_scales_and_inspect_shows_the_patch_type(tmp_path, tiny_bert_dir, capsys):
    from patchserve.__main__ import main

    rows = write_jsonl(tmp_path / "sent.jsonl", synthetic_rows("classification", 40, seed=1))
    out = tmp_path / "sent.safetensors"
    argv = ["train", "--task", "sent", "--model", str(tiny_bert_dir), "--device", "cpu", "--min-steps", "4"]
    assert main([*argv, "--restarts", "1", "--train", str(rows), "--scales", "ia3", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["scales"] == "ia3"
    assert main(["inspect", "--json", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["patch_type"] == "bitfit-ia3" and info["n_scale_tensors"] == 6 and info["n_bias_tensors"] == 18
    with pytest.raises(SystemExit):
        main([*argv, "--train", str(rows), "--scales", "lora", "--out", str(out)])
    assert "invalid choice: 'lora'" in capsys.readouterr().err


def test_cli_train_takes_head_init(tmp_path, tiny_bert_dir, capsys):
    from patchserve.__main__ import main

    rows = write_jsonl(tmp_path / "sent.jsonl", synthetic_rows("classification", 40, seed=1))
    argv = ["train", "--task", "sent", "--model", str(tiny_bert_dir), "--device", "cpu", "--min-steps", "4"]
    argv += ["--restarts", "1", "--out", str(tmp_path / "sent.safetensors")]
    assert main([*argv, "--train", str(rows), "--head-init", "labels"]) == 0
    assert json.loads(capsys.readouterr().out)["selection"]["head_init"] == "labels"
    assert Patch.read(tmp_path / "sent.safetensors").meta.training["head_init"] == "labels"
    scores = write_jsonl(tmp_path / "scores.jsonl", synthetic_rows("regression", 40, seed=1))
    assert main([*argv, "--train", str(scores), "--head-init", "labels"]) == 1
    assert "set head_init to 'random'" in capsys.readouterr().err
