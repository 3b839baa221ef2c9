"""``train_patch(encoder, train, dev, config) -> TrainResult``: a BitFit patch trained, pure (no Redis, no HTTP).

A job's training runs in this order: its data is featurised and its plan made (``selection.plan``: restarts,
checkpoint rule and head start, decided by the data where the config leaves them open); its runs -- one per
restart and learning rate -- train in run groups (``runs.RunGroup``), an update at a time, several jobs together
where ``joint.JointTrainer`` drives them; then every run is scored, the kept one chosen on dev (or the restarts
averaged into one), the report built and the patch extracted (``report``).

BitFit on a BERT encoder trains on the serving engine's packed model (``models.PackedRuns``): no padding reaches a
matrix product, and a job's runs train together in one batch, each row carrying its run's biases. The gradients
are the padded model's, so results equal training the runs one by one. Full fine-tuning and encoders the packed
model does not cover train padded (``models.PaddedRun``), one run at a time.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from patchserve.patches.bitfit import trained_names
from patchserve.patches.data import Dataset
from patchserve.patches.encoder import Encoder, resolve_device
from patchserve.patches.errors import EncoderError
from patchserve.patches.format import Patch
from patchserve.patches.lora import init_factors
from patchserve.patches.model import TaskModel
from patchserve.patches.packed import PackedBert, packed_unsupported
from patchserve.patches.packed_model import training_dtype
from patchserve.patches.train_config import TrainConfig
from patchserve.trainer import report, selection
from patchserve.trainer.evaluation import evaluate_runs, label_vectors
from patchserve.trainer.features import Features, featurize
from patchserve.trainer.joint import JointTrainer
from patchserve.trainer.models import PackedRuns, PaddedRun, RunModel, lora_spec
from patchserve.trainer.progress import ProgressFn, StopFn, TrainingStopped, never
from patchserve.trainer.runs import RunGroup, TrainingContext

Result = tuple[RunModel, dict[str, Any]]  # a trained run: its model and its RunGroup.results() entry


def check_trainable(encoder: Encoder, config: TrainConfig, *, packed: bool | None = None) -> str | None:
    """Refuse, before any data is read or any step taken, a run this encoder's family cannot train: (IA)^3 scales
    and LoRA off the packed model, a patch with nothing to train (an encoder without biases, such as ModernBERT),
    pooling on a pooler the encoder lacks. Returns why the packed model is off (None: it is on)."""
    model = encoder.model
    pooling = config.pooling or encoder.default_pooling
    if pooling == "pooler" and getattr(model, "pooler", None) is None:
        raise EncoderError("pooling 'pooler' needs an encoder with a pooler layer; use 'cls' or 'mean'")
    unsupported = "full fine-tuning trains every weight" if config.full else packed_unsupported(model)
    if packed and unsupported:
        raise EncoderError(f"packed training is not possible: {unsupported}")
    if (config.scales == "ia3" or config.lora_rank) and (packed is False or unsupported):
        what = "LoRA trains" if config.lora_rank else "(IA)^3 scales train"
        raise EncoderError(
            f"{what} on the packed model, which is off here ({unsupported or 'packed=False'}); train a bitfit "
            "patch (the default) on this encoder, or this kind on a BERT encoder (docs/encoders.md lists what each "
            "family trains)"
        )
    if not config.full and not trained_names(model, config.bias_subset, config.scales) and not config.lora_rank:
        raise EncoderError(
            f"this encoder ({type(model).__name__}) has no bias parameters, so a BitFit patch has nothing to train "
            "(bias patches for encoders without biases are not served yet); use an encoder with biases "
            "(docs/encoders.md lists the families)"
        )
    return unsupported


@dataclass
class TrainResult:
    patch: Patch | None  # None for --full
    report: dict[str, Any]
    model: TaskModel  # the kept run (for evaluation and tests)


class PatchTraining:
    """One job's training, a run group at a time: what ``train_patch`` does, in pieces, so that several jobs can train
    in one batch (``JointTrainer``). ``finish()`` builds the result once every run has trained.

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
        should_stop: StopFn = never,
        packed: bool | None = None,
        packed_bert: PackedBert | None = None,
    ) -> None:
        self.t0 = time.perf_counter()
        kind, labels = train.kind, train.labels
        if any(ds is not None and ds.kind != kind for ds in (dev, test, heldout)):
            kinds = "/".join(ds.kind if ds else "-" for ds in (dev, test, heldout))
            raise ValueError(f"train is {kind} but dev/test/heldout are {kinds}; use one kind")
        pooling = config.pooling or encoder.default_pooling
        metric = config.selection_metric(kind, labels)
        config.check_head_init(kind)
        unsupported = check_trainable(encoder, config, packed=packed)
        self.packed = unsupported is None if packed is None else packed
        self.plan = selection.plan(config, kind, len(train), len(dev))
        self.config = self.plan.config
        self.encoder, self.pooling = encoder, pooling
        self.test, self.heldout = test, heldout
        self.should_stop = should_stop
        max_len = min(config.max_seq_length, encoder.max_positions)
        tok = encoder.tokenizer
        self.ctx = TrainingContext(
            task=config.task,
            kind=kind,
            labels=labels,
            metric=metric,
            train=featurize(tok, train, labels, max_len),
            dev=featurize(tok, dev, labels, max_len),
            pad_id=int(tok.pad_token_id or 0),
            checkpoint=str(self.config.checkpoint),
            on_progress=on_progress,
            progress_every_s=progress_every_s,
            should_stop=should_stop,
        )
        forward = "packed" if self.packed else "padded"
        half = self.packed and training_dtype(resolve_device(config.device), config.precision) is not None
        self.job = report.Job(
            encoder,
            kind,
            labels,
            pooling,
            metric,
            max_len,
            train,
            dev,
            test,
            self.plan,
            forward,
            0,
            precision="bfloat16" if half else "float32",
        )
        self.packed_bert = packed_bert if self.packed else None
        specs = self.plan.specs
        self._queued = [specs] if self.packed else [[spec] for spec in specs]  # run groups still to train
        self._group: RunGroup | None = None
        self._moved: nn.Module | None = None  # the encoder copied to the training device (packed_base)
        self._label_vectors: torch.Tensor | None = None
        self._trained: list[Result] = []

    # --- the run groups ------------------------------------------------------------------------------------------
    def run_group(self) -> RunGroup | None:
        """The run group that trains now (None: every run has trained). Packed, a job's runs are one group; padded,
        each run is its own, one after another."""
        while self._group is None or self._group.done:
            if self._group is not None:
                self._trained += [(self._group.model, r) for r in self._group.results()]
                self._group = None
            if not self._queued:
                return None
            specs = self._queued.pop(0)
            self._group = RunGroup(self.ctx, self.config, specs, self._model(specs))
        return self._group

    def _model(self, specs: list[tuple[float, int]]) -> RunModel:
        """The model of a run group: run ``i`` starts from head ``i``."""
        config, kind = self.config, self.ctx.kind
        device = resolve_device(config.device)
        n_out = 1 if kind == "regression" else len(self.ctx.labels)
        heads, lora_start = [], []
        lora = lora_spec(self.encoder.model, config)
        for _, seed in specs:  # each run's head (and LoRA) starts where a run of its own would start it; restarts
            torch.manual_seed(config.seed if config.restarts_merge == "average" else seed)  # averaged start alike
            head = nn.Linear(self.encoder.hidden_size, n_out)
            if config.head_init == "labels":  # every run alike: the label names' vectors, no bias
                with torch.no_grad():
                    head.weight.copy_(self.label_vectors())
                    head.bias.zero_()
            heads.append(head)
            if lora is not None:
                lora_start.append(init_factors(self.encoder.model, lora))
        if self.packed:
            base, shared = self.packed_base(device)
            return PackedRuns(base, heads, kind, self.pooling, config, shared, lora_start)
        return PaddedRun(self.encoder.model, heads[0], kind, self.pooling, config, device)

    def packed_base(self, device: torch.device) -> tuple[nn.Module, PackedBert | None]:
        """The encoder the job's packed models read on ``device``, and the ``training_bert`` they share with other
        jobs: the job's own encoder, or one copy of it moved to ``device`` (the copy shares no training_bert)."""
        base = self.encoder.model
        if next(base.parameters()).device == device:
            return base, self.packed_bert
        if self._moved is None:  # (a job trains on one device)
            self._moved = copy.deepcopy(base).to(device)
        return self._moved, None

    def label_vectors(self) -> torch.Tensor:
        """The rows of a label-name head: the frozen encoder's vectors of the label names, computed once a job."""
        if self._label_vectors is None:
            self._label_vectors = label_vectors(self.encoder, self.ctx.labels, self.pooling, self.job.max_len)
        return self._label_vectors

    def close(self) -> None:
        """Release the progress bar of a training that ends without finishing."""
        if self._group is not None:
            self._group.close()

    # --- the result ----------------------------------------------------------------------------------------------
    def finish(self) -> TrainResult:
        """The result, once ``run_group()`` is None: every run scored on the test (and held-out) set, the kept one
        chosen on dev -- or with ``restarts_merge="average"`` each learning rate's restarts averaged into one -- the
        report built and the patch extracted. A stop asked while a set is scored raises TrainingStopped."""
        assert self.run_group() is None, "finish() before every run has trained"
        config, trained = self.config, self._trained
        tok, max_len = self.encoder.tokenizer, self.job.max_len
        scored = {
            name: featurize(tok, ds, self.ctx.labels, max_len)
            for name, ds in (("test", self.test), ("heldout", self.heldout))
            if ds is not None
        }
        shown_runs = [{k: r[k] for k in report.SHOWN_RUN} for _, r in trained]
        try:  # every run is scored, so the report shows what the restarts bought; the kept one is chosen on dev
            for name, feats in scored.items():  # alone all the same
                for shown, score in zip(shown_runs, self._score(trained, feats), strict=True):
                    shown[name] = score
            candidates = [(m, r | {k: s[k] for k in scored}) for (m, r), s in zip(trained, shown_runs, strict=True)]
            merged = None
            if config.restarts_merge == "average" and (config.restarts or 1) > 1:
                candidates, merged = self._average_restarts(scored)
        except TrainingStopped:
            last = trained[-1][1]
            raise TrainingStopped(last["steps"], last["planned_steps"]) from None
        run_model, kept = candidates[selection.best([r for _, r in candidates], self.ctx.metric)]
        model = run_model.task_model(kept["run"])
        job = replace(self.job, seconds=time.perf_counter() - self.t0)
        result = report.build(job, kept, model, shown_runs)
        if merged is not None:
            result["merged"] = merged
        self._trained, self._moved = [], None  # the other runs' models
        if config.full:
            return TrainResult(None, result, model)
        return TrainResult(report.patch_of(job, result, model, averaged=merged is not None), result, model)

    def _score(self, trained: list[Result], feats: list[Features]) -> list[dict[str, float]]:
        """Metrics of each trained run on featurised rows: the runs of one model in one pass."""
        out: list[dict[str, float]] = [{} for _ in trained]
        by_model: dict[int, list[int]] = {}
        for k, (model, _) in enumerate(trained):
            by_model.setdefault(id(model), []).append(k)
        ctx = self.ctx
        for ks in by_model.values():
            runs = [trained[k][1]["run"] for k in ks]
            scores = evaluate_runs(trained[ks[0]][0], feats, ctx.pad_id, ctx.labels, runs, should_stop=ctx.should_stop)
            for k, score in zip(ks, scores, strict=True):
                out[k] = score
        return out

    def _average_restarts(self, scored: dict[str, list[Features]]) -> tuple[list[Result], list[dict[str, Any]]]:
        """Each learning rate's restarts averaged into its first restart's parameters, the average scored on dev and
        on ``scored``'s sets: (one candidate per learning rate, with those scores; what the report shows of each)."""
        restarts = self.config.restarts
        assert restarts is not None, "the config is resolved"
        firsts = selection.average_restarts([r for _, r in self._trained], restarts)
        candidates = [self._trained[i] for i in firsts]
        devs = self._score(candidates, self.ctx.dev)
        sets = {name: self._score(candidates, feats) for name, feats in scored.items()}
        merged, kept = [], []
        for j, ((model, r), first) in enumerate(zip(candidates, firsts, strict=True)):
            seeds = [t[1]["seed"] for t in self._trained[first : first + restarts]]
            shown = {"lr": r["lr"], "seeds": seeds, "dev": devs[j]} | {name: s[j] for name, s in sets.items()}
            merged.append(shown)
            kept.append((model, r | {"best_dev": devs[j]} | {name: s[j] for name, s in sets.items()}))
        return kept, merged


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
    should_stop: StopFn = never,
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
