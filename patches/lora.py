"""LoRA on the plain model: which linear layers a ``lora`` patch may update, and applying its factors.

A ``lora`` patch (Hu et al., 2021, as Hugging Face PEFT trains it with ``bias="all"``) adds a low-rank product to
chosen linear layers, ``y = x W^T + (x A^T) B^T + b``, besides setting every bias. Its factors are named
``<module>.lora_A`` ``[r, in]`` and ``<module>.lora_B`` ``[out, r]``, B already holding PEFT's scaling (alpha / r, or
alpha / sqrt(r) with rsLoRA). Targets follow PEFT's names for BERT: ``query``, ``key``, ``value`` (attention),
``attention.output.dense``, ``intermediate.dense`` and ``output.dense`` (the feed-forward output) in every layer.

The plain model (tests' and evaluation's reference) applies the factors with a forward hook on each module, which
adds the low-rank product to its output; the packed engine gathers them per row (``patches/packed_lora.py``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from patchserve.patches.arch import arch_of, undescribed
from patchserve.patches.errors import PatchKeysError
from patchserve.patches.format import LORA_A, LORA_B

#: PEFT's short target names (``target_modules``) for each role, as PEFT matches them (a name's suffix; the choices of
#: ``TrainConfig.lora_targets``)
ROLE_TARGETS = {
    "q": "query",
    "k": "key",
    "v": "value",
    "o": "attention.output.dense",
    "i": "intermediate.dense",
    "f": "output.dense",
}

_FACTORS = "lora_factors"


def lora_roles(encoder: nn.Module) -> dict[str, tuple[str, int]]:
    """Each LoRA site's (role, layer), by module name, in the encoder's order (none for a family no description
    covers). Roles: q, k, v the attention projections, o the attention output, i the feed-forward intermediate, f the
    feed-forward output."""
    arch = arch_of(encoder)
    rules = {role: re.compile(rx) for role, rx in (arch.lora_rules if arch else {}).items()}
    out: dict[str, tuple[str, int]] = {}
    for name, module in encoder.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        for role, rx in rules.items():
            m = rx.fullmatch(name)
            if m:
                out[name] = (role, int(m.group(1)))
    return out


def lora_shapes(encoder: nn.Module) -> dict[str, tuple[int, int]]:
    """Every LoRA site's weight shape ``(out, in)``, by module name."""
    modules = dict(encoder.named_modules())
    return {n: (int(modules[n].out_features), int(modules[n].in_features)) for n in lora_roles(encoder)}


def split_factor(name: str) -> tuple[str, str] | None:
    """``(module, "A" | "B")`` of a LoRA factor's name; None for any other name."""
    for suffix, which in ((LORA_A, "A"), (LORA_B, "B")):
        if name.endswith(suffix):
            return name[: -len(suffix)], which
    return None


def factor_pairs(values: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The LoRA factors among ``values`` (a patch's ``values``) as module -> (A, B)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in values.items():
        split = split_factor(name)
        if split is not None:
            pairs.setdefault(split[0], {})[split[1]] = t
    return {m: (f["A"], f["B"]) for m, f in pairs.items()}


def targets_of(encoder: nn.Module, targets: list[str]) -> list[str]:
    """The module names that PEFT-style ``targets`` (short names such as ``query``, or full module names) select,
    among the encoder's LoRA sites; an unknown target is an error that lists the known ones."""
    sites = lora_roles(encoder)
    if not sites:
        raise PatchKeysError(undescribed(encoder, "LoRA sites"))
    chosen: list[str] = []
    for target in targets:
        matched = [n for n in sites if n == target or n.endswith("." + target)]
        if target == "output.dense":  # PEFT's suffix match would take the attention output too: the feed-forward's
            matched = [n for n in matched if sites[n][0] == "f"]
        if not matched:
            raise PatchKeysError(
                f"LoRA target {target!r} matches no linear layer; choose from {sorted(ROLE_TARGETS.values())}"
            )
        chosen += [n for n in matched if n not in chosen]
    return [n for n in sites if n in chosen]


def _add_low_rank(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of a LoRA site: its output plus the low-rank product of its input."""
    a, b = getattr(module, _FACTORS)
    return output + (args[0] @ a.t()) @ b.t()


@torch.no_grad()
def apply_factors(encoder: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Give each LoRA site named in ``values`` (``<module>.lora_A`` / ``.lora_B``) its factors, as a hook that adds
    ``(x A^T) B^T`` to the module's output (installed once per module; applying again replaces the factors)."""
    modules = dict(encoder.named_modules())
    for module_name, (a, b) in factor_pairs(values).items():
        module = modules.get(module_name)
        if not isinstance(module, nn.Linear):
            raise PatchKeysError(f"the model has no linear layer {module_name!r} for LoRA factors")
        like = module.weight
        if not hasattr(module, _FACTORS):
            module.register_forward_hook(_add_low_rank)
        setattr(module, _FACTORS, (a.detach().to(like.device, like.dtype), b.detach().to(like.device, like.dtype)))


@dataclass(frozen=True)
class LoraSpec:
    """What a training run's LoRA is: its modules (names), rank and alpha (the update is scaled by alpha / rank)."""

    modules: tuple[str, ...]
    rank: int
    alpha: float

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def init_factors(encoder: nn.Module, spec: LoraSpec) -> dict[str, torch.Tensor]:
    """A run's starting factors, as PEFT starts them: A Kaiming-uniform (bound 1/sqrt(in), from torch's generator),
    B zero (so the run starts at the base model)."""
    shapes = lora_shapes(encoder)
    out: dict[str, torch.Tensor] = {}
    for module in spec.modules:
        out_f, in_f = shapes[module]
        bound = 1.0 / math.sqrt(in_f)
        out[module + LORA_A] = torch.empty(spec.rank, in_f).uniform_(-bound, bound)
        out[module + LORA_B] = torch.zeros(out_f, spec.rank)
    return out


def applied_factors(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA factors ``apply_factors`` gave a plain model's modules, by factor name (float32, on the CPU)."""
    out: dict[str, torch.Tensor] = {}
    for name, module in encoder.named_modules():
        factors = getattr(module, _FACTORS, None)
        if factors is not None:
            out[name + LORA_A] = factors[0].detach().to("cpu", torch.float32).clone()
            out[name + LORA_B] = factors[1].detach().to("cpu", torch.float32).clone()
    return out
