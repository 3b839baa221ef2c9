"""``train_patch(encoder, train, dev, config) -> TrainResult``: BitFit training, pure (no Redis, no HTTP).

Follows the few-sample practices of Zhang et al. (ICLR 2021): bias-corrected AdamW, linear warm-up over the first
10% of steps then linear decay, gradient clipping at 1.0, a minimum number of update steps so small data sets
train long enough, dev evaluation with early stopping and best-checkpoint restore (a tie goes to the later
checkpoint), restarts over seeds -- automatic on small data -- and an optional learning-rate search, both keeping
the best dev score of the task's selection metric (``TrainConfig.selection_metric``); on small data the restarts are
averaged into one patch.
``full=True`` fine-tunes every weight of the same encoder for comparison and returns a report only.

BitFit on a BERT encoder trains on the serving engine's packed model (``patches/packed_model.py``): no padding
reaches a matrix product, and a job's restarts and learning-rate candidates train together in one batch, each row
carrying its run's biases, each run keeping its own head, optimizer, schedule, early stopping and checkpoint. The
gradients are the padded model's, so results equal training the runs one by one. Full fine-tuning and encoders
the packed model does not cover train padded, one run at a time.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from patches.bitfit import (
    SCALES,
    bias_parameters,
    bias_roles,
    extract_patch,
    ia3_roles,
    ia3_values,
    trained_names,
)
from patches.data import Dataset
from patches.encoder import Encoder, resolve_device
from patches.errors import EncoderError
from patches.format import BaseRef, Label, Patch, PatchMeta
from patches.model import TaskModel, pool
from patches.packed import PackedBert, packed_unsupported
from patches.packed_model import PackedTaskModel, Part, joint_forward
from patches.train_config import SMALL_DATA_ROWS, SMALL_DEV_ROWS, TrainConfig
from trainer.metrics import classification_metrics, regression_metrics, tagging_metrics

IGNORE = -100


@dataclass
class Features:
    input_ids: list[int]
    token_type_ids: list[int]
    label: int | float | list[int]


@dataclass
class TrainResult:
    patch: Patch | None  # None for --full
    report: dict[str, Any]
    model: TaskModel  # the best model (for evaluation and tests)


ProgressFn = Callable[[dict[str, Any]], None]
StopFn = Callable[[], bool]


class TrainingStopped(Exception):
    """``should_stop`` said so: the run ended between two steps, and nothing was produced."""

    def __init__(self, step: int, total: int, stage: str | None = None) -> None:
        super().__init__(f"stopped at update {step} of {total}" + (f" of the {stage} stage" if stage else ""))
        self.step, self.total, self.stage = step, total, stage


def _never() -> bool:
    return False


def progress_line(p: dict[str, Any]) -> str:
    """One plain line for a progress report (what ``on_progress`` receives), for logs and non-terminal stderr."""
    dev = "".join(f" dev {k} {v:.4f}" for k, v in (p["dev"] or {}).items())
    stage = f"{p['stage']} " if p.get("stage") else ""
    return f"{stage}step {p['step']}/{p['total_steps']} loss {p['loss']:.4f}{dev} (seed={p['seed']} lr={p['lr']:g})"


def progress_logger(every_s: float = 30.0, prefix: str = "") -> ProgressFn | None:
    """An ``on_progress`` that prints a plain ``progress_line`` on stderr at most every ``every_s`` seconds (and at a
    stage's last update), each after ``prefix`` (which run it is, where several share a log) -- or None when stderr
    is a terminal, where the trainer's progress bar shows instead. For logs, CI and ``nohup``, where there is no
    bar and an hour-long run would otherwise print nothing until it ends."""
    if sys.stderr.isatty():
        return None
    last = [-math.inf]

    def log(p: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - last[0] < every_s and p["step"] != p["total_steps"]:
            return
        last[0] = now
        print(prefix + progress_line(p), file=sys.stderr, flush=True)

    return log


def featurize(tokenizer: Any, ds: Dataset, labels: Sequence[Label], max_len: int) -> list[Features]:
    """Tokenise a data set once. Tagging: the first sub-word of each word carries its tag, the rest are ignored.
    Labels are matched by their text, so a patch's "1" (as older patches stored every label) takes a file's 1."""
    index = {str(label): i for i, label in enumerate(labels)}
    if ds.kind == "token-classification":
        enc = tokenizer([e.tokens for e in ds.examples], is_split_into_words=True, truncation=True, max_length=max_len)
        feats = []
        for i, e in enumerate(ds.examples):
            tags, seen = [], set()
            for w in enc.word_ids(i):
                tags.append(IGNORE if w is None or w in seen else index[e.tags[w]])
                if w is not None:
                    seen.add(w)
            types = enc["token_type_ids"][i] if "token_type_ids" in enc else [0] * len(tags)
            feats.append(Features(enc["input_ids"][i], types, tags))
        return feats
    pairs = [e.text_pair for e in ds.examples] if ds.is_pair else None
    enc = tokenizer([e.text for e in ds.examples], pairs, truncation=True, max_length=max_len)
    out = []
    for i, e in enumerate(ds.examples):
        label: int | float = float(e.label) if ds.kind == "regression" else index[str(e.label)]  # type: ignore[arg-type]
        types = enc["token_type_ids"][i] if "token_type_ids" in enc else [0] * len(enc["input_ids"][i])
        out.append(Features(enc["input_ids"][i], types, label))
    return out


def collate(feats: list[Features], pad_id: int, kind: str, device: torch.device) -> dict[str, torch.Tensor]:
    n, t = len(feats), max(len(f.input_ids) for f in feats)
    ids = torch.full((n, t), pad_id, dtype=torch.long)
    types = torch.zeros((n, t), dtype=torch.long)
    mask = torch.zeros((n, t), dtype=torch.long)
    for i, f in enumerate(feats):
        k = len(f.input_ids)
        ids[i, :k], types[i, :k], mask[i, :k] = torch.tensor(f.input_ids), torch.tensor(f.token_type_ids), 1
    if kind == "token-classification":
        labels = torch.full((n, t), IGNORE, dtype=torch.long)
        for i, f in enumerate(feats):
            labels[i, : len(f.label)] = torch.tensor(f.label)  # type: ignore[arg-type]
    elif kind == "regression":
        labels = torch.tensor([float(f.label) for f in feats])  # type: ignore[arg-type]
    else:
        labels = torch.tensor([int(f.label) for f in feats])  # type: ignore[arg-type]
    return {
        "input_ids": ids.to(device),
        "token_type_ids": types.to(device),
        "attention_mask": mask.to(device),
        "labels": labels.to(device),
    }


def loss_fn(kind: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if kind == "regression":
        return nn.functional.mse_loss(logits.squeeze(-1), labels)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (dropout off) for the block; its previous mode is restored after, a stop included."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def unit_vectors(
    encoder: Encoder, texts: Sequence[str], pooling: str, max_len: int, batch_size: int = 64
) -> torch.Tensor:
    """The frozen encoder's pooled, L2-normalised vector of each of ``texts`` ([N, hidden] float32, on the CPU),
    encoded in eval mode on the device the encoder is on (its mode is restored after)."""
    model = encoder.model
    device = next(model.parameters()).device
    out = []
    with eval_mode(model):
        for i in range(0, len(texts), batch_size):
            enc = encoder.tokenizer(
                list(texts[i : i + batch_size]), padding=True, truncation=True, max_length=max_len, return_tensors="pt"
            ).to(device)
            result = model(**enc)
            pooler = getattr(result, "pooler_output", None)
            pooled = pool(pooling, result.last_hidden_state, enc["attention_mask"], pooler)
            out.append(nn.functional.normalize(pooled.float(), dim=-1).cpu())
    return torch.cat(out)


def label_vectors(encoder: Encoder, labels: Sequence[Label], pooling: str, max_len: int) -> torch.Tensor:
    """The rows of a label-name head (``head_init="labels"``): ``unit_vectors`` of the labels' names, each read as
    text, lower-cased, underscores as spaces."""
    return unit_vectors(encoder, [str(label).replace("_", " ").lower() for label in labels], pooling, max_len)


def evaluate(
    model: TaskModel | PackedTaskModel,
    feats: list[Features],
    pad_id: int,
    labels: Sequence[Label],
    batch_size: int = 64,
    should_stop: StopFn = _never,
    run: int | None = None,
) -> dict[str, float]:
    """Metrics of ``model`` on featurised data (eval mode; restores the previous mode); ``labels`` are the task's
    labels or tags, in head order; ``run``: which run of a PackedTaskModel. ``should_stop`` is asked between
    batches (a long dev set must not delay a stop); it raises TrainingStopped(0, 0) when it says so."""
    runs = None if run is None else [run]
    return evaluate_runs(model, feats, pad_id, labels, runs, batch_size=batch_size, should_stop=should_stop)[0]


@torch.no_grad()
def evaluate_runs(
    model: TaskModel | PackedTaskModel,
    feats: list[Features],
    pad_id: int,
    labels: Sequence[Label],
    runs: Sequence[int] | None,
    batch_size: int = 64,
    should_stop: StopFn = _never,
) -> list[dict[str, float]]:
    """``evaluate`` for several runs of a PackedTaskModel at once (each batch of rows goes in once per run, in one
    forward); ``runs=None`` evaluates a plain model. One metrics dict per run, in order."""
    device = next(model.parameters()).device
    k = 1 if runs is None else len(runs)
    preds: list[list[np.ndarray]] = [[] for _ in range(k)]
    golds: list[list[np.ndarray]] = [[] for _ in range(k)]
    with eval_mode(model):
        for i in range(0, len(feats), batch_size):
            if should_stop():
                raise TrainingStopped(0, 0)
            chunk = feats[i : i + batch_size]
            b = collate(chunk * k, pad_id, model.kind, device)
            if runs is None:
                logits = model(b["input_ids"], b["attention_mask"], b["token_type_ids"])
            else:
                run = torch.tensor([r for r in runs for _ in chunk], device=device)
                logits = model(b["input_ids"], b["attention_mask"], b["token_type_ids"], run=run)
            logits, gold_all = logits.float().cpu(), b["labels"].cpu()
            for j in range(k):
                rows = slice(j * len(chunk), (j + 1) * len(chunk))
                out, gold = logits[rows], gold_all[rows].numpy()
                if model.kind == "regression":
                    preds[j].append(out.squeeze(-1).numpy())
                    golds[j].append(gold)
                elif model.kind == "token-classification":  # one array per sentence: entities must not span two
                    for row_pred, row_gold in zip(out.argmax(-1).numpy(), gold, strict=True):
                        keep = row_gold != IGNORE
                        preds[j].append(row_pred[keep])
                        golds[j].append(row_gold[keep])
                else:
                    preds[j].append(out.argmax(-1).numpy())
                    golds[j].append(gold)
    results = []
    for p, g in zip(preds, golds, strict=True):
        if model.kind == "token-classification":
            results.append(tagging_metrics(p, g, labels))
            continue
        pred, gold = np.concatenate(p), np.concatenate(g)
        score = regression_metrics if model.kind == "regression" else classification_metrics
        results.append(score(pred, gold))
    return results


def _schedule(total: int, warmup: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))

    return factor


def trainable_parameters(model: TaskModel, config: TrainConfig) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(encoder parameters to train, head parameters); nothing else keeps ``requires_grad``."""
    model.requires_grad_(False)
    if config.full:
        encoder = list(model.encoder.parameters())
    else:
        params = bias_parameters(model.encoder)
        encoder = [params[n] for n in trained_names(model.encoder, config.bias_subset, config.scales)]
    head = list(model.head.parameters())
    for p in [*encoder, *head]:
        p.requires_grad_(True)
    return encoder, head


def _set_dropout(module: nn.Module, rate: float) -> None:
    """Every dropout in ``module`` (BERT's attention reads its rate from its ``nn.Dropout`` too) drops ``rate``."""
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = rate


@dataclass
class _Run:
    """One training run's own state (its model parameters live in the shared model)."""

    index: int
    seed: int
    lr: float
    head_lr: float
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    rng: random.Random
    order: list[int] = field(default_factory=list)
    best: dict[str, Any] = field(default_factory=lambda: {"score": -math.inf, "step": 0, "metrics": {}, "state": None})
    history: list[dict[str, float]] = field(default_factory=list)
    bad_evals: int = 0
    running: float = 0.0
    last_dev: dict[str, float] | None = None
    last_eval: int = 0
    steps: int = 0
    seconds: float = 0.0
    active: bool = True


def _snapshot(model: TaskModel | PackedTaskModel, run: _Run) -> Any:
    if isinstance(model, PackedTaskModel):  # the run's own parameters
        return [p.detach().clone() for p in run.params]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def _restore(model: TaskModel | PackedTaskModel, run: _Run, state: Any) -> None:
    if isinstance(model, PackedTaskModel):
        for p, saved in zip(run.params, state, strict=True):
            p.copy_(saved)
    else:
        model.load_state_dict(state)


def packed_task_model(
    base: nn.Module,
    heads: Sequence[nn.Linear],
    kind: str,
    pooling: str,
    config: TrainConfig,
    packed: PackedBert | None = None,
) -> PackedTaskModel:
    """The packed model a BitFit job trains: ``heads`` (one per run) over ``base``, the config's biases trained
    from the encoder's values, at the config's dropout (None: the encoder's own rates); ``packed``: a
    ``training_bert(base)`` shared with other jobs' models, so that their rows encode together."""
    cfg: Any = getattr(base, "config", None)
    return PackedTaskModel(
        base,
        heads,
        kind,
        pooling,
        trained_names(base, config.bias_subset, config.scales),
        hidden_dropout=config.dropout if config.dropout is not None else float(cfg.hidden_dropout_prob),
        attention_dropout=config.dropout if config.dropout is not None else float(cfg.attention_probs_dropout_prob),
        packed=packed,
    )


@dataclass
class _Update:
    """One update's rows of a run group: the runs in it, each run's span of rows, the padded batch."""

    active: list[_Run]
    spans: list[tuple[int, int]]
    batch: dict[str, torch.Tensor]
    run_of_row: torch.Tensor | None  # packed: each row's run


def _part(model: TaskModel | PackedTaskModel, u: _Update) -> Part:
    """An update's rows as a ``joint_forward`` part (packed models only)."""
    assert isinstance(model, PackedTaskModel)
    b = u.batch
    return model, b["input_ids"], b["attention_mask"], b["token_type_ids"], u.run_of_row


class _RunGroup:
    """Runs ``specs`` ((learning rate, seed) each) of one job that train together, an update at a time: packed,
    every run's rows in one batch; or padded, one run (a TaskModel on a copy of the encoder). Each run keeps the
    best dev checkpoint -- or with ``checkpoint="last"`` the final one -- which ``results()`` puts in the model.

    The job's config is resolved (``TrainConfig.resolved()``): epochs and patience are set."""

    stage: str | None = None  # the runs themselves (TrainingStopped and progress name any other stage)

    def __init__(self, job: PatchTraining, specs: Sequence[tuple[float, int]], packed: bool) -> None:
        config = job.config
        assert config.epochs is not None and config.patience is not None, "pass config.resolved()"
        if not packed and len(specs) != 1:
            raise ValueError("the padded model trains one run at a time")
        self.job, self.config, self.patience = job, config, config.patience
        encoder, kind = job.encoder, job.kind
        device = resolve_device(config.device)
        n_out = 1 if kind == "regression" else len(job.labels)
        heads = []
        for _, seed in specs:  # each run's head starts where a run of its own would start it; restarts that are
            torch.manual_seed(config.seed if config.restarts_merge == "average" else seed)  # averaged start alike
            head = nn.Linear(encoder.hidden_size, n_out)
            if config.head_init == "labels":  # every run alike: the label names' vectors, no bias
                with torch.no_grad():
                    head.weight.copy_(job.label_vectors())
                    head.bias.zero_()
            heads.append(head)
        self.model: TaskModel | PackedTaskModel
        groups: list[tuple[list[nn.Parameter], list[nn.Parameter]]]
        if packed:
            base, shared = job.packed_base(device)
            self.model = packed_task_model(base, heads, kind, job.pooling, config, shared)
            groups = [self.model.run_parameters(r) for r in range(len(specs))]
        else:
            self.model = TaskModel(copy.deepcopy(encoder.model), heads[0], kind, job.pooling).to(device)
            if config.dropout is not None:
                _set_dropout(self.model.encoder, config.dropout)
            groups = [trainable_parameters(self.model, config)]
        self.device = device
        steps_per_epoch = math.ceil(len(job.train_f) / config.batch_size)
        self.total = total = config.planned_steps(len(job.train_f))
        self.runs: list[_Run] = []
        for i, ((lr, seed), (encoder_params, head_params)) in enumerate(zip(specs, groups, strict=True)):
            head_lr = config.head_lr or lr
            param_groups: list[dict[str, Any]] = [{"params": encoder_params}, {"params": head_params, "lr": head_lr}]
            optimizer = torch.optim.AdamW(  # bias-corrected Adam
                param_groups,
                lr=lr,
                weight_decay=config.weight_decay,
            )
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(total, int(config.warmup_ratio * total)))
            params = encoder_params + head_params
            self.runs.append(_Run(i, seed, lr, head_lr, params, optimizer, scheduler, random.Random(seed)))
        # 4 dev evaluations per epoch of the planned run: where min_steps stretches a small data set's run, the
        # epoch (and the evaluations) stretch with it, so patience always spans the same share of the run and
        # cannot end it during the warm-up.
        epoch_steps = max(steps_per_epoch, int(total / config.epochs))
        self.eval_every = config.eval_every or max(1, min(1000, epoch_steps // 4))
        self.pad_id = job.pad_id
        desc = f"{config.task} {len(specs)} runs"
        if len(specs) == 1:
            desc = f"{config.task} seed={specs[0][1]} lr={specs[0][0]:g}"
        self.bar = tqdm(total=total, desc=desc, disable=not sys.stderr.isatty(), leave=False, dynamic_ncols=True)
        self.model.train()
        self.step = 0
        self.t0 = self.last_report = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.step >= self.total or not any(r.active for r in self.runs)

    def next_update(self) -> _Update:
        """The rows of the next update: a batch from each active run's own shuffled order."""
        rows: list[int] = []
        spans = []
        active = [r for r in self.runs if r.active]
        for r in active:
            if not r.order:
                r.order = list(range(len(self.job.train_f)))
                r.rng.shuffle(r.order)
            idx, r.order = r.order[: self.config.batch_size], r.order[self.config.batch_size :]
            spans.append((len(rows), len(rows) + len(idx)))
            rows += idx
        batch = collate([self.job.train_f[i] for i in rows], self.pad_id, self.job.kind, self.device)
        run_of_row = None
        if isinstance(self.model, PackedTaskModel):
            run_of_row = torch.tensor([r.index for r, (a, b) in zip(active, spans, strict=True) for _ in range(b - a)])
        return _Update(active, spans, batch, run_of_row)

    def part(self, u: _Update) -> Part:
        """The update's rows as a ``joint_forward`` part (packed groups only)."""
        return _part(self.model, u)

    def forward(self, u: _Update) -> torch.Tensor:
        """The padded model's logits (a packed group's rows go through ``joint_forward``, as its ``part``)."""
        assert isinstance(self.model, TaskModel)
        b = u.batch
        return self.model(b["input_ids"], b["attention_mask"], b["token_type_ids"])

    def losses(self, logits: torch.Tensor, u: _Update) -> list[torch.Tensor]:
        """Each active run's loss on its own rows; clears the runs' gradients for the backward to come."""
        for r in u.active:
            r.optimizer.zero_grad(set_to_none=True)
        kind, labels = self.job.kind, u.batch["labels"]
        return [loss_fn(kind, logits[a:b], labels[a:b]) for a, b in u.spans]

    def apply(self, u: _Update, losses: list[torch.Tensor]) -> None:
        """After the backward: step each run's optimizer, evaluate on dev when due (early stopping: a run whose
        patience ran out leaves the batch), report progress. A stop asked during the evaluation raises
        TrainingStopped."""
        config, job = self.config, self.job
        step = self.step = self.step + 1
        for r, loss in zip(u.active, losses, strict=True):
            torch.nn.utils.clip_grad_norm_(r.params, config.max_grad_norm)
            r.optimizer.step()
            r.scheduler.step()
            value = loss.item()
            r.running = 0.9 * r.running + 0.1 * value if step > 1 else value
            r.steps = step
        self.bar.update(1)
        evaluated = step % self.eval_every == 0 or step == self.total
        if evaluated:
            try:
                scores = evaluate_runs(
                    self.model,
                    job.dev_f,
                    self.pad_id,
                    job.labels,
                    [r.index for r in u.active] if isinstance(self.model, PackedTaskModel) else None,
                    should_stop=job.should_stop,
                )
            except TrainingStopped:
                raise TrainingStopped(step, self.total, self.stage) from None
            for r, metrics in zip(u.active, scores, strict=True):
                r.last_dev, score = metrics, metrics[job.metric]
                r.history.append({"step": step, "loss": r.running, f"dev_{job.metric}": score})
                # A tie goes to the later checkpoint: on a small dev set (26 rows score in steps of 4%) ties are
                # common, and of two checkpoints the dev set cannot tell apart, the one trained longer is the
                # better bet. Only a strict gain resets the patience.
                r.bad_evals = 0 if score > r.best["score"] else r.bad_evals + 1
                if score >= r.best["score"]:
                    state = None if job.checkpoint == "last" else _snapshot(self.model, r)
                    r.best = {"score": score, "step": step, "metrics": metrics, "state": state}
                r.last_eval = step
                if r.bad_evals >= self.patience:  # early stopping: this run leaves the batch
                    r.active = False
                    r.seconds = time.perf_counter() - self.t0
        lead = max(self.runs, key=lambda r: r.best["score"])  # a tie: the earlier run
        if evaluated:
            self.bar.set_postfix(loss=f"{lead.running:.4f}", dev=f"{lead.best['score']:.4f}", runs=len(u.active))
        # Reported at every evaluation and on a timer in between: the worker's lease heartbeat rides on this.
        if job.on_progress is not None and (
            evaluated or time.perf_counter() - self.last_report >= job.progress_every_s
        ):
            self.last_report = time.perf_counter()
            job.on_progress(
                ({"stage": self.stage} if self.stage else {})
                | {
                    "step": step,
                    "total_steps": self.total,
                    "loss": lead.running,
                    "dev": lead.last_dev,
                    "seed": lead.seed,
                    "lr": lead.lr,
                    "runs": len(self.runs),
                    "active_runs": sum(r.active for r in self.runs),
                }
            )

    def results(self) -> list[dict[str, Any]]:
        """Each run's history (``"run"``: its index in a PackedTaskModel), its kept checkpoint restored."""
        self.bar.close()
        results = []
        for r in self.runs:
            if r.active:
                r.seconds = time.perf_counter() - self.t0
            if self.job.checkpoint == "best":
                _restore(self.model, r, r.best["state"])  # best-checkpoint restore
                kept_dev, kept_step = r.best["metrics"], r.best["step"]
            else:  # the run always ends on an evaluation (the last update, or the one that exhausted the patience)
                assert r.last_dev is not None
                kept_dev, kept_step = r.last_dev, r.last_eval
            results.append(
                {
                    "run": r.index,
                    "seed": r.seed,
                    "lr": r.lr,
                    "head_lr": r.head_lr,
                    "best_dev": kept_dev,
                    "best_step": kept_step,
                    "steps": r.steps,
                    "planned_steps": self.total,
                    "seconds": r.seconds,
                    "history": r.history,
                    "trainable_params": sum(p.numel() for p in r.params),
                    "params": r.params,  # the kept checkpoint's trained parameters (for averaging)
                }
            )
        self.model.eval()
        return results


def bias_movement(trained: nn.Module, base: nn.Module) -> dict[str, dict[str, float]]:
    """mean |b_trained - b_base| per bias role and layer (the BitFit paper's Figure 1)."""
    try:
        roles = bias_roles(base)
    except EncoderError:
        return {}
    now, then = bias_parameters(trained), bias_parameters(base)
    out: dict[str, dict[str, float]] = {}
    for name, role in roles.items():
        if name in now:
            delta = (now[name].detach().cpu().float() - then[name].detach().cpu().float()).abs().mean()
            out.setdefault(role.role, {})["-" if role.layer is None else str(role.layer)] = float(delta)
    return out


def scale_movement(trained: nn.Module) -> dict[str, dict[str, float]]:
    """mean |s - 1| of each (IA)^3 scale of a plain model (``apply_values`` set them), by its role (k, v, ff: the
    key, value and feed-forward intermediate) and layer, as ``bias_movement`` gives the biases'."""
    roles = ia3_roles(trained)
    out: dict[str, dict[str, float]] = {}
    for name, scale in ia3_values(trained).items():
        role = roles[name]
        out.setdefault(role.role, {})[str(role.layer)] = float((scale.detach().cpu().float() - 1).abs().mean())
    return out


class PatchTraining:
    """One job's training, an update at a time: what ``train_patch`` does, in pieces, so that several jobs can
    train in one batch (``JointTrainer``). ``finish()`` builds the result once every run has trained.

    Arguments as ``train_patch``'s; ``packed_bert``: a ``training_bert(encoder.model)`` shared by the trainings that
    should encode together (each builds its own without one)."""

    def __init__(
        self,
        encoder: Encoder,
        train: Dataset,
        dev: Dataset,
        config: TrainConfig,
        *,
        test: Dataset | None = None,
        heldout: Dataset | None = None,
        on_progress: ProgressFn | None = None,
        progress_every_s: float = 2.0,
        should_stop: StopFn = _never,
        packed: bool | None = None,
        packed_bert: PackedBert | None = None,
    ) -> None:
        self.t0 = time.perf_counter()
        kind, labels = train.kind, train.labels
        if any(ds is not None and ds.kind != kind for ds in (dev, test, heldout)):
            kinds = "/".join(ds.kind if ds else "-" for ds in (dev, test, heldout))
            raise ValueError(f"train is {kind} but dev/test/heldout are {kinds}; use one kind")
        pooling = config.pooling or encoder.default_pooling
        if pooling == "pooler" and getattr(encoder.model, "pooler", None) is None:
            raise ValueError("pooling 'pooler' needs an encoder with a pooler layer; use 'cls' or 'mean'")
        self.encoder, self.kind, self.labels, self.pooling = encoder, kind, labels, pooling
        self.train, self.dev, self.test, self.heldout = train, dev, test, heldout
        self.metric = config.selection_metric(kind, labels)
        self.max_len = min(config.max_seq_length, encoder.max_positions)
        tok = encoder.tokenizer
        self.pad_id = int(tok.pad_token_id or 0)
        self.train_f, self.dev_f = (
            featurize(tok, train, labels, self.max_len),
            featurize(tok, dev, labels, self.max_len),
        )
        restarts = config.restarts_for(len(train))
        self.restarts_why = (
            f"set: restarts={restarts}"
            if config.restarts is not None
            else f"automatic: {len(train)} training rows are {'under' if restarts > 1 else 'at least'} "
            f"{SMALL_DATA_ROWS}, so {restarts} seed(s)"
        )
        checkpoint = config.checkpoint_for(len(dev))
        self.checkpoint_why = (
            f"set: checkpoint={checkpoint}"
            if config.checkpoint is not None
            else f"automatic: a dev set of {len(dev)} rows "
            + (
                f"(under {SMALL_DEV_ROWS}) cannot rank checkpoints, so the last one is kept"
                if checkpoint == "last"
                else "ranks checkpoints, so the best one is kept"
            )
        )
        merge = config.restarts_merge_for(len(train))
        if restarts > 1:
            self.restarts_why += f", {'averaged into one patch' if merge == 'average' else 'the best dev score kept'}"
        unsupported = "full fine-tuning trains every weight" if config.full else packed_unsupported(encoder.model)
        if packed and unsupported:
            raise ValueError(f"packed training is not possible: {unsupported}")
        self.packed = unsupported is None if packed is None else packed
        if config.scales == "ia3" and not self.packed:
            why = unsupported or "packed=False"
            raise ValueError(f"(IA)^3 scales train on the packed model, which is off here ({why}); use other scales")
        config.check_head_init(kind)
        head_init, self.head_init_why = config.head_init_why(kind, len(train))
        self._label_vectors: torch.Tensor | None = None
        self.config = config = replace(
            config.resolved(), restarts=restarts, checkpoint=checkpoint, restarts_merge=merge, head_init=head_init
        )
        self.checkpoint: str = checkpoint
        assert config.lr is not None
        self.packed_bert = packed_bert if self.packed else None
        self.lrs = config.lr_search or [config.lr]
        specs = [(lr, config.seed + r) for lr in self.lrs for r in range(restarts)]
        self._queued = [specs] if self.packed else [[spec] for spec in specs]  # run groups still to train
        self._group: _RunGroup | None = None
        self._moved: nn.Module | None = None  # the encoder copied to the training device (packed_base)
        self.on_progress, self.progress_every_s, self.should_stop = on_progress, progress_every_s, should_stop
        self._models: list[TaskModel | PackedTaskModel] = []  # the model of each run
        self._runs: list[dict[str, Any]] = []
        self._scored: dict[str, list[Features]] = {}  # the test / held-out rows featurised (_scored_features)

    def packed_base(self, device: torch.device) -> tuple[nn.Module, PackedBert | None]:
        """The encoder the job's packed models read on ``device``, and the ``training_bert`` they share with other
        jobs: the job's own encoder, or one copy of it moved to ``device`` (made once for every run group; the copy
        shares no training_bert)."""
        base = self.encoder.model
        if next(base.parameters()).device == device:
            return base, self.packed_bert
        if self._moved is None:  # (a job trains on one device)
            self._moved = copy.deepcopy(base).to(device)
        return self._moved, None

    def label_vectors(self) -> torch.Tensor:
        """The rows of a label-name head (``head_init="labels"``): the frozen encoder's vectors of the label names,
        computed once for the job's runs."""
        if self._label_vectors is None:
            self._label_vectors = label_vectors(self.encoder, self.labels, self.pooling, self.max_len)
        return self._label_vectors

    def group(self) -> _RunGroup | None:
        """The run group that trains now (None: every run has trained). Padded training trains its runs one after
        another, each its own group."""
        while self._group is None or self._group.done:
            if self._group is not None:
                results = self._group.results()
                self._models += [self._group.model] * len(results)
                self._runs += results
                self._group = None
            if not self._queued:
                return None
            self._group = _RunGroup(self, self._queued.pop(0), self.packed)
        return self._group

    def _scored_features(self) -> dict[str, list[Features]]:
        """The test and held-out sets (those given) featurised, once a job."""
        for name, ds in (("test", self.test), ("heldout", self.heldout)):
            if ds is not None and name not in self._scored:
                self._scored[name] = featurize(self.encoder.tokenizer, ds, self.labels, self.max_len)
        return self._scored

    def close(self) -> None:
        """Release the progress bar of a training that ends without finishing."""
        if self._group is not None:
            self._group.bar.close()

    def finish(self) -> TrainResult:
        """The result, once ``group()`` is None: the best run chosen on dev -- or with ``restarts_merge="average"``
        the best learning rate's restarts averaged into one model -- the test (and held-out) set scored, the patch
        built. A stop asked while a set is scored raises TrainingStopped."""
        assert self.group() is None, "finish() before every run has trained"
        config, runs, models, metric = self.config, self._runs, self._models, self.metric
        train, dev, test, encoder = self.train, self.dev, self.test, self.encoder
        scored = self._scored_features()
        shown_runs = [{k: r[k] for k in ("seed", "lr", "best_dev", "best_step", "steps", "seconds")} for r in runs]
        try:  # every run is scored, so the report shows what the restarts bought; the kept one is chosen on dev
            for name, feats in scored.items():  # alone all the same
                for shown_run, score in zip(shown_runs, self._score(runs, models, feats), strict=True):
                    shown_run[name] = score
            candidates, merged = runs, None
            if config.restarts_merge == "average" and (config.restarts or 1) > 1:
                candidates, merged = self._average_restarts(scored)
        except TrainingStopped:
            last = runs[-1]
            raise TrainingStopped(last["steps"], last["planned_steps"]) from None
        best_index = max(range(len(candidates)), key=lambda i: candidates[i]["best_dev"][metric])  # a tie: the
        best = candidates[best_index]  # earlier run, the seed (or learning rate) asked for
        chosen = models[best_index if merged is None else best["index"]]
        model = chosen.task_model(best["run"]) if isinstance(chosen, PackedTaskModel) else chosen
        if isinstance(chosen, PackedTaskModel) and config.dropout is not None:
            _set_dropout(model.encoder, config.dropout)  # the rate it trained with, as the padded model has it
        report: dict[str, Any] = {
            "task": config.task,
            "kind": self.kind,
            "mode": "full" if config.full else "bitfit",
            "bias_subset": None if config.full else config.bias_subset,
            "scales": None if config.full else config.scales,
            "pooling": self.pooling,
            "labels": self.labels,
            "encoder": {"name": encoder.name, "fingerprint": encoder.fingerprint},
            "train_rows": len(train),
            "dev_rows": len(dev),
            "test_rows": len(test) if test else 0,
            "lr": best["lr"],
            "head_lr": best["head_lr"],
            "seed": best["seed"],
            "steps": best["steps"],
            "planned_steps": best["planned_steps"],
            "best_step": best["best_step"],
            "trainable_params": best["trainable_params"],
            "total_params": sum(p.numel() for p in model.parameters()),
            "metric": metric,
            "dev": best["best_dev"],
            "selection": {
                "metric": metric,
                "restarts": config.restarts,
                "restarts_why": self.restarts_why,
                "restarts_merge": config.restarts_merge,
                "head_init": config.head_init,
                "head_init_why": self.head_init_why,
                "checkpoint": self.checkpoint,
                "checkpoint_why": self.checkpoint_why,
                "learning_rates": self.lrs,
                "tried": len(runs),
            },
            "seconds": time.perf_counter() - self.t0,
            "forward": "packed" if self.packed else "padded",
            "history": best["history"],
            "runs": shown_runs,
            "config": asdict(config),
        }
        if merged is not None:
            report["merged"] = merged
        source = merged[best_index] if merged is not None else shown_runs[best_index]
        report.update({name: source[name] for name in scored})
        report["bias_movement"] = bias_movement(model.encoder, encoder.model)
        if not config.full and config.scales == "ia3":
            report["scale_movement"] = scale_movement(model.encoder)
        del models, chosen  # the other runs' models
        self._models, self._moved, self._scored = [], None, {}
        if config.full:
            return TrainResult(None, report, model)
        metrics = {f"dev_{k}": v for k, v in best["best_dev"].items()}
        metrics.update({f"test_{k}": v for k, v in report.get("test", {}).items()})
        meta = PatchMeta(
            task=config.task,
            kind=self.kind,
            labels=self.labels if self.kind != "regression" else [],
            base=BaseRef(encoder.name, encoder.fingerprint),
            bias_subset=config.bias_subset,
            patch_type=SCALES[config.scales],
            pooling=self.pooling,
            max_seq_length=self.max_len,
            text_pair=train.is_pair,
            metrics=metrics,
            training={
                k: report[k] for k in ("lr", "seed", "steps", "train_rows", "seconds", "trainable_params", "metric")
            }
            | {"restarts": config.restarts}
            | ({"restarts_merge": "average"} if merged is not None else {})
            | ({"head_init": "labels"} if config.head_init == "labels" else {}),
        )
        patch = extract_patch(model.encoder.cpu(), model.head.cpu(), meta)
        return TrainResult(patch, report, model)

    def _score(
        self, runs: Sequence[dict[str, Any]], models: Sequence[TaskModel | PackedTaskModel], feats: list[Features]
    ) -> list[dict[str, float]]:
        """Metrics of each of ``runs`` (``models``: each run's model) on featurised rows."""
        stop = self.should_stop
        if self.packed:  # every run in one PackedTaskModel: one pass
            which = [r["run"] for r in runs]
            return evaluate_runs(models[0], feats, self.pad_id, self.labels, which, should_stop=stop)
        return [evaluate(m, feats, self.pad_id, self.labels, should_stop=stop) for m in models]

    @torch.no_grad()
    def _average_restarts(self, scored: dict[str, list[Features]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Each learning rate's restarts averaged into its first restart's parameters (which they overwrite), the
        average scored on dev and on ``scored``'s sets: (one candidate run per learning rate, as ``results()``
        gives them plus ``"index"``, its first run's; what the report shows of each average)."""
        runs, models, restarts = self._runs, self._models, self.config.restarts
        assert restarts is not None, "the config is resolved"
        firsts = list(range(0, len(runs), restarts))  # runs are ordered learning rate first, then seed
        for first in firsts:
            group = runs[first : first + restarts]
            for kept, *others in zip(*(r["params"] for r in group), strict=True):
                kept.copy_(torch.stack([kept, *others]).mean(0))
        candidates = [runs[i] | {"index": i} for i in firsts]
        firsts_models = [models[i] for i in firsts]
        devs = self._score(candidates, firsts_models, self.dev_f)
        merged = []
        for c, dev_metrics in zip(candidates, devs, strict=True):
            c["best_dev"] = dev_metrics
            seeds = [r["seed"] for r in runs[c["index"] : c["index"] + restarts]]
            merged.append({"lr": c["lr"], "seeds": seeds, "dev": dev_metrics})
        for name, feats in scored.items():
            for shown, score in zip(merged, self._score(candidates, firsts_models, feats), strict=True):
                shown[name] = score
        return candidates, merged


class JointTrainer:
    """Trains several jobs (``PatchTraining``) together, one update of each per ``step()``.

    The packed groups over one ``training_bert`` (at one dropout) put their rows through one packed encode
    (``joint_forward``); the rest run their own forward. One backward then gives every run its own gradients: a
    row touches only its own run's biases and head. Each job keeps its own steps, optimizers, schedule, early
    stopping, progress and stop: a job that finishes, fails or is stopped leaves at the end of a step without
    disturbing the others, and a job added between steps joins at the next one."""

    def __init__(self, trainings: Sequence[PatchTraining] = ()) -> None:
        self.trainings: list[PatchTraining] = list(trainings)

    def add(self, training: PatchTraining) -> None:
        self.trainings.append(training)

    def __len__(self) -> int:
        return len(self.trainings)

    def step(self) -> list[tuple[PatchTraining, Exception | None]]:
        """One update of every job; returns the jobs that left, each with None (every run trained: call
        ``finish()``) or what ended it (TrainingStopped when its ``should_stop`` said so, or the error)."""
        ended: dict[int, tuple[PatchTraining, Exception | None]] = {}
        live: list[tuple[int, _RunGroup, _Update]] = []
        for i, t in enumerate(self.trainings):
            try:
                group = t.group()
                if group is None:
                    ended[i] = (t, None)
                    continue
                if t.should_stop():
                    raise TrainingStopped(group.step, group.total, group.stage)
                live.append((i, group, group.next_update()))
            except Exception as exc:
                ended[i] = (t, exc)
        together: dict[Any, list[tuple[int, _RunGroup, _Update]]] = {}
        for item in live:
            model = item[1].model
            key = model.joint_key() if isinstance(model, PackedTaskModel) else ("alone", item[0])
            together.setdefault(key, []).append(item)
        losses: dict[int, list[torch.Tensor]] = {}
        for items in together.values():
            try:
                if isinstance(items[0][1].model, PackedTaskModel):
                    outputs = joint_forward([group.part(u) for _, group, u in items])
                else:
                    outputs = [items[0][1].forward(items[0][2])]
            except Exception as exc:  # a shared forward: every job in it fails alike
                ended.update({i: (self.trainings[i], exc) for i, _, _ in items})
                continue
            for (i, group, u), logits in zip(items, outputs, strict=True):
                try:
                    losses[i] = group.losses(logits, u)
                except Exception as exc:
                    ended[i] = (self.trainings[i], exc)
        if losses:
            flat = [loss for job_losses in losses.values() for loss in job_losses]
            try:
                (flat[0] if len(flat) == 1 else torch.stack(flat).sum()).backward()  # each run's own gradient
            except Exception as exc:
                ended.update({i: (self.trainings[i], exc) for i in losses})
        for i, group, u in live:
            if i in ended:
                continue
            try:
                group.apply(u, losses[i])
            except Exception as exc:
                ended[i] = (self.trainings[i], exc)
        for t, error in ended.values():
            if error is not None:
                t.close()
        self.trainings = [t for i, t in enumerate(self.trainings) if i not in ended]
        return list(ended.values())


def train_patch(
    encoder: Encoder,
    train: Dataset,
    dev: Dataset,
    config: TrainConfig,
    *,
    test: Dataset | None = None,
    heldout: Dataset | None = None,
    on_progress: ProgressFn | None = None,
    progress_every_s: float = 2.0,
    should_stop: StopFn = _never,
    packed: bool | None = None,
) -> TrainResult:
    """Train a BitFit patch (or, with ``config.full``, fully fine-tune for comparison) on ``train``.

    The encoder passed in is never modified: the packed model only reads its weights, the padded one trains a
    copy. ``packed`` (default: whenever it can, i.e. BitFit on an encoder ``packed_unsupported`` accepts) trains
    every run together on the packed model; False trains padded, one run at a time. ``test`` is scored for every
    run and the kept one (never used to choose); ``heldout``, likewise, is another labelled split a benchmark may
    choose settings on (the set's own dev split where ``dev`` was carved from the training rows), reported as
    ``report["heldout"]``. ``on_progress`` is called at every dev evaluation and at least every
    ``progress_every_s`` seconds in between. ``should_stop`` is asked before every update and between evaluation
    batches; when it says so, TrainingStopped is raised (a cancelled job, a worker shutting down, a job over its
    time limit).
    """
    training = PatchTraining(
        encoder,
        train,
        dev,
        config,
        test=test,
        heldout=heldout,
        on_progress=on_progress,
        progress_every_s=progress_every_s,
        should_stop=should_stop,
        packed=packed,
    )
    trainer = JointTrainer([training])
    while len(trainer):
        for _, error in trainer.step():
            if error is not None:
                raise error
    return training.finish()
