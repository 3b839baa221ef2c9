"""Hugging Face PEFT adapters in and out: a PEFT LoRA or (IA)^3 adapter folder <-> a ``lora`` / ``bitfit-ia3`` patch.

A PEFT adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (pickled ``.bin`` files are
never loaded). Its keys are the wrapped model's (``base_model.model.bert.encoder.layer.0.attention.self.query.
lora_A.weight``); its task head is the classifier in ``modules_to_save`` (``base_model.model.classifier.weight``).

Importing maps, exactly:

* LoRA factors with their scaling folded into B: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), each module's alpha
  from ``alpha_pattern`` where one matches (PEFT's own matching), its rank from the factor's shape;
* every bias the adapter holds (``bias="all"``; ``lora_only`` and ``none`` leave the others at the base values);
* (IA)^3 vectors: key and value outputs as patch scales; the feed-forward output's input vector as the intermediate's
  scale; the attention output's input vector folded into the value scale (it scales the attention context, which is
  the values' weighted sum, feature by feature); a query vector folded into the key scale (q . (s * k));
* the classifier: ``SEQ_CLS`` adapters (``BertForSequenceClassification``) pool with the encoder's pooler (one output:
  regression), ``TOKEN_CLS`` adapters tag tokens.

What cannot be served exactly is refused with the reason: DoRA, LoRA biases, layer replication, target parameters,
trainable tokens, modules outside the encoder's LoRA sites, weights of modules beyond the one-layer task head, (IA)^3
vectors that do not fold, another base model, no classifier. Exporting writes the reverse: a folder
``PeftModel.from_pretrained`` loads onto the base model.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from patchserve.patches.arch import HEAD_MODULES, arch_of_sites
from patchserve.patches.bitfit import ia3_roles
from patchserve.patches.encoder import Encoder
from patchserve.patches.errors import PatchError
from patchserve.patches.format import (
    IA3_PATCH_TYPE,
    LORA_A,
    LORA_B,
    LORA_PATCH_TYPE,
    BaseRef,
    BaseSpec,
    Patch,
    PatchMeta,
)
from patchserve.patches.lora import factor_pairs
from patchserve.patches.validation import Label, strict_json

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
HEAD_FILE = "patchserve_head.safetensors"  # the head of an exported mean/cls-pooled patch (no PEFT classifier)
MAX_ADAPTER_BYTES = 256 * 1024 * 1024
_WRAPPED = "base_model.model."
_HEADS = ("classifier", "score")  # the one-layer task head of a *ForSequenceClassification / *ForTokenClassification
# the top modules of every described family's head (DistilBERT's pre_classifier; RoBERTa's and ELECTRA's
# classifier.dense + classifier.out_proj): weights there beyond the one layer are a head of more than one layer
_HEAD_PARTS = frozenset(_HEADS) | {m.split(".")[0] for m in HEAD_MODULES}
_WRAPPER_COPIES = ("original_module", "modules_to_save")
_KINDS = {"SEQ_CLS": "classification", "TOKEN_CLS": "token-classification"}


_TOP = ("embeddings", "encoder", "pooler")  # the bare encoder's own attributes (anything else is a task model's)


class PeftImportError(PatchError):
    """A PEFT adapter that cannot be turned into a patch (the message says why and what to do)."""


class Base(Protocol):
    """What an import needs of the base encoder (an ``Encoder``, or a server front end's ``EncoderInfo``)."""

    @property
    def name(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def default_pooling(self) -> str: ...
    @property
    def spec(self) -> BaseSpec: ...


def _read(folder: Path) -> tuple[bytes, bytes]:
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file():
        raise PeftImportError(
            f"{folder} has no {CONFIG_FILE}: not a PEFT adapter folder (save it with save_pretrained)"
        )
    if not weights_path.is_file():
        pickled = (folder / "adapter_model.bin").is_file()
        raise PeftImportError(
            f"{folder} has no {WEIGHTS_FILE}"
            + (
                "; its adapter_model.bin is a pickle, which is never loaded: save with safe_serialization=True"
                if pickled
                else ""
            )
        )
    for path in (config_path, weights_path):
        if path.stat().st_size > MAX_ADAPTER_BYTES:
            raise PeftImportError(f"{path.name} is over {MAX_ADAPTER_BYTES} bytes: not an adapter of this encoder")
    return config_path.read_bytes(), weights_path.read_bytes()


def _parse(config_bytes: bytes, weights: bytes) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config = strict_json(config_bytes, CONFIG_FILE, PeftImportError)
    if not isinstance(config, dict):
        raise PeftImportError(f"{CONFIG_FILE} must hold a JSON object")
    try:
        tensors = st_load(weights)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise PeftImportError(f"{WEIGHTS_FILE} cannot be read ({exc}); copy the adapter again") from exc
    return config, {k: v.float() for k, v in tensors.items()}


def _refuse_unservable(config: dict[str, Any]) -> str:
    """The adapter's PEFT type (LORA or IA3), or a refusal of what this build cannot serve exactly."""
    peft_type = config.get("peft_type")
    if peft_type not in ("LORA", "IA3"):
        raise PeftImportError(f"PEFT type {peft_type!r} is not served; patchserve imports LORA and IA3 adapters")
    unsupported = {
        "use_dora": "DoRA (weight-decomposed LoRA) is not served; train a plain LoRA adapter (use_dora=False)",
        "lora_bias": "LoRA biases (lora_bias=True) are not served; train with lora_bias=False",
        "fan_in_fan_out": "fan_in_fan_out (GPT-2 Conv1D layers) does not apply to BERT encoders",
        "layer_replication": "layer replication changes the encoder's depth, which a patch cannot",
        "target_parameters": "target_parameters (LoRA on raw parameters) is not served; target modules",
        "trainable_token_indices": "trainable token embeddings are not served",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not served",
    }
    for key, why in unsupported.items():
        if config.get(key):
            raise PeftImportError(why)
    return str(peft_type)


def _check_base(config: dict[str, Any], encoder: Base, local: bool) -> None:
    """Refuse an adapter trained on another base: by fingerprint where its base is a local folder here (``local``:
    never for an upload, whose paths are not to be opened), by name where it is a hub id."""
    base = config.get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        return  # not recorded: the shapes are still checked
    folder = Path(base)
    if base.startswith(("/", ".", "~")) or "\\" in base:  # a path on the machine that trained it
        if not (local and folder.is_dir()):
            return  # cannot be checked here: the shapes are
        from patchserve.patches.encoder import load_encoder

        other = load_encoder(str(folder))
        if other.fingerprint != encoder.fingerprint:
            raise PeftImportError(
                f"the adapter was trained on {base} ({other.fingerprint}), not on {encoder.name} "
                f"({encoder.fingerprint}); import it with --model {base}"
            )
        return
    if base.rstrip("/").split("/")[-1].lower() != encoder.name.rstrip("/").split("/")[-1].lower():
        raise PeftImportError(
            f"the adapter was trained on {base!r}, this encoder is {encoder.name!r}; import it with --model "
            "pointing at that base model (and serve it with that model)"
        )


def _encoder_key(key: str) -> str:
    """A state-dict key without PEFT's wrapper prefix and the task model's encoder attribute (``bert.``)."""
    key = key.removeprefix(_WRAPPED)
    first, _, rest = key.partition(".")
    return rest if first not in _TOP and rest.split(".")[0] in _TOP else key


def _roles(names: set[str], rules: dict[str, str]) -> dict[str, tuple[str, int]]:
    """(role, layer) of each of ``names`` that one of ``rules`` (role -> regex, group 1 the layer) matches."""
    out: dict[str, tuple[str, int]] = {}
    for name in names:
        for role, rx in rules.items():
            m = re.fullmatch(rx, name)
            if m:
                out[name] = (role, int(m.group(1)))
    return out


def _alpha(config: dict[str, Any], module: str) -> float:
    pattern = config.get("alpha_pattern") or {}
    for key in pattern:  # PEFT's get_pattern_key
        if re.match(rf"(.*\.)?({key})$", module):
            return float(pattern[key])
    return float(config.get("lora_alpha", 8))


_LORA_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight")
_IA3_KEY = re.compile(r"(?P<module>.+)\.ia3_l(?:\.[^.]+)?")


def _split(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(head tensors by ``weight``/``bias``, encoder tensors by their name in the bare encoder), refusing the weights
    of any other module the adapter holds.

    An adapter is judged by the tensors it holds, not by the names its config lists: PEFT writes ``classifier``,
    ``score`` and ``pre_classifier`` into ``modules_to_save`` of every ``SEQ_CLS`` and ``TOKEN_CLS`` adapter (0.22 and
    later), whatever the model has, and saves only the modules the model really has. A listed module without
    weights changes nothing and is ignored."""
    head: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    replaced: set[str] = set()  # modules whose weights the adapter would replace (modules_to_save)
    for key, t in tensors.items():
        bare = key.removeprefix(_WRAPPED)
        owner, _, leaf = bare.partition(".")
        if owner in _HEADS and leaf in ("weight", "bias"):
            head[leaf] = t
            continue
        if any(f".{copy}." in f".{bare}." for copy in _WRAPPER_COPIES):
            continue  # a wrapper's own copy (the frozen original beside a trained module): not the adapter's value
        name = _encoder_key(key).replace(".base_layer.", ".")
        if not (name.endswith(".bias") or _LORA_KEY.fullmatch(name) or _IA3_KEY.fullmatch(name)):
            replaced.add(name.rsplit(".", 1)[0])
        rest[name] = t
    if replaced:
        heads = sorted(m for m in replaced if m.split(".")[0] in _HEAD_PARTS)
        if heads:
            raise PeftImportError(
                f"the adapter's task head has more than one layer ({', '.join(heads)}, as DistilBERT's, RoBERTa's "
                "and ELECTRA's classification heads do); patchserve serves a one-layer classifier on the pooler or "
                "on the tokens (BertForSequenceClassification, BertForTokenClassification)"
            )
        raise PeftImportError(
            f"the adapter holds weights of {', '.join(sorted(replaced))}, which would replace encoder weights "
            "(modules_to_save, or an adapter on a layer that is not served); a patch serves biases, adapters on the "
            "encoder's linear layers and the task head (the classifier): train with modules_to_save limited to the "
            "classifier"
        )
    return head, rest


def _lora_factors(config: dict[str, Any], tensors: dict[str, torch.Tensor], sites: set[str]) -> dict[str, torch.Tensor]:
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _LORA_KEY.fullmatch(name)
        if m:
            parts.setdefault(m["module"], {})[m["which"]] = t
    out: dict[str, torch.Tensor] = {}
    for module, ab in parts.items():
        if module not in sites:
            raise PeftImportError(
                f"the adapter has LoRA on {module!r}, which is not a linear layer this encoder serves LoRA on "
                "(query, key, value, attention.output.dense, intermediate.dense, output.dense of each layer)"
            )
        if set(ab) != {"A", "B"}:
            raise PeftImportError(f"the adapter's LoRA on {module!r} lacks its lora_A or lora_B weight")
        rank = int(ab["A"].shape[0])
        alpha = _alpha(config, module)
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        out[module + LORA_A], out[module + LORA_B] = ab["A"], ab["B"] * scaling
    return out


def _ia3_scales(tensors: dict[str, torch.Tensor], spec: BaseSpec) -> dict[str, torch.Tensor]:
    """PEFT's (IA)^3 vectors as this encoder's (IA)^3 scales (key, value, intermediate), folded where they fold."""
    arch = arch_of_sites(set(spec.lora_shapes))
    if arch is None:
        raise PeftImportError(
            "this encoder's family has no (IA)^3 sites described, so no (IA)^3 adapter imports onto it"
        )
    roles = _roles(set(spec.lora_shapes), arch.lora_rules)  # linear module -> (role, layer)
    site = {r: n for n, r in _roles(set(spec.scale_shapes), arch.ia3_rules).items()}  # ("k"|"v"|"ff", layer) -> site
    into = {("q", False): "k", ("k", False): "k", ("v", False): "v", ("o", True): "v", ("f", True): "ff"}
    scales: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _IA3_KEY.fullmatch(name)
        if m is None:
            continue
        role, layer = roles.get(m["module"], ("?", -1))
        target = into.get((role, t.dim() == 2 and t.shape[0] == 1))  # a [1, in] vector scales the module's input
        if target is None or (target, layer) not in site:
            raise PeftImportError(
                f"the adapter's (IA)^3 vector on {m['module']!r} cannot be served exactly: patchserve serves (IA)^3 "
                "on the query, key and value outputs and on the inputs of the attention and feed-forward outputs"
            )
        key = site[(target, layer)]
        scales[key] = scales.get(key, torch.ones(t.numel())) * t.flatten()
    return scales


def import_peft(
    folder: str | Path,
    encoder: Base,
    task: str,
    *,
    labels: Sequence[Label] | None = None,
    max_seq_length: int = 128,
) -> Patch:
    """The patch of a PEFT LoRA or (IA)^3 adapter folder trained on ``encoder`` (see the module's docstring)."""
    config_bytes, weights = _read(Path(folder))
    return import_peft_bytes(config_bytes, weights, encoder, task, labels=labels, max_seq_length=max_seq_length)


def import_peft_bytes(
    config_bytes: bytes,
    weights: bytes,
    encoder: Base,
    task: str,
    *,
    labels: Sequence[Label] | None = None,
    max_seq_length: int = 128,
    local: bool = True,
) -> Patch:
    """``import_peft`` of an adapter's two files' bytes; ``local``: its base may be a folder on this machine (not for
    uploads)."""
    config, tensors = _parse(config_bytes, weights)
    peft_type = _refuse_unservable(config)
    _check_base(config, encoder, local)
    kind = _KINDS.get(str(config.get("task_type")))
    if kind is None:
        raise PeftImportError(
            f"task_type {config.get('task_type')!r} has no task head; a patch needs one: train the adapter with "
            "task_type SEQ_CLS (BertForSequenceClassification) or TOKEN_CLS"
        )
    spec = encoder.spec
    head, rest = _split(tensors)
    if set(head) != {"weight", "bias"}:
        raise PeftImportError("the adapter has no classifier weights: keep the classifier in modules_to_save")
    n_out = int(head["weight"].shape[0])
    if kind == "classification" and n_out == 1:
        kind = "regression"
    names: list[Label] = (
        list(labels) if labels else ([] if kind == "regression" else [f"LABEL_{i}" for i in range(n_out)])
    )
    if kind != "regression" and len(names) != n_out:
        raise PeftImportError(f"the classifier has {n_out} outputs but {len(names)} labels were given")
    biases = {n: t for n, t in rest.items() if n.endswith(".bias")}  # the others keep the base's values
    unknown = sorted(set(biases) - set(spec.bias_shapes))
    if unknown:
        raise PeftImportError(f"the adapter sets biases this encoder does not have: {unknown[:3]}")
    if kind != "token-classification" and "pooler.dense.bias" not in spec.bias_shapes:
        raise PeftImportError("a SEQ_CLS adapter pools with the encoder's pooler, which this encoder does not have")
    lora = _lora_factors(config, rest, set(spec.lora_shapes)) if peft_type == "LORA" else {}
    scales = _ia3_scales(rest, spec) if peft_type == "IA3" else {}
    recorded = ("r", "lora_alpha", "use_rslora", "target_modules", "bias", "peft_version", "base_model_name_or_path")
    meta = PatchMeta(
        task=task,
        kind=kind,
        labels=names,
        base=BaseRef(encoder.name, encoder.fingerprint),
        bias_subset="all",
        pooling="pooler" if kind != "token-classification" else encoder.default_pooling,
        max_seq_length=max_seq_length,
        training={"source": "peft", "peft_type": peft_type, **{k: config[k] for k in recorded if k in config}},
        patch_type=LORA_PATCH_TYPE if peft_type == "LORA" else IA3_PATCH_TYPE,
    )
    patch = Patch(meta, biases, head["weight"], head["bias"], scales=scales, lora=lora)
    patch.check_compatible(spec)
    return patch


def _export_config(patch: Patch, task_type: str, modules: list[str], ranks: dict[str, int]) -> dict[str, Any]:
    common = {
        "base_model_name_or_path": patch.meta.base.name,
        "task_type": task_type,
        "inference_mode": True,
        "modules_to_save": ["classifier"] if task_type != "FEATURE_EXTRACTION" else None,
        "revision": None,
    }
    if patch.meta.patch_type == IA3_PATCH_TYPE:
        feedforward = [m for m in modules if m.endswith(".output.dense")]
        return {**common, "peft_type": "IA3", "target_modules": modules, "feedforward_modules": feedforward}
    rank = max(ranks.values())
    others = {m: r for m, r in ranks.items() if r != rank}  # alpha = rank everywhere: a scaling of 1 (B holds it)
    return {
        **common,
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "rank_pattern": others,
        "alpha_pattern": others,
        "target_modules": modules,
        "bias": "all",
        "lora_dropout": 0.0,
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
    }


def export_peft(patch: Patch, folder: str | Path, encoder: Encoder) -> Path:
    """Write ``patch`` (``lora`` or ``bitfit-ia3``, trained on ``encoder``) as a PEFT adapter folder. A pooler-pooled
    classifier or regressor becomes a ``SEQ_CLS`` adapter for ``BertForSequenceClassification``, a tagger a
    ``TOKEN_CLS`` one; a mean- or cls-pooled patch becomes a ``FEATURE_EXTRACTION`` adapter of the bare encoder, its
    head and pooling in ``patchserve_head.safetensors`` beside it."""
    if patch.meta.patch_type not in (LORA_PATCH_TYPE, IA3_PATCH_TYPE):
        raise PatchError(
            f"a {patch.meta.patch_type!r} patch has no PEFT form (PEFT's bias-only training is not an adapter type); "
            f"export-peft writes {LORA_PATCH_TYPE!r} and {IA3_PATCH_TYPE!r} patches"
        )
    patch.check_compatible(encoder.spec)
    m = patch.meta
    if m.kind == "token-classification":
        task_type = "TOKEN_CLS"
    else:
        task_type = "SEQ_CLS" if m.pooling == "pooler" else "FEATURE_EXTRACTION"
    prefix = str(getattr(type(encoder.model), "base_model_prefix", ""))
    wrapped = _WRAPPED + (prefix + "." if task_type != "FEATURE_EXTRACTION" and prefix else "")
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    if m.patch_type == LORA_PATCH_TYPE:
        for module, (a, b) in factor_pairs(patch.lora).items():
            tensors[f"{wrapped}{module}.lora_A.weight"], tensors[f"{wrapped}{module}.lora_B.weight"] = a, b
            ranks[module] = int(a.shape[0])
    else:
        site = {n: r for n, r in ia3_roles(encoder.model).items()}
        for name, scale in patch.scales.items():
            role = site[name]
            module = f"encoder.layer.{role.layer}.output.dense" if role.role == "ff" else name
            tensors[f"{wrapped}{module}.ia3_l"] = scale.view(1, -1) if role.role == "ff" else scale.view(-1, 1)
            ranks[module] = 1
    modules = sorted(ranks)
    for name, value in patch.biases.items():  # (the biases a patch does not set keep the base's values)
        module = name.removesuffix(".bias")
        tensors[wrapped + (f"{module}.base_layer.bias" if module in ranks else name)] = value
    head = {"weight": patch.head_weight, "bias": patch.head_bias}
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    if task_type == "FEATURE_EXTRACTION":
        info = {"task": m.task, "kind": m.kind, "pooling": m.pooling, "labels": json.dumps(m.labels)}
        (out / HEAD_FILE).write_bytes(st_save({k: v.contiguous() for k, v in head.items()}, metadata=info))
    else:
        tensors.update({f"{_WRAPPED}classifier.{k}": v for k, v in head.items()})
    config = _export_config(patch, task_type, modules, ranks)
    (out / WEIGHTS_FILE).write_bytes(st_save({k: v.float().contiguous() for k, v in tensors.items()}))
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
