"""``model_type`` -> the family that describes it (``patches/arch/``)."""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from patchserve.patches.arch.base import Arch
from patchserve.patches.arch.bert import BERT, ELECTRA, ROBERTA
from patchserve.patches.arch.distilbert import DISTILBERT
from patchserve.patches.arch.mpnet import MPNET

FAMILIES: tuple[Arch, ...] = (BERT, ROBERTA, ELECTRA, DISTILBERT, MPNET)
ARCHS: dict[str, Arch] = {t: a for a in FAMILIES for t in a.model_types}
#: every module of a described family's sequence-classification head, as PEFT saves it (``modules_to_save``)
HEAD_MODULES: frozenset[str] = frozenset(h for a in FAMILIES for h in a.heads)
#: where a user reads which families are described and how a new one is added
DOCS_PAGE = "docs/encoders.md"


def model_type_of(model_or_config: Any) -> str:
    """The ``model_type`` of a Hugging Face model or config (``""`` where it has none)."""
    config = getattr(model_or_config, "config", model_or_config)
    return str(getattr(config, "model_type", "") or "")


def family_name(model_or_config: Any) -> str:
    """What /readyz and the metrics call an encoder's family: its ``model_type`` (the described family's name would
    say "roberta" for XLM-R and CamemBERT alike), "unknown" where it has none."""
    return model_type_of(model_or_config) or "unknown"


def arch_of(model_or_config: Any) -> Arch | None:
    """The family of a Hugging Face model or config; None for one no description covers."""
    return ARCHS.get(model_type_of(model_or_config))


def arch_of_sites(lora_sites: Collection[str]) -> Arch | None:
    """The family whose LoRA sites are these module names (a ``BaseSpec``'s ``lora_shapes``: what a front end that
    holds no model knows of its encoder); None where no description explains them all."""
    for arch in FAMILIES:
        rules = [re.compile(rx) for rx in arch.lora_rules.values()]
        if lora_sites and all(any(rx.fullmatch(n) for rx in rules) for n in lora_sites):
            return arch
    return None


def described() -> str:
    """The described model types, for messages."""
    return ", ".join(sorted(ARCHS))


def undescribed(model_or_config: Any, what: str) -> str:
    """The message for an encoder no description covers: ``what`` it therefore lacks, the described model types and
    where adding a family is explained."""
    return (
        f"this encoder's family ({model_type_of(model_or_config) or 'no model_type'}) has no {what} described "
        f"(described: {described()}; {DOCS_PAGE} says how to describe one)"
    )
