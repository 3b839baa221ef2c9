"""Which parameters of an encoder are BitFit targets; extract a patch from a model; apply one to a model.

Besides the biases, a ``bitfit-ln`` patch (opt-in, ``SCALES["layernorm"]``) also trains every LayerNorm's gain:
like a bias, a gain is one vector per task that the engine applies per row (an elementwise multiply where a bias is
an add), so it serves at a bias's cost.

Bias *roles* follow the BitFit paper's symbols (b_q, b_k, b_v, b_m1, b_LN1, b_m2, b_m3, b_LN2, plus the embedding
LayerNorm and pooler biases). Each architecture maps roles to Hugging Face parameter names by a naming rule, so a
new BERT-family architecture is one entry in ``ARCH_RULES`` -- nothing else hard-codes BERT.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from patches.errors import EncoderError, PatchKeysError
from patches.format import PATCH_TYPE, SCALED_PATCH_TYPE, Patch, PatchMeta

_L = r"encoder\.layer\.(\d+)\."
_BERT_ROLES = {
    "q": _L + r"attention\.self\.query\.bias",
    "k": _L + r"attention\.self\.key\.bias",
    "v": _L + r"attention\.self\.value\.bias",
    "m1": _L + r"attention\.output\.dense\.bias",
    "ln1": _L + r"attention\.output\.LayerNorm\.bias",
    "m2": _L + r"intermediate\.dense\.bias",
    "m3": _L + r"output\.dense\.bias",
    "ln2": _L + r"output\.LayerNorm\.bias",
    "emb_ln": r"embeddings\.LayerNorm\.bias",
    "pooler": r"pooler\.dense\.bias",
}
_MPNET_ROLES = {
    "q": _L + r"attention\.attn\.q\.bias",
    "k": _L + r"attention\.attn\.k\.bias",
    "v": _L + r"attention\.attn\.v\.bias",
    "m1": _L + r"attention\.attn\.o\.bias",
    "ln1": _L + r"attention\.LayerNorm\.bias",
    "m2": _L + r"intermediate\.dense\.bias",
    "m3": _L + r"output\.dense\.bias",
    "ln2": _L + r"output\.LayerNorm\.bias",
    "emb_ln": r"embeddings\.LayerNorm\.bias",
    "pooler": r"pooler\.dense\.bias",
}
#: model_type -> role -> regex over the encoder's parameter names (group 1, when present, is the layer index)
ARCH_RULES: dict[str, dict[str, str]] = {
    "bert": _BERT_ROLES,
    "roberta": _BERT_ROLES,
    "xlm-roberta": _BERT_ROLES,
    "mpnet": _MPNET_ROLES,
}
#: role order used in reports and heatmaps (the paper's Figure 1 rows)
ROLE_ORDER = ("q", "k", "v", "m1", "ln1", "m2", "m3", "ln2", "emb_ln", "pooler")

#: named bias subsets: None = every bias of the encoder (the paper's "all"), else the roles it trains
BIAS_SUBSETS: dict[str, tuple[str, ...] | None] = {
    "all": None,
    "query-intermediate": ("q", "m2"),
}


#: what a patch trains besides biases: "none" (BitFit) or "layernorm" (every LayerNorm gain too), by patch type
SCALES: dict[str, str] = {"none": PATCH_TYPE, "layernorm": SCALED_PATCH_TYPE}


@dataclass(frozen=True)
class BiasRole:
    """A bias parameter's role (paper symbol) and layer index (None outside the layer stack)."""

    role: str
    layer: int | None


def encoder_of(model: nn.Module) -> nn.Module:
    """The bare encoder of an HF model (``BertForX.bert`` -> BertModel); a bare encoder is returned as is."""
    base = getattr(model, "base_model", model)
    return base if isinstance(base, nn.Module) else model


def bias_parameters(encoder: nn.Module) -> dict[str, nn.Parameter]:
    """Every bias parameter of the encoder, by name (the paper's "all" set)."""
    return {n: p for n, p in encoder.named_parameters() if n.endswith(".bias")}


def bias_shapes(encoder: nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in bias_parameters(encoder).items()}


def scale_parameters(encoder: nn.Module) -> dict[str, nn.Parameter]:
    """Every LayerNorm gain of the encoder, by name (what a ``bitfit-ln`` patch trains besides the biases)."""
    return {
        f"{n}.weight" if n else "weight": m.weight
        for n, m in encoder.named_modules()
        if isinstance(m, nn.LayerNorm) and isinstance(m.weight, nn.Parameter)
    }


def scale_shapes(encoder: nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in scale_parameters(encoder).items()}


def patch_parameters(encoder: nn.Module) -> dict[str, nn.Parameter]:
    """Every parameter a patch can set: the biases and the LayerNorm gains."""
    return bias_parameters(encoder) | scale_parameters(encoder)


