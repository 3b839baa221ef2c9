"""How to train a patch: every training option, declared once.

Each field of :class:`TrainConfig` is one option: its name, type, bounds, default and help (``Field``'s
``description``). ``patchserve train`` and ``patchserve submit`` make their flags from it (``--lr-search`` for
``lr_search``: ``options()``), the job API reads the same fields as JSON (``from_dict``), and the docs' table of
training options is rendered from it, so the three cannot drift apart. The rules that fill in an unset option
(restarts on small data, the checkpoint on a tiny dev set, the head's start, the mode's defaults) live here too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

from pydantic import ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic.fields import FieldInfo

from patchserve.patches.errors import InvalidTaskNameError, JobError, describe_validation_errors
from patchserve.patches.validation import Label, shown, validate_task_name

# Defaults that differ between BitFit and full fine-tuning, filled in by ``TrainConfig.resolved()`` where a field
# is None. BitFit's few parameters need a larger rate and longer training and improve late in the linear decay:
# with 4 dev evaluations per epoch a patience of 40 lets its epochs run to the end (the best checkpoint is still
# restored). Where min_steps stretches a small data set's run, its epochs (and evaluations) stretch with it.
BITFIT_DEFAULTS: dict[str, Any] = {"lr": 3e-3, "epochs": 10.0, "patience": 40}
# A lora patch trains fewer epochs than BitFit at a lower rate: with every linear layer updated, 3e-3 diverged on
# Rotten Tomatoes' full set, and 1e-3 led on the dev splits. At the encoder's dropout its best checkpoints came before
# half of 10 epochs; at LORA_DROPOUT they came in the last tenth of 5, and 8 raised dev on Rotten Tomatoes and
# BANKING77 (docs/experiments.md).
LORA_DEFAULTS: dict[str, Any] = {"lr": 1e-3, "epochs": 8.0}
FULL_DEFAULTS: dict[str, Any] = {"lr": 5e-5, "epochs": 5.0, "patience": 6}

# Hard bounds on a training config, whoever sends it: each keeps a typo or a hostile job from holding a worker
# forever or failing late. What a deployment allows a job to cost in total is the operator's ``JobLimits``.
MAX_UPDATES_PER_RUN = 10_000_000
MAX_RUNS = 100  # restarts x learning rates
# Small data is where fine-tuning is unstable across seeds (Zhang et al., ICLR 2021): with fewer training rows than
# this and no ``restarts`` given, a config trains SMALL_DATA_RESTARTS seeds and averages them into one patch.
SMALL_DATA_ROWS = 1000
SMALL_DATA_RESTARTS = 3
# How many updates a run makes at least, unless ``min_steps`` says (``TrainConfig.min_steps_for``): small data sets
# train long enough (Zhang et al.). A lora patch under SMALL_DATA_ROWS rows trains LORA_SMALL_DATA_MIN_STEPS: at 256
# rows 900 raised the sets' own dev over 600 on Rotten Tomatoes and TREC alike (docs/experiments.md).
MIN_STEPS = 600
LORA_SMALL_DATA_MIN_STEPS = 900
# A lora patch trains at twice a BERT encoder's dropout from SMALL_DATA_ROWS rows on: on whole sets it raised dev on
# every seed of Rotten Tomatoes and TREC; on 256 rows it lowered both sets' dev (docs/experiments.md).
LORA_DROPOUT = 0.2
# A dev set this small scores in steps of several points, too coarse to rank the checkpoints of one run: with no
# ``checkpoint`` given, such a run keeps its last checkpoint, not its best.
SMALL_DEV_ROWS = 100
# Dev metrics that may choose the checkpoint (``metric``), per task kind; the first is the kind's default, except
# that tags in a BIO/IOB2/BIOES scheme default to entity_f1 (``TrainConfig.selection_metric``).
SELECTION_METRICS: dict[str, tuple[str, ...]] = {
    "classification": ("accuracy", "macro_f1"),
    "regression": ("spearman", "pearson"),
    "token-classification": ("token_accuracy", "entity_f1"),
}
Metric = Literal["accuracy", "macro_f1", "spearman", "pearson", "token_accuracy", "entity_f1"]
Kind = Literal["classification", "regression", "token-classification"]  # patches.format.KINDS
BiasSubset = Literal["all", "query-intermediate"]  # patches.bitfit.BIAS_SUBSETS
Pooling = Literal["mean", "cls", "pooler"]  # patches.format.POOLINGS
# the linear layers a lora patch may update, as PEFT names them (patches.lora.ROLE_TARGETS); all of them by default
# (chosen on dev over PEFT's default for BERT, query and value: docs/experiments.md)
LoraTarget = Literal["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"]
DEFAULT_TARGETS = get_args(LoraTarget)
ANY_VALUE = object()
# Options earlier releases took and this one does not (docs/experiments.md says why), each with its "off" value: a
# job an earlier release queued holds every option, so these are dropped at that value (ANY_VALUE: whatever it is,
# as distill_temperature did nothing without distill) and refused at any other.
RETIRED_OPTIONS: dict[str, Any] = {"contrastive": 0, "distill": 0.0, "distill_temperature": ANY_VALUE}
_STRICT = ConfigDict(strict=True, allow_inf_nan=False)  # a bool is not an int, "5" is not a number, NaN is refused
_Steps = Annotated[int, Field(ge=1, le=MAX_UPDATES_PER_RUN)]
_Rate = Annotated[float, Field(gt=0, le=1)]
_T = TypeVar("_T")


def _option(default: Any, help: str, **cli: Any) -> Any:
    """A field's declaration: its default and help, plus what only the command line needs (``metavar``)."""
    if callable(default):
        return Field(default_factory=default, description=help, json_schema_extra=cli or None)
    return Field(default, description=help, json_schema_extra=cli or None)


