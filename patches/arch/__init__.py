"""What an encoder family is: one description per family (``base.Arch``), found by ``model_type``
(``registry``). The only package that names a model's parameters or a ``model_type``."""

from patchserve.patches.arch.base import BIAS_ROLE_SITES, IA3_ROLE_SITES, LAYER_SITES, LORA_ROLE_SITES, Arch
from patchserve.patches.arch.registry import (
    ARCHS,
    DOCS_PAGE,
    FAMILIES,
    HEAD_MODULES,
    arch_of,
    arch_of_sites,
    described,
    family_name,
    model_type_of,
    undescribed,
)

__all__ = [
    "ARCHS",
    "BIAS_ROLE_SITES",
    "DOCS_PAGE",
    "FAMILIES",
    "HEAD_MODULES",
    "IA3_ROLE_SITES",
    "LAYER_SITES",
    "LORA_ROLE_SITES",
    "Arch",
    "arch_of",
    "arch_of_sites",
    "described",
    "family_name",
    "model_type_of",
    "undescribed",
]