def scale_names(encoder: nn.Module, scales: str) -> list[str]:
    """Names of the gains that ``scales`` (a key of ``SCALES``) trains, in the encoder's parameter order."""
    if scales not in SCALES:
        raise ValueError(f"unknown scales {scales!r}; choose one of {sorted(SCALES)}")
    if scales == "none":
        return []
    names = list(scale_parameters(encoder))
    if not names:
        raise EncoderError("this encoder has no LayerNorm gains to train; use scales 'none'")
    return names


def trained_names(encoder: nn.Module, subset: str, scales: str) -> list[str]:
    """Everything a patch of this bias subset and these scales trains: its biases, then its LayerNorm gains."""
    return target_names(encoder, subset) + scale_names(encoder, scales)


def _rules(encoder: nn.Module) -> dict[str, str]:
    model_type = getattr(getattr(encoder, "config", None), "model_type", None)
    if model_type not in ARCH_RULES:
        raise EncoderError(
            f"architecture {model_type!r} has no BitFit naming rules (supported: {sorted(ARCH_RULES)}); "
            "use --bias-subset all, which needs no rules, or add the architecture to patches.bitfit.ARCH_RULES"
        )
    return ARCH_RULES[model_type]


def bias_roles(encoder: nn.Module) -> dict[str, BiasRole]:
    """Map each bias parameter name to its role; biases no rule names are left out."""
    out: dict[str, BiasRole] = {}
    compiled = {role: re.compile(rx) for role, rx in _rules(encoder).items()}
    for name in bias_parameters(encoder):
        for role, rx in compiled.items():
            m = rx.fullmatch(name)
            if m:
                out[name] = BiasRole(role, int(m.group(1)) if m.groups() else None)
                break
    return out


def target_names(encoder: nn.Module, subset: str) -> list[str]:
    """Names of the biases a subset trains, in the encoder's parameter order."""
    if subset not in BIAS_SUBSETS:
        raise ValueError(f"unknown bias subset {subset!r}; choose one of {sorted(BIAS_SUBSETS)}")
    roles = BIAS_SUBSETS[subset]
    if roles is None:
        return list(bias_parameters(encoder))
    names = [n for n, r in bias_roles(encoder).items() if r.role in roles]
    if not names:
        raise EncoderError(f"bias subset {subset!r} matches no parameter of this encoder")
    return names


def extract_patch(model: nn.Module, head: nn.Linear, meta: PatchMeta, targets: Iterable[str] | None = None) -> Patch:
    """Build a patch from a trained model: the current values of its target biases (and, for a ``bitfit-ln``
    ``meta.patch_type``, of every LayerNorm gain) plus the head.

    ``targets`` defaults to the names of ``meta.bias_subset``.
    """
    encoder = encoder_of(model)
    params = bias_parameters(encoder)
    names = list(targets) if targets is not None else target_names(encoder, meta.bias_subset)
    missing = [n for n in names if n not in params]
    if missing:
        raise PatchKeysError(f"the model has no bias parameters {missing[:5]}")
    gains = scale_parameters(encoder) if meta.patch_type == SCALED_PATCH_TYPE else {}

    def value(p: torch.Tensor) -> torch.Tensor:
        return p.detach().to("cpu", torch.float32).clone()

    return Patch(
        meta=meta,
        biases={n: value(params[n]) for n in names},
        head_weight=value(head.weight),
        head_bias=value(head.bias),
        scales={n: value(p) for n, p in gains.items()},
    )


@torch.no_grad()
def apply_values(model: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Copy a patch's values (biases, and LayerNorm gains for a ``bitfit-ln`` patch: ``Patch.values``) into a plain
    HF model in place (the reference path for tests and evaluation)."""
    params = patch_parameters(encoder_of(model))
    unknown = sorted(set(values) - set(params))
    if unknown:
        raise PatchKeysError(f"the model has no bias or LayerNorm gain parameters {unknown[:5]}")
    for name, value in values.items():
        params[name].copy_(value.to(params[name].device, params[name].dtype))


def base_biases(model: nn.Module, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """A copy of the model's current (base) bias values, all of them or the ``names`` given."""
    params = bias_parameters(encoder_of(model))
    keep = params if names is None else {n: params[n] for n in names}
    return {n: p.detach().to("cpu", torch.float32).clone() for n, p in keep.items()}


def head_module(patch: Patch) -> nn.Linear:
    """The patch's head as an ``nn.Linear`` on the CPU."""
    n_out, hidden = patch.head_weight.shape
    head = nn.Linear(hidden, n_out)
    with torch.no_grad():
        head.weight.copy_(patch.head_weight)
        head.bias.copy_(patch.head_bias)
    return head