@pydantic_dataclass(config=_STRICT)
class TrainConfig:
    """How to train a patch; a None means "the automatic choice", which each field's help describes and the
    ``*_for`` methods and ``resolved()`` make. Types are checked strictly and every value is bounded; a job's total
    cost is capped by the deployment's ``JobLimits``."""

    task: str = Field(description="Task name: 1-64 letters, digits, '_', '.' or '-' (the patch's name).")
    kind: Kind | None = _option(None, "Task kind. Default: inferred from the data.")
    bias_subset: BiasSubset = _option(
        "all", "Which biases train: all (BitFit), or only the query and first feed-forward biases."
    )
    scales: Literal["none", "ia3"] = _option(
        "none",
        "What trains besides the biases: none (a bitfit patch), or ia3: (IA)^3 scales on every layer's keys, values "
        "and feed-forward intermediate (a bitfit-ia3 patch; BERT encoders), served in the same mixed batches.",
    )
    lora_rank: Annotated[int, Field(ge=1, le=256)] | None = _option(
        None,
        "Train LoRA of this rank too: low-rank updates of the --lora-targets layers besides every bias (a lora "
        "patch; BERT encoders), served in the same mixed batches. Default: none (a bitfit patch).",
        metavar="R",
    )
    lora_targets: Annotated[list[LoraTarget], Field(min_length=1, max_length=6)] = _option(
        lambda: list(DEFAULT_TARGETS),
        "With --lora-rank: the linear layers of every encoder layer that LoRA updates, as PEFT names them. "
        "Default: all of them (PEFT's default for BERT is query value).",
        metavar="MODULE",
    )
    lora_alpha: Annotated[float, Field(gt=0, le=4096)] = _option(
        8.0, "With --lora-rank: LoRA's alpha; the update is scaled by alpha / rank (as PEFT's default)."
    )
    pooling: Pooling | None = _option(
        None, "How a row becomes one vector for the head. Default: the encoder's (mean for sentence encoders)."
    )
    max_seq_length: Annotated[int, Field(ge=8, le=65536)] = _option(128, "Truncate inputs to this many tokens.")
    epochs: Annotated[float, Field(gt=0, le=10_000)] | None = _option(
        None, "Passes over the training data. Default: 10 for BitFit, 8 with --lora-rank, 5 with full."
    )
    min_steps: _Steps | None = _option(
        None,
        f"Train at least this many updates, so that small data sets train long enough. Default: {MIN_STEPS}; "
        f"{LORA_SMALL_DATA_MIN_STEPS} with --lora-rank under {SMALL_DATA_ROWS} training rows.",
        metavar="N",
    )
    max_steps: _Steps | None = _option(None, "Stop after this many updates.", metavar="N")
    batch_size: Annotated[int, Field(ge=1, le=4096)] = _option(16, "Training rows per update.")
    lr: _Rate | None = _option(None, "Learning rate. Default: 3e-3 for BitFit, 1e-3 with --lora-rank, 5e-5 with full.")
    head_lr: _Rate | None = _option(None, "The task head's learning rate. Default: the same as lr.")
    lr_search: Annotated[list[_Rate], Field(max_length=16)] = _option(
        list,
        "Train with each of these learning rates and keep the best dev score (the BitFit paper searched "
        "1e-4 4e-4 7e-4 1e-3).",
        metavar="LR",
    )
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = _option(
        0, "Random seed: training is deterministic per seed on one machine."
    )
    restarts: Annotated[int, Field(ge=1, le=MAX_RUNS)] | None = _option(
        None,
        f"Train with seeds seed .. seed+N-1. Default: {SMALL_DATA_RESTARTS} under {SMALL_DATA_ROWS} training rows, "
        "where runs vary most from seed to seed; else 1.",
        metavar="N",
    )
    restarts_merge: Literal["best", "average"] | None = _option(
        None,
        "What the restarts make: best keeps the run with the best dev score; average starts every restart's head "
        "alike and averages their biases and heads into one patch. Default: average where the restarts are "
        f"automatic (under {SMALL_DATA_ROWS} training rows), else best.",
    )
    warmup_ratio: Annotated[float, Field(ge=0, lt=1)] = _option(
        0.1, "Share of the updates over which the learning rate warms up linearly; it then decays linearly to 0."
    )
    weight_decay: Annotated[float, Field(ge=0, le=1)] = _option(0.0, "AdamW's weight decay.")
    max_grad_norm: Annotated[float, Field(gt=0, le=1e6)] = _option(1.0, "Clip each run's gradient to this norm.")
    dropout: Annotated[float, Field(ge=0, lt=1)] | None = _option(
        None,
        f"The encoder's dropout rate while training. Default: its own (0.1 in BERT encoders); {LORA_DROPOUT} with "
        f"--lora-rank on {SMALL_DATA_ROWS} training rows or more.",
    )
    eval_every: _Steps | None = _option(
        None,
        "Updates between dev evaluations. Default: 4 per epoch (where min_steps stretches a run, 4 per stretched "
        "epoch).",
        metavar="N",
    )
    patience: Annotated[int, Field(ge=1, le=1_000_000)] | None = _option(
        None,
        "Dev evaluations without a gain before a run stops early. Default: 40 for BitFit (its epochs run to the "
        "end), 6 with full.",
        metavar="N",
    )
    full: bool = _option(False, "Fine-tune every weight of the same encoder instead: a report to compare, no patch.")
    metric: Metric | None = _option(
        None,
        "The dev metric that picks checkpoints and restarts. Default: accuracy for classification, spearman for "
        "regression, entity_f1 for BIO/IOB2/BIOES tags, else token_accuracy.",
    )
    checkpoint: Literal["best", "last"] | None = _option(
        None,
        f"Which checkpoint of a run is kept: its best dev score, or its last. Default: last when the dev set has "
        f"fewer than {SMALL_DEV_ROWS} rows (too few to rank checkpoints), else best.",
    )
    head_init: Literal["random", "labels"] | None = _option(
        None,
        "Where each run's head starts: random, or labels (classification): each class's row is the frozen "
        "encoder's vector of its label's name, a zero-shot start. Default: labels for a classifier under "
        f"{SMALL_DATA_ROWS} training rows, else random.",
    )
    device: Annotated[str, Field(pattern=r"^(auto|cpu|mps|cuda(:[0-9]{1,2})?)$")] = _option(
        "auto", "Where it trains: auto (CUDA when present), cpu, cuda or cuda:N."
    )
    precision: Literal["auto", "float32"] = _option(
        "auto",
        "The packed model's arithmetic: auto trains in bfloat16 with flash attention on a CUDA GPU that has it "
        "(compute capability 8.0 on), with the frozen weights' products in bfloat16 on a CPU where they measure "
        "faster than float32 ones (AMX, or AMD's AVX512-BF16; a run takes about 0.75x the float32 one's time), and in "
        "float32 elsewhere; float32 trains in float32 everywhere.",
    )

    def __post_init__(self) -> None:
        try:
            validate_task_name(self.task)
        except InvalidTaskNameError as exc:
            raise JobError(f"training config: {exc}") from None
        checks = [
            (self.metric is None or self.kind is None or self.metric in SELECTION_METRICS[self.kind], _misfit(self)),
            (self.max_runs <= MAX_RUNS, f"restarts x learning rates is {self.max_runs}, over the limit of {MAX_RUNS}"),
            (not (self.full and self.scales != "none"), "full fine-tuning trains every weight; drop scales or full"),
            (not (self.full and self.lora_rank), "full fine-tuning trains every weight; drop lora_rank or full"),
            (not (self.lora_rank and self.scales != "none"), "a patch is lora or (IA)^3, not both: drop scales"),
        ]
        for ok, msg in checks:
            if not ok:
                raise JobError(f"training config: {msg}")
        if self.kind is not None:
            self.check_head_init(self.kind)

    # --- the automatic choices ---------------------------------------------------------------------------------
    def selection_metric(self, kind: str, labels: Sequence[Label]) -> str:
        """The dev metric that chooses checkpoints and restarts for a task of ``kind`` with these labels (tags):
        ``metric``, else accuracy, spearman, and for tags entity_f1 when BIO-style, else token_accuracy. A metric
        that cannot score the task is a JobError (checked before any training)."""
        if self.metric is None:
            return (
                "entity_f1" if kind == "token-classification" and is_bio_scheme(labels) else SELECTION_METRICS[kind][0]
            )
        if self.metric not in SELECTION_METRICS[kind]:
            raise JobError(f"training config: {_misfit(self, kind)}")
        if self.metric == "entity_f1" and not is_bio_scheme(labels):
            raise JobError(
                "metric 'entity_f1' needs tags in a BIO/IOB2/BIOES scheme (B-PER, I-PER, O...), got "
                f"{shown(list(labels)[:10])}; use token_accuracy"
            )
        return self.metric

    def checkpoint_for(self, dev_rows: int) -> Literal["best", "last"]:
        """Which checkpoint a run keeps with a dev set of ``dev_rows`` rows: ``checkpoint``, or when unset the last
        one on a dev set too small to rank checkpoints (SMALL_DEV_ROWS), else the best."""
        if self.checkpoint is not None:
            return self.checkpoint
        return "last" if dev_rows < SMALL_DEV_ROWS else "best"

    def restarts_for(self, train_rows: int) -> int:
        """Seeds to train on ``train_rows`` rows: ``restarts``, or when unset SMALL_DATA_RESTARTS on small data."""
        if self.restarts is not None:
            return self.restarts
        return SMALL_DATA_RESTARTS if train_rows < SMALL_DATA_ROWS else 1

    def restarts_merge_for(self, train_rows: int) -> Literal["best", "average"]:
        """What the restarts on ``train_rows`` rows make: ``restarts_merge``, or when unset their average where the
        restarts are automatic (small data: a dev set carved from so few rows cannot tell healthy seeds apart),
        else the best dev score."""
        if self.restarts_merge is not None:
            return self.restarts_merge
        return "average" if self.restarts is None and train_rows < SMALL_DATA_ROWS else "best"

    def dropout_for(self, train_rows: float) -> float | None:
        """The encoder's dropout while training on ``train_rows`` rows: ``dropout``, or when unset LORA_DROPOUT for
        a lora patch on at least SMALL_DATA_ROWS rows, else None (the encoder's own)."""
        if self.dropout is not None:
            return self.dropout
        return LORA_DROPOUT if self.lora_rank and train_rows >= SMALL_DATA_ROWS else None

    def min_steps_for(self, train_rows: float) -> int:
        """The fewest updates a run on ``train_rows`` rows makes: ``min_steps``, or when unset
        LORA_SMALL_DATA_MIN_STEPS for a lora patch under SMALL_DATA_ROWS rows, else MIN_STEPS."""
        if self.min_steps is not None:
            return self.min_steps
        return LORA_SMALL_DATA_MIN_STEPS if self.lora_rank and train_rows < SMALL_DATA_ROWS else MIN_STEPS

    def head_init_for(self, kind: str, train_rows: int) -> Literal["random", "labels"]:
        """Where the heads of a task of ``kind`` on ``train_rows`` rows start (``head_init_why``)."""
        return self.head_init_why(kind, train_rows)[0]

    def head_init_why(self, kind: str, train_rows: int) -> tuple[Literal["random", "labels"], str]:
        """Where the heads of a task of ``kind`` on ``train_rows`` rows start, and why: ``head_init``, or when unset
        the label names for a patch (not ``full``) of a classification task on small data (SMALL_DATA_ROWS), else a
        random head."""
        if self.head_init is not None:
            return self.head_init, f"set: head_init={self.head_init}"
        if self.full:
            return "random", "automatic: a random head for full fine-tuning"
        if kind != "classification":
            return "random", f"automatic: a random head: label names start classifiers, not a {kind} head"
        if train_rows >= SMALL_DATA_ROWS:
            return "random", f"automatic: a random head: {train_rows} training rows are not under {SMALL_DATA_ROWS}"
        return (
            "labels",
            f"automatic: a classifier on {train_rows} training rows (under {SMALL_DATA_ROWS}) starts from its names",
        )

    def resolved(self) -> TrainConfig:
        """This config with the mode's defaults (``BITFIT_DEFAULTS``, with ``LORA_DEFAULTS`` over them for a lora
        patch, or ``FULL_DEFAULTS``) in place of None."""
        defaults = FULL_DEFAULTS if self.full else BITFIT_DEFAULTS | (LORA_DEFAULTS if self.lora_rank else {})
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    # --- checks and costs --------------------------------------------------------------------------------------
    def check_task(self, kind: str, labels: Sequence[Label]) -> None:
        """A JobError where this config cannot train a task of ``kind`` with these labels (tags): a metric that
        cannot score it, or a label-name head without labels. The server, the CLI and the worker ask before any
        training."""
        self.selection_metric(kind, labels)
        self.check_head_init(kind)

    def check_head_init(self, kind: str) -> None:
        """A JobError where ``head_init`` asks for a start the task of ``kind`` cannot take: label-name heads score
        a pooled sentence vector, so classification only (checked before any training)."""
        if self.head_init == "labels" and kind != "classification":
            raise JobError(
                f"training config: head_init 'labels' starts a sentence classifier from its label names, not a "
                f"{kind} head; set head_init to 'random'"
            )

    def runs(self, train_rows: int) -> int:
        """Training runs this config makes on ``train_rows`` rows: one per restart and learning rate."""
        return self.restarts_for(train_rows) * max(1, len(self.lr_search))

    @property
    def max_runs(self) -> int:
        """The most runs this config can make, whatever the data."""
        return (self.restarts or SMALL_DATA_RESTARTS) * max(1, len(self.lr_search))

    def planned_steps(self, train_rows: int) -> int:
        """Updates one run makes on ``train_rows`` rows: the epochs, stretched to ``min_steps``, capped by
        ``max_steps`` (early stopping may end it sooner)."""
        epochs = self.resolved().epochs
        assert epochs is not None
        steps_per_epoch = math.ceil(train_rows / self.batch_size)
        total = max(self.min_steps_for(train_rows), math.ceil(epochs * steps_per_epoch))
        return min(total, self.max_steps) if self.max_steps else total

    def eval_every_for(self, train_rows: int) -> int:
        """Updates between dev evaluations on ``train_rows`` rows: ``eval_every``, or when unset 4 per epoch of the
        planned run. Where min_steps stretches a small data set's run, the epoch (and the evaluations) stretch with
        it, so patience always spans the same share of the run and cannot end it during the warm-up."""
        if self.eval_every:
            return self.eval_every
        epochs = self.resolved().epochs
        assert epochs is not None
        epoch_steps = max(math.ceil(train_rows / self.batch_size), int(self.planned_steps(train_rows) / epochs))
        return max(1, min(1000, epoch_steps // 4))

    @classmethod
    def from_dict(cls, raw: Any) -> TrainConfig:
        """A config from JSON (a job, the API); see ``from_json``. A retired option (``RETIRED_OPTIONS``) at its
        "off" value, as a job queued by an earlier release holds it, is dropped; any other value is refused."""
        if isinstance(raw, dict):
            raw = dict(raw)
            for name, off in RETIRED_OPTIONS.items():
                if name in raw and raw.pop(name) != off and off is not ANY_VALUE:
                    raise JobError(
                        f"training config: {name} was removed (it did not pay; docs/experiments.md); drop {name}"
                    )
            if raw.get("scales") == "layernorm":
                raise JobError(
                    "training config: scales 'layernorm' (the bitfit-ln kind) was removed (it did not pay; "
                    "docs/experiments.md); use 'none' or 'ia3'"
                )
        return from_json(cls, raw, "training config")


@dataclass(frozen=True)
class Option:
    """One training option as the command line and the docs show it (``options()``)."""

    name: str
    flag: str  # --lr-search for lr_search
    help: str
    default: Any  # None: automatic (the help says what it is); a list default is []
    required: bool
    kind: type  # int, float, str or bool; a list option's items' type
    choices: tuple[str, ...] | None
    many: bool  # a list: several values after one flag
    metavar: str | None
    schema: dict[str, Any]  # the field's JSON schema (type, bounds): what the docs' table shows


def options() -> list[Option]:
    """Every field of TrainConfig as an option, in declaration order."""
    from pydantic import TypeAdapter

    schema = TypeAdapter(TrainConfig).json_schema()["properties"]
    out = []
    declared: dict[str, FieldInfo] = TrainConfig.__pydantic_fields__  # type: ignore[attr-defined]
    for name, info in declared.items():
        base, many = _base_type(info)
        choices = get_args(base) if get_origin(base) is Literal else None
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        default = [] if info.default_factory is not None else info.default
        out.append(
            Option(
                name=name,
                flag="--" + name.replace("_", "-"),
                help=info.description or "",
                default=None if info.is_required() else default,
                required=info.is_required(),
                kind=str if choices else base,
                choices=tuple(str(c) for c in choices) if choices else None,
                many=many,
                metavar=str(extra["metavar"]) if "metavar" in extra else None,
                schema=schema[name],
            )
        )
    return out


def _base_type(info: FieldInfo) -> tuple[Any, bool]:
    """A field's type without None and Annotated wrappers, and whether it is a list (then its items' type)."""
    annotation: Any = info.annotation
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is not Literal and args and type(None) in get_args(annotation):
        annotation = args[0]  # X | None
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) is list:
        item = get_args(annotation)[0]
        return (get_args(item)[0] if get_origin(item) is Annotated else item), True
    return annotation, False


_SCHEME_TAG = re.compile(r"(?:[BIES]-.+|O)")  # IOB2, IOB1 and BIOES tags all look like this


def is_bio_scheme(tags: Sequence[Label]) -> bool:
    """Whether a tag set reads as entity spans (BIO / IOB2 / BIOES): every tag is O or B-/I-/E-/S-TYPE."""
    return (
        bool(tags)
        and all(isinstance(t, str) and _SCHEME_TAG.fullmatch(t) for t in tags)
        and any(t != "O" for t in tags)
    )


def _misfit(config: TrainConfig, kind: str | None = None) -> str:
    """The message for a ``metric`` that does not score a task of ``kind`` (default: the config's own kind)."""
    kind = kind or config.kind or ""
    return f"metric {config.metric!r} does not score a {kind} task; use one of {list(SELECTION_METRICS.get(kind, ()))}"


def from_json(cls: type[_T], raw: Any, what: str) -> _T:
    """``cls(**raw)`` for JSON a client sent: anything but an object, unknown fields, wrong types and out-of-range
    values are a :class:`JobError` naming each field (``what``: "training config", "gate")."""
    if not isinstance(raw, dict):
        raise JobError(f"{what} must be a JSON object")
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in set(raw) - known)
    if unknown:
        raise JobError(f"{what} has unknown fields {shown(unknown)}; known fields: {sorted(known)}")
    try:
        return cls(**raw)
    except ValidationError as exc:
        raise JobError(f"{what}: {describe_validation_errors(exc.errors())}") from None
