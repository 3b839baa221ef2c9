"""``patchserve train`` and ``patchserve eval`` (and, from trainer.worker, ``worker``/``submit``/``jobs``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from patchserve.patches.cli import add_min_replicas_option, add_registry_option, add_retention_option, positive_int
from patchserve.patches.store.base import redact_url
from patchserve.patches.train_config import Option, options

SUMMARY_KEYS = (
    "task",
    "mode",
    "kind",
    "bias_subset",
    "scales",
    "metric",
    "lr",
    "seed",
    "steps",
    "trainable_params",
    "seconds",
)


def add_training_options(p: argparse.ArgumentParser) -> None:
    """A flag for every training option (``patches.train_config.options()``: the one declaration the job API and
    the docs read too), shared by ``train`` and ``submit``. An option left out keeps the config's default."""
    group = p.add_argument_group("training options (each is also a field of a job's JSON config)")
    for option in options():
        kw: dict[str, Any] = {"help": _help(option), "default": None, "required": option.required}
        if option.kind is bool:
            kw["action"] = "store_true"
        else:
            kw |= {"type": option.kind, "choices": option.choices, "metavar": option.metavar}
            if option.many:
                kw["nargs"] = "+"
        group.add_argument(option.flag, **kw)


def _help(option: Option) -> str:
    help = option.help.replace("%", "%%")  # argparse formats help with %
    if option.default is None or option.kind is bool or option.default == []:
        return help
    return f"{help} Default: {option.default}."


def config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The training options given on the command line, as a job's JSON config (the rest keep their defaults)."""
    return {o.name: value for o in options() if (value := getattr(args, o.name)) is not None}


def _write_patch(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)


def _train(args: argparse.Namespace) -> int:
    from patchserve.patches.data import DataFile, load_splits
    from patchserve.patches.encoder import load_encoder
    from patchserve.patches.train_config import TrainConfig
    from patchserve.trainer.progress import progress_logger
    from patchserve.trainer.report import write_json, write_png
    from patchserve.trainer.train import check_trainable, train_patch

    if args.full and (args.out or args.registry_given):
        print("error: --full produces a report only (no patch); drop --out/--registry", file=sys.stderr)
        return 2
    config = TrainConfig.from_dict(config_from_args(args))
    encoder = load_encoder(args.model)
    check_trainable(encoder, config)  # what this encoder's family cannot train: refused before the data is read
    dev_file, test_file = (DataFile.read(f) if f else None for f in (args.dev, args.test))
    splits = load_splits(DataFile.read(args.train), dev_file, test_file, kind=config.kind, seed=config.seed)
    train, dev, test = splits.train, splits.dev, splits.test
    if splits.dev_carved:
        print(f"no --dev given: using {len(dev)} rows carved from {args.train} as dev", file=sys.stderr)
    if warning := splits.untrained_warning():
        print(warning, file=sys.stderr)
    config.check_task(train.kind, train.labels)  # a metric or a head start the data cannot take: now, not after loading
    # Everything the end of the run needs is checked before it starts, so no training is thrown away.
    out = None if args.full or (args.registry_given and not args.out) else Path(args.out or f"{args.task}.safetensors")
    for role, target in (("--out", out), ("--report", Path(args.report) if args.report else None)):
        if target is not None and not target.resolve().parent.is_dir():
            print(f"error: {role} {target}: the folder {target.resolve().parent} does not exist", file=sys.stderr)
            return 2
    registry = None
    if args.registry_given and not args.full:
        from patchserve.patches.store import open_registry

        registry = open_registry(args.registry, keep_versions=args.keep_versions, min_replicas=args.redis_min_replicas)
        registry.ping()
    progress = progress_logger()  # None on a terminal: the progress bar shows there
    result = train_patch(encoder, train, dev, config, test=test, on_progress=progress)
    report = result.report
    summary = {k: report[k] for k in SUMMARY_KEYS} | {
        "dev": report["dev"],
        "test": report.get("test"),
        "selection": report["selection"],
    }
    code = 0 if result.patch is None else _deliver(result.patch, out, registry, args, summary)  # the patch first
    if args.report:
        path = Path(args.report)
        write_json(path, report)
        if write_png(path.with_suffix(".png"), report):
            print(f"report: {path} and {path.with_suffix('.png')}", file=sys.stderr)
    print(json.dumps(summary, indent=2))
    return code


