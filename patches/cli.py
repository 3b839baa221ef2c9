"""The shared library's commands: ``inspect`` (read a patch file), the registry commands ``tasks``, ``register``
and ``prune``, and ``import-peft`` / ``export-peft`` (PEFT adapters in and out); and the options every command that
opens a registry shares."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

DEFAULT_REGISTRY = "disk://./registry"
REGISTRY_ENV = "PATCHSERVE_REGISTRY"
KEEP_VERSIONS_ENV = "PATCHSERVE_KEEP_VERSIONS"
MIN_REPLICAS_ENV = "PATCHSERVE_REDIS_MIN_REPLICAS"


def add_registry_option(p: argparse.ArgumentParser) -> None:
    """``--registry URL`` with the shared env var and default."""
    p.add_argument(
        "--registry",
        default=os.environ.get(REGISTRY_ENV, DEFAULT_REGISTRY),
        help=f"registry URL: disk:///path (a local folder) or redis://host:port/db; env {REGISTRY_ENV}; "
        f"default {DEFAULT_REGISTRY}",
    )


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, not {text!r}")
    return value


def add_retention_option(p: argparse.ArgumentParser, when: str = "after each registration") -> None:
    """``--keep-versions N`` for commands that register patches (or prune), with the shared env var."""
    env = os.environ.get(KEEP_VERSIONS_ENV) or None
    p.add_argument(
        "--keep-versions",
        type=positive_int,
        default=positive_int(env) if env else None,
        metavar="N",
        help=f"{when}: delete the task's versions beyond the newest N; the current version and any version "
        f"current in the last 10 minutes stay whatever their age (env {KEEP_VERSIONS_ENV}; default: keep all)",
    )


def add_min_replicas_option(p: argparse.ArgumentParser) -> None:
    """``--redis-min-replicas N`` for commands that write to a Redis registry or queue, with the shared env var."""
    p.add_argument(
        "--redis-min-replicas",
        type=int,
        default=int(os.environ.get(MIN_REPLICAS_ENV) or 0),
        metavar="N",
        help="a write to Redis counts as made only once N replicas hold it too (Redis WAIT, up to 2 s; else the "
        "command fails saying the write may still have happened); survives a failover. Env "
        f"{MIN_REPLICAS_ENV}; default 0: acknowledged by the primary alone, as Redis does",
    )


def patch_summary(patch: Any) -> dict[str, Any]:
    """What ``inspect`` shows about a patch (also used by the server's responses)."""
    m = patch.meta
    return {
        "task": m.task,
        "kind": m.kind,
        "labels": m.labels,
        "patch_id": patch.patch_id,
        "n_params": patch.n_params,
        "patch_type": m.patch_type,
        "n_bias_tensors": len(patch.biases),
        "n_scale_tensors": len(patch.scales),
        "n_lora_tensors": len(patch.lora),
        "lora_rank": patch.lora_rank,
        "base": {"name": m.base.name, "fingerprint": m.base.fingerprint},
        "bias_subset": m.bias_subset,
        "pooling": m.pooling,
        "max_seq_length": m.max_seq_length,
        "metrics": m.metrics,
        "training": m.training,
        "created_at": m.created_at,
        "format_version": m.format_version,
        "size_bytes": len(patch.data),
    }


def _inspect(args: argparse.Namespace) -> int:
    from patchserve.patches.format import Patch

    info = patch_summary(Patch.read(args.file, max_bytes=args.max_bytes))  # an invalid file: exit 1 with why
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        shown = json.dumps(value) if isinstance(value, dict | list) else value
        print(f"{key:<{width}}  {shown}")
    return 0


def _tasks(args: argparse.Namespace) -> int:
    from patchserve.patches.store import open_registry

    reg = open_registry(args.registry)
    found: dict[str, Any] = {}
    listed, after = 0, None
    while True:  # a page at a time: each task's record is read once, however many there are
        page = reg.page(1000, after=after, prefix=args.prefix or "")
        listed += len(page.items)
        for v in page.items:
            if args.json:
                found[v.task] = v.to_dict()
            else:
                print(f"{v.task}\tv{v.version}\t{v.patch_id}\t{v.registered_at}")
        if page.next_after is None:
            break
        after = page.next_after
    if args.json:
        print(json.dumps(found, indent=2))
    elif not listed:
        what = f"named {args.prefix}*" if args.prefix else "registered"
        print(f"no tasks {what} in {reg.url}")
    return 0


def _register(args: argparse.Namespace) -> int:
    from patchserve.patches.format import Patch
    from patchserve.patches.store import open_registry

    patch = Patch.read(args.file)
    registry = open_registry(args.registry, keep_versions=args.keep_versions, min_replicas=args.redis_min_replicas)
    info = registry.put(patch)
    print(f"registered {info.task} v{info.version} ({info.patch_id})")
    return 0


def _prune(args: argparse.Namespace) -> int:
    from patchserve.patches.errors import TaskNotFoundError
    from patchserve.patches.store import open_registry

    if args.grace_s is not None and args.grace_s < 0:
        print("error: --grace-s must be 0 or more", file=sys.stderr)
        return 2
    if args.keep_versions is None and not args.unservable:
        print(
            f"error: say how many versions to keep: --keep-versions N (or set {KEEP_VERSIONS_ENV}), or delete the "
            "versions this build cannot serve: --unservable",
            file=sys.stderr,
        )
        return 2
    reg = open_registry(args.registry, min_replicas=args.redis_min_replicas)
    if args.grace_s is not None:
        reg.retired_grace_s = args.grace_s
    pruned: dict[str, list[Any]] = {}
    for task in args.task or reg.tasks():
        try:
            unservable = reg.unservable(task) if args.unservable else []
            gone = reg.prune(task, args.keep_versions, dry_run=args.dry_run, also=[v.version for v in unservable])
            current = reg.info(task).version
        except TaskNotFoundError:
            if args.task:
                raise
            continue  # deleted while we listed
        if gone:
            pruned[task] = gone
        if any(v.version == current for v in unservable):  # a current version is never pruned: say what to do
            print(
                f"{task}: v{current} is current and this build cannot serve it; retrain the task or roll back "
                f"(`patchserve rollback {task} VERSION`), then prune again",
                file=sys.stderr,
            )
    if args.json:
        print(json.dumps({t: [v.to_dict() for v in gone] for t, gone in pruned.items()}, indent=2))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for task, gone in pruned.items():
        print(f"{task}: {verb} " + ", ".join(f"v{v.version}" for v in gone))
    n, size = sum(len(g) for g in pruned.values()), sum(v.size for g in pruned.values() for v in g)
    print(f"{verb} {n} versions of {len(pruned)} tasks ({size / 1e6:.1f} MB) in {reg.url}")
    return 0


def _import_peft(args: argparse.Namespace) -> int:
    from pathlib import Path

    from patchserve.patches.encoder import load_encoder
    from patchserve.patches.peft_io import import_peft

    labels = [x.strip() for x in args.labels.split(",")] if args.labels else None
    encoder = load_encoder(args.model)
    patch = import_peft(args.adapter, encoder, args.task, labels=labels, max_seq_length=args.max_seq_length)
    if args.registry is not None:
        from patchserve.patches.store import open_registry

        registry = open_registry(args.registry, keep_versions=args.keep_versions)
        info = registry.put(patch)
        print(f"registered {info.task} v{info.version} ({info.patch_id}) from {args.adapter}")
    if args.out or args.registry is None:
        out = Path(args.out or f"{args.task}.safetensors")
        out.write_bytes(patch.data)
        print(f"wrote {out}: a {patch.meta.patch_type} patch of {patch.n_params} values ({patch.patch_id})")
    return 0


def _export_peft(args: argparse.Namespace) -> int:
    from patchserve.patches.encoder import load_encoder
    from patchserve.patches.format import Patch
    from patchserve.patches.peft_io import export_peft

    patch = Patch.read(args.patch)
    out = export_peft(patch, args.dir, load_encoder(args.model))
    print(f"wrote the PEFT adapter of {patch.meta.task} to {out} (load it with PeftModel.from_pretrained)")
    return 0


def _add_peft_commands(sub: argparse._SubParsersAction) -> None:
    model_help = (
        "the base encoder the adapter was trained on: 'default' (the packaged MiniLM), a local HF folder or a hub id"
    )
    p = sub.add_parser(
        "import-peft",
        help="turn a PEFT LoRA or IA3 adapter folder into a patch (a file, or registered with --registry)",
        description="Read a Hugging Face PEFT adapter folder (adapter_config.json + adapter_model.safetensors, its "
        "classifier in modules_to_save) trained on the same base encoder and write it as a lora or bitfit-ia3 patch. "
        "What cannot be served exactly (DoRA, another base, unknown modules) is refused with the reason.",
    )
    p.add_argument("adapter", metavar="DIR", help="the PEFT adapter folder (what save_pretrained wrote)")
    p.add_argument("--task", required=True, help="the task name the patch serves under")
    p.add_argument(
        "--labels",
        help="the classifier's labels in order, comma-separated (default: LABEL_0, LABEL_1, ... as transformers "
        "names them)",
    )
    p.add_argument("--out", help="write the patch here (default TASK.safetensors, unless --registry is given)")
    p.add_argument("--registry", help="register the patch in this registry (disk:///path or redis://...) instead")
    p.add_argument("--model", default="default", help=model_help)
    p.add_argument(
        "--max-seq-length", type=positive_int, default=128, help="truncate inputs to this many tokens (default 128)"
    )
    add_retention_option(p)
    p.set_defaults(func=_import_peft)

    p = sub.add_parser(
        "export-peft",
        help="write a lora or bitfit-ia3 patch as a PEFT adapter folder",
        description="Write a lora or bitfit-ia3 patch as a PEFT adapter that PeftModel.from_pretrained loads onto "
        "the base model: BertForSequenceClassification for a pooler-pooled classifier or regressor, "
        "BertForTokenClassification for a tagger, the bare encoder (head in patchserve_head.safetensors) for a "
        "mean- or cls-pooled patch.",
    )
    p.add_argument("patch", metavar="PATCH", help="a .safetensors patch file")
    p.add_argument("dir", metavar="DIR", help="the folder to write (created if missing)")
    p.add_argument("--model", default="default", help=model_help)
    p.set_defaults(func=_export_peft)


def register_commands(sub: argparse._SubParsersAction) -> None:
    _add_peft_commands(sub)
    p = sub.add_parser("inspect", help="print a patch file's metadata; exit 1 with the reason if it is invalid")
    p.add_argument("file", help="a .safetensors patch file")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument(
        "--max-bytes", type=int, default=64 * 1024 * 1024, help="refuse files larger than this (default 64 MiB)"
    )
    p.set_defaults(func=_inspect)

    p = sub.add_parser("tasks", help="list the tasks in a registry with their current versions")
    add_registry_option(p)
    p.add_argument("--prefix", help="only the tasks whose names start with this (default: every task)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_tasks)

    p = sub.add_parser("register", help="store a patch file as the new current version of its task")
    p.add_argument("file", help="a .safetensors patch file")
    add_registry_option(p)
    add_retention_option(p)
    add_min_replicas_option(p)
    p.set_defaults(func=_register)

    p = sub.add_parser(
        "prune",
        help="delete old versions beyond the newest N of each task, once (what --keep-versions does after each "
        "registration)",
        description="Delete each task's versions beyond the newest --keep-versions. Kept whatever their age: the "
        "current version, and any version registered or current in the last 10 minutes (a replica that has not "
        "heard of the newer one yet may still be serving it). Servers and workers notice nothing: the current "
        "versions do not change. --dry-run lists what would go.",
    )
    add_registry_option(p)
    add_retention_option(p, when="now")
    add_min_replicas_option(p)
    p.add_argument("--task", action="append", help="only this task (repeatable; default: every task)")
    p.add_argument(
        "--grace-s",
        type=float,
        help="keep versions registered or current this many seconds ago or later (default 600, 10 minutes); 0 "
        "only when no replica can be serving an old version",
    )
    p.add_argument(
        "--unservable",
        action="store_true",
        help="also delete the versions this build cannot serve: patches of a retired type (bitfit-ln); with or "
        "without --keep-versions. A current one stays, and is named with what to do",
    )
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted; delete nothing")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON: task -> deleted versions")
    p.set_defaults(func=_prune)
