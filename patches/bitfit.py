"""Which parameters of an encoder are BitFit targets; extract a patch from a model; apply one to a model.

Besides the biases, a ``bitfit-ia3`` patch (opt-in, ``SCALES["ia3"]``) trains (IA)^3 scales (Liu et al., 2022): one
vector per layer for each of the key and value projections' outputs and the feed-forward intermediate's (after its
activation), each multiplied into its module's output per row. (IA)^3 sites are modules, not parameters: the plain
model applies them by forward hooks (``apply_values``), the packed engine by gathered banks.

Bias *roles* follow the BitFit paper's symbols (b_q, b_k, b_v, b_m1, b_LN1, b_m2, b_m3, b_LN2, plus the embedding
LayerNorm and pooler biases). Which parameter each role is in a family, and which modules (IA)^3 scales, the family's
description says (``patchserve.patches.arch``): nothing here names a model's parameters.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from patchserve.patches.arch import BIAS_ROLE_SITES, arch_of, undescribed
from patchserve.patches.errors import EncoderError, PatchKeysError
from patchserve.patches.format import IA3_PATCH_TYPE, LORA_PATCH_TYPE, PATCH_TYPE, Patch, PatchMeta
from patchserve.patches.lora import applied_factors, apply_factors, lora_roles, split_factor

#: role order used in reports and heatmaps (the paper's Figure 1 rows)
ROLE_ORDER = tuple(BIAS_ROLE_SITES)

#: named bias subsets: None = every bias of the encoder (the paper's "all"), else the roles it trains
BIAS_SUBSETS: dict[str, tuple[str, ...] | None] = {
    "all": None,
    "query-intermediate": ("q", "m2"),
}


#: what a patch trains besides biases: "none" (BitFit) or "ia3" ((IA)^3 scales on every layer's keys, values and
#: feed-forward intermediate), by patch type
SCALES: dict[str, str] = {"none": PATCH_TYPE, "ia3": IA3_PATCH_TYPE}


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


def ia3_roles(encoder: nn.Module) -> dict[str, BiasRole]:
    """Each (IA)^3 site's role (k, v, ff) and layer, by module name, in the encoder's order (none for a family no
    description covers)."""
    arch = arch_of(encoder)
    rules = {role: re.compile(rx) for role, rx in (arch.ia3_rules if arch else {}).items()}
    out: dict[str, BiasRole] = {}
    for name, _ in encoder.named_modules():
        for role, rx in rules.items():
            m = rx.fullmatch(name)
            if m:
                out[name] = BiasRole(role, int(m.group(1)))
    return out


def ia3_sites(encoder: nn.Module) -> dict[str, nn.Module]:
    """The modules whose outputs an (IA)^3 patch scales, by module name, in the encoder's order."""
    modules = dict(encoder.named_modules())
    return {n: modules[n] for n in ia3_roles(encoder)}


def _scale_widths(encoder: nn.Module) -> dict[str, int]:
    """The width of each (IA)^3 site's output, by module name: the key's and value's Linear's; the activated
    intermediate's is the width of the Linear before the activation (LoRA's role "i", the feed-forward input)."""
    modules = dict(encoder.named_modules())
    ffn_in: dict[int | None, str] = {layer: name for name, (role, layer) in lora_roles(encoder).items() if role == "i"}
    out: dict[str, int] = {}
    for name, role in ia3_roles(encoder).items():
        linear = modules.get(ffn_in.get(role.layer, "")) if role.role == "ff" else modules[name]
        if not isinstance(linear, nn.Linear):
            raise EncoderError(f"cannot tell the output width of {name} for an (IA)^3 scale")
        out[name] = int(linear.out_features)
    return out


def scale_shapes(encoder: nn.Module) -> dict[str, tuple[int, ...]]:
    """The shape of everything a patch can scale: every (IA)^3 site."""
    return {n: (w,) for n, w in _scale_widths(encoder).items()}