def _deliver(patch: Any, out: Path | None, registry: Any, args: argparse.Namespace, summary: dict[str, Any]) -> int:
    """Write the trained patch to ``out`` and/or register it; if registering fails, keep it in a file."""
    if out is not None:
        _write_patch(out, patch.data)
        summary["patch"] = {"file": str(out), "patch_id": patch.patch_id, "bytes": len(patch.data)}
    if registry is None:
        return 0
    try:
        info = registry.put(patch)
    except Exception as exc:  # the registry went away, a full disk or Redis...: whatever it is, keep the patch
        if out is None:
            out = Path(f"{args.task}.safetensors")
            _deliver(patch, out, None, args, summary)
        shown_url = redact_url(args.registry)
        print(
            f"error: the patch was trained but not registered: {exc}\nIt is saved in {out}; register it with: "
            f"patchserve register {out} --registry {shown_url}"
            + (" (put your registry's password in place of ***)" if shown_url != args.registry else ""),
            file=sys.stderr,
        )
        return 1
    summary["registered"] = {"registry": redact_url(args.registry), "version": info.version, "patch_id": info.patch_id}
    return 0


def _eval(args: argparse.Namespace) -> int:
    import copy

    from patchserve.patches.data import load_dataset
    from patchserve.patches.encoder import load_encoder
    from patchserve.patches.format import Patch
    from patchserve.patches.model import TaskModel
    from patchserve.trainer.evaluation import evaluate
    from patchserve.trainer.features import featurize

    patch = Patch.read(args.patch)
    encoder = load_encoder(args.model)
    patch.check_compatible(encoder.spec)
    meta = patch.meta
    data = load_dataset(args.data, kind=meta.kind, labels=meta.labels or None)
    model = TaskModel.from_patch(copy.deepcopy(encoder.model), patch).eval()
    feats = featurize(encoder.tokenizer, data, meta.labels, min(meta.max_seq_length, encoder.max_positions))
    pad_id = int(encoder.tokenizer.pad_token_id or 0)
    metrics = evaluate(model, feats, pad_id, meta.labels, batch_size=args.batch_size)
    print(
        json.dumps(
            {"task": meta.task, "patch_id": patch.patch_id, "data": args.data, "rows": len(data), "metrics": metrics},
            indent=2,
        )
    )
    return 0


QUEUE_ENV = "PATCHSERVE_QUEUE"


def _queue_url(args: argparse.Namespace) -> str:
    url = args.queue or os.environ.get(QUEUE_ENV) or ""
    reg = getattr(args, "registry", None) or os.environ.get("PATCHSERVE_REGISTRY", "")
    if not url and reg.startswith(("redis://", "rediss://", "redis+sentinel://")):
        url = reg
    if not url:
        raise SystemExit(f"error: the job queue needs Redis: pass --queue redis://host:port/db or set {QUEUE_ENV}")
    return url