def ia3_base(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """Every (IA)^3 site at its base value: ones, float32 (a scale of one leaves the output as it is)."""
    return {n: torch.ones(w) for n, w in _scale_widths(encoder).items()}


def scale_names(encoder: nn.Module, scales: str) -> list[str]:
    """Names of the (IA)^3 sites that ``scales`` (a key of ``SCALES``) trains, in the encoder's module order."""
    if scales not in SCALES:
        raise ValueError(f"unknown scales {scales!r}; choose one of {sorted(SCALES)}")
    if scales == "none":
        return []
    names = list(ia3_sites(encoder))
    if not names:
        raise EncoderError(undescribed(encoder, "(IA)^3 sites") + "; use scales 'none'")
    return names


def trained_names(encoder: nn.Module, subset: str, scales: str) -> list[str]:
    """Everything a patch of this bias subset and these scales trains: its biases, then its scales."""
    return target_names(encoder, subset) + scale_names(encoder, scales)


def _rules(encoder: nn.Module) -> dict[str, str]:
    arch = arch_of(encoder)
    if arch is None:
        raise EncoderError(undescribed(encoder, "bias roles") + "; use --bias-subset all, which needs none")
    return arch.bias_rules


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
    """Build a patch from a trained model: the current values of its target biases (and, for a ``bitfit-ia3``
    ``meta.patch_type``, of every (IA)^3 scale; for a ``lora`` one, the LoRA factors applied to it) plus the head.

    ``targets`` defaults to the names of ``meta.bias_subset``.
    """
    encoder = encoder_of(model)
    params = bias_parameters(encoder)
    names = list(targets) if targets is not None else target_names(encoder, meta.bias_subset)
    missing = [n for n in names if n not in params]
    if missing:
        raise PatchKeysError(f"the model has no bias parameters {missing[:5]}")
    scales: Mapping[str, torch.Tensor] = ia3_values(encoder) if meta.patch_type == IA3_PATCH_TYPE else {}
    lora = applied_factors(encoder) if meta.patch_type == LORA_PATCH_TYPE else {}

    def value(p: torch.Tensor) -> torch.Tensor:
        return p.detach().to("cpu", torch.float32).clone()

    return Patch(
        meta=meta,
        biases={n: value(params[n]) for n in names},
        head_weight=value(head.weight),
        head_bias=value(head.bias),
        scales={n: value(p) for n, p in scales.items()},
        lora=lora,
    )


_IA3_BUFFER = "ia3_scale"


def _scale_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of an (IA)^3 site: its output times its scale."""
    return output * getattr(module, _IA3_BUFFER)


def ia3_values(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """The (IA)^3 scales ``apply_values`` set on a plain model, by site (ones where none was set)."""
    out = ia3_base(encoder)
    for name, module in ia3_sites(encoder).items():
        scale = getattr(module, _IA3_BUFFER, None)
        if isinstance(scale, torch.Tensor):
            out[name] = scale
    return out


@torch.no_grad()
def apply_values(model: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Copy a patch's values (``Patch.values``: biases and (IA)^3 scales) into a plain HF model in place (the reference
    path for tests and evaluation). An (IA)^3 scale becomes a buffer of its module and a forward hook (installed once
    per module) multiplies the module's output by it. LoRA factors are ``patches.lora.apply_factors``'."""
    encoder = encoder_of(model)
    params = bias_parameters(encoder)
    sites = ia3_sites(encoder)
    factors = {n: v for n, v in values.items() if split_factor(n) is not None}
    unknown = sorted(set(values) - set(params) - set(sites) - set(factors))
    if unknown:
        raise PatchKeysError(f"the model has no bias or (IA)^3 site {unknown[:5]}")
    apply_factors(encoder, factors)
    for name, value in values.items():
        if name in factors:
            continue
        if name in params:
            params[name].copy_(value.to(params[name].device, params[name].dtype))
            continue
        module = sites[name]
        like = next(module.parameters(), None)
        if like is None:  # an activation (DistilBERT's ffn.activation) holds no parameter: the encoder's device
            like = next(encoder.parameters())
        scale = value.detach().to(like.device, like.dtype).clone()
        if not isinstance(getattr(module, _IA3_BUFFER, None), torch.Tensor):
            module.register_forward_hook(_scale_output)
        module.register_buffer(_IA3_BUFFER, scale, persistent=False)


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