def _worker(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from patchserve.patches.encoder import load_encoder
    from patchserve.patches.jobs import JobLimits, JobQueue
    from patchserve.patches.store import open_registry
    from patchserve.trainer.worker import Worker

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    queue = JobQueue(_queue_url(args), min_replicas=args.redis_min_replicas)
    registry = open_registry(args.registry, keep_versions=args.keep_versions, min_replicas=args.redis_min_replicas)
    encoder = load_encoder(args.model)
    stop = threading.Event()
    # SIGTERM (docker stop, a Kubernetes rollout): stop training within a second or so, hand the job back, exit
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    worker = Worker(
        queue,
        registry,
        encoder,
        name=args.name,
        lease_s=args.lease_s,
        max_attempts=args.max_attempts,
        device=args.device,
        limits=JobLimits(max_updates=args.max_job_updates, max_seconds=args.max_job_seconds),
        alive_file=Path(args.alive_file) if args.alive_file else None,
        concurrent_jobs=args.concurrent_jobs,
    )
    try:
        worker.run(stop, max_jobs=args.max_jobs)
    except KeyboardInterrupt:
        return 130
    return 0


def _submit(args: argparse.Namespace) -> int:
    from patchserve.patches.data import DataFile, job_splits
    from patchserve.patches.jobs import JobQueue
    from patchserve.patches.train_config import TrainConfig

    files = {}
    for role in ("train", "dev", "test"):
        path = getattr(args, role)
        if path:
            files[role] = (Path(path).name, DataFile.read(path).data)
    config = config_from_args(args)
    checked = TrainConfig.from_dict(config)
    splits = job_splits(files, kind=checked.kind, seed=checked.seed)  # bad data is refused here, not later in a worker
    checked.check_task(splits.train.kind, splits.train.labels)  # and a metric that cannot score it...
    gate = {"min_dev": args.min_dev, "not_worse": args.not_worse}
    job = JobQueue(_queue_url(args), min_replicas=args.redis_min_replicas).submit(config, files, gate)
    print(json.dumps({"id": job.id, "task": job.task, "status": job.status}))
    return 0


def _jobs(args: argparse.Namespace) -> int:
    from patchserve.patches.jobs import JobQueue

    words = list(args.words)
    if len(words) > 2 or (len(words) == 2 and words[0] != "cancel") or words == ["cancel"]:
        print("error: use `patchserve jobs`, `patchserve jobs ID` or `patchserve jobs cancel ID`", file=sys.stderr)
        return 2
    queue = JobQueue(_queue_url(args), min_replicas=args.redis_min_replicas)
    if len(words) == 2:
        job = queue.cancel(words[1])
        ended = job.status == "cancelled"
        print(f"job {job.id}: {'cancelled' if ended else 'asked to stop; its worker ends it at its next update'}")
        return 0
    if words:
        print(json.dumps(queue.get(words[0]).to_dict(), indent=2))
        return 0
    jobs = [j.to_dict() for j in queue.list(args.limit)]
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    print("id\ttask\tstatus\tprogress\tcreated_at\terror")
    for j in jobs:
        step = j["progress"].get("step")
        prog = f"{step}/{j['progress'].get('total_steps')}" if step else "-"
        print(f"{j['id']}\t{j['task']}\t{j['status']}\t{prog}\t{j['created_at']}\t{j['error'] or ''}")
    return 0


class _RegistryGiven(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        namespace.registry = values
        namespace.registry_given = True


def register_commands(sub: argparse._SubParsersAction) -> None:
    """``train``, ``eval``, ``worker``, ``submit`` and ``jobs``."""
    _add_train(sub)
    _add_eval(sub)
    _add_worker(sub)
    _add_submit(sub)
    _add_jobs(sub)


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a patch (BitFit; LoRA with --lora-rank) on a labelled JSONL/CSV file",
        description="Train only the selected biases of the frozen encoder plus a new head (with --lora-rank, "
        "low-rank updates of its linear layers as well), then write the patch "
        "to a file (--out, default TASK.safetensors) or register it (--registry). A progress bar shows loss, "
        "dev metric and ETA on a terminal; the final report is printed as JSON.",
    )
    add_training_options(p)
    p.add_argument("--train", required=True, help="training data (.jsonl or .csv)")
    p.add_argument("--dev", help="dev data for early stopping and model selection (default: 10%% of --train)")
    p.add_argument("--test", help="test data, scored once at the end")
    p.add_argument("--out", help="write the patch here (default TASK.safetensors)")
    p.add_argument(
        "--registry",
        action=_RegistryGiven,
        default=None,
        help="register the patch as the task's new version in this registry (checked before training starts) "
        "instead of writing a file; with --out as well, do both. If registering fails, the patch is saved to "
        "--out or TASK.safetensors",
    )
    p.add_argument("--report", help="write the JSON report here, and a PNG (learning curve + bias heatmap) beside it")
    p.add_argument("--model", default="default", help="base encoder: 'default', a local HF folder or a hub id")
    add_retention_option(p)
    add_min_replicas_option(p)
    p.set_defaults(func=_train, registry_given=False)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="score a patch on a labelled file",
        description="Apply a patch to the encoder and print its metrics on a labelled file as JSON.",
    )
    p.add_argument("--patch", required=True, help="a .safetensors patch file")
    p.add_argument("--data", required=True, help="labelled data (.jsonl or .csv) in the task's layout")
    p.add_argument(
        "--model", default="default", help="the base encoder the patch was trained on (default: the packaged MiniLM)"
    )
    p.add_argument("--batch-size", type=int, default=64, help="rows per evaluation batch (default 64)")
    p.set_defaults(func=_eval)


def _add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="train queued jobs and register the patches that pass their gate",
        description="Claim training jobs from the Redis queue (several workers may share a queue), train, "
        "evaluate, register the patch if it passes the job's gate, ack. With --concurrent-jobs K, up to K jobs "
        "train at once in one batch over the shared encoder; each keeps its own progress, cancel, time limit, gate "
        "and registration, a job that ends leaves without disturbing the others, and one claimed later joins at "
        "the next update. A "
        "job of a worker that died is retried by another after --lease-s seconds. On SIGTERM the worker stops "
        "training within a second or so, hands its jobs back to the queue (the next free worker takes them at once) "
        "and exits.",
    )
    add_registry_option(p)
    add_retention_option(p)
    add_min_replicas_option(p)
    p.add_argument("--queue", help=f"Redis URL of the job queue (env {QUEUE_ENV}; default: the registry if Redis)")
    p.add_argument(
        "--model",
        default=os.environ.get("PATCHSERVE_MODEL", "default"),
        help="base encoder, the same as the servers' (env PATCHSERVE_MODEL; default: the packaged MiniLM)",
    )
    p.add_argument(
        "--device",
        default=os.environ.get("PATCHSERVE_DEVICE") or "auto",
        help="where jobs train: auto, cpu, cuda or cuda:N (env PATCHSERVE_DEVICE; default auto); a job's own "
        "device setting wins when it is not 'auto'",
    )
    p.add_argument("--name", help="worker name in the queue (default host-pid-random, unique)")
    p.add_argument(
        "--lease-s",
        type=float,
        default=60.0,
        help="a job whose worker sent no heartbeat for this long is given to another worker (default 60)",
    )
    p.add_argument("--max-attempts", type=int, default=3, help="give a job up after this many attempts (default 3)")
    p.add_argument(
        "--concurrent-jobs",
        type=positive_int,
        default=os.environ.get("PATCHSERVE_CONCURRENT_JOBS") or "1",  # a string default: argparse checks it too
        metavar="K",
        help="train up to K queued jobs at once, their rows in one batch over the shared encoder (env "
        "PATCHSERVE_CONCURRENT_JOBS; default 1). More jobs an hour on a GPU, where one job's batch leaves it "
        "idle; each job takes longer, and its memory (its data, optimizer state, activations) is held at once",
    )
    p.add_argument("--max-jobs", type=int, help="exit after this many jobs (default: run until stopped)")
    p.add_argument(
        "--max-job-updates",
        type=int,
        default=int(os.environ.get("PATCHSERVE_MAX_JOB_UPDATES") or 100_000),
        help="fail a job that plans more optimizer updates than this over all its runs (env "
        "PATCHSERVE_MAX_JOB_UPDATES; default 100000, the server's limit for POST /jobs)",
    )
    p.add_argument(
        "--max-job-seconds",
        type=float,
        default=float(os.environ.get("PATCHSERVE_MAX_JOB_SECONDS") or 24 * 3600),
        help="stop a job (failed) that trains longer than this (env PATCHSERVE_MAX_JOB_SECONDS; default 86400)",
    )
    p.add_argument(
        "--alive-file",
        default=os.environ.get("PATCHSERVE_WORKER_ALIVE_FILE") or None,
        help="touch this file while the worker's loop turns (every 2 s while waiting, every second of a job), for a "
        "liveness probe that checks its age: older than --lease-s means hung (env PATCHSERVE_WORKER_ALIVE_FILE; "
        "docker-compose.yml's worker healthcheck uses it)",
    )
    p.add_argument("--log-level", default="info", help="debug, info, warning or error (default info)")
    p.set_defaults(func=_worker)


def _add_submit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "submit",
        help="queue a training job for the workers",
        description="Upload data files and a training config to the Redis job queue; prints the "
        "job id. Follow it with `patchserve jobs ID`.",
    )
    add_training_options(p)
    p.add_argument("--train", required=True, help="training data (.jsonl or .csv)")
    p.add_argument("--dev", help="dev data (default: 10%% of --train)")
    p.add_argument("--test", help="test data")
    p.add_argument("--min-dev", type=float, help="register only if the dev score (of --metric) reaches this")
    p.add_argument("--not-worse", action="store_true", help="register only if not worse than the current version")
    p.add_argument("--queue", help=f"Redis URL of the job queue (env {QUEUE_ENV})")
    add_min_replicas_option(p)
    p.set_defaults(func=_submit)


def _add_jobs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "jobs",
        help="show training jobs (all recent ones, or one by id), or cancel one",
        description="`patchserve jobs` lists recent jobs, `patchserve jobs ID` shows one, `patchserve jobs cancel ID` "
        "cancels one: a queued job ends at once, a running one at its worker's next update.",
    )
    p.add_argument("words", nargs="*", metavar="[cancel] ID", help="a job id, or 'cancel' and a job id")
    p.add_argument("--queue", help=f"Redis URL of the job queue (env {QUEUE_ENV})")
    p.add_argument("--limit", type=int, default=50, help="how many recent jobs to list (default 50)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    add_min_replicas_option(p)
    p.set_defaults(func=_jobs)
