"""What an encoder family is, in one vocabulary that BitFit, (IA)^3, LoRA, the PEFT mapping and the engines read.

A family is data: the module path of each *site* of a layer (the attention's query, key, value and output
projections, the feed-forward's input and output, the two norms) and outside the layers (the embedding norm, the
pooler), how positions are counted, and the modules of its task heads. The tables the rest of the package used to
keep per family (BitFit's roles, (IA)^3's sites, LoRA's targets) are derived from it here, so a family is described
once, and nothing outside ``patches/arch/`` names a model's parameters or a ``model_type``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

#: the sites of one layer, in the order of the computation
LAYER_SITES = ("attn_q", "attn_k", "attn_v", "attn_out", "norm_attn", "ffn_in", "ffn_act", "ffn_out", "norm_ffn")
#: the sites outside the layer stack
TOP_SITES = ("emb_norm", "pooler")

#: BitFit's bias roles (the paper's symbols, Figure 1's rows) -> the site whose bias each is
BIAS_ROLE_SITES = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "m1": "attn_out",
    "ln1": "norm_attn",
    "m2": "ffn_in",
    "m3": "ffn_out",
    "ln2": "norm_ffn",
    "emb_ln": "emb_norm",
    "pooler": "pooler",
}
#: (IA)^3's roles -> the site whose output each scales: the key and value projections, the feed-forward's
#: activation (the intermediate after it)
IA3_ROLE_SITES = {"k": "attn_k", "v": "attn_v", "ff": "ffn_act"}
#: LoRA's roles -> the linear site each updates
LORA_ROLE_SITES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_out", "i": "ffn_in", "f": "ffn_out"}

#: how positions are counted: ``absolute`` from 0; ``absolute-padding-offset`` from the padding index + 1 (RoBERTa's
#: ``create_position_ids_from_input_ids``), so the table holds padding_idx + 1 fewer usable positions
Positions = Literal["absolute", "absolute-padding-offset"]


@dataclass(frozen=True)
class Arch:
    """One encoder family: ``model_types`` (Hugging Face's ``config.model_type``) that share these module names."""

    name: str
    model_types: tuple[str, ...]
    layer: str  # module path of layer i, with ``{i}`` for its index
    sites: Mapping[str, str]  # layer site -> module path inside a layer (every one of LAYER_SITES)
    top: Mapping[str, str] = field(default_factory=dict)  # top site -> module path (those the family has)
    positions: Positions = "absolute"
    # the modules of the family's *ForSequenceClassification head, as PEFT saves them in an adapter
    # (``modules_to_save``); a patch serves a one-layer head (BERT's) on the pooler or the tokens
    heads: tuple[str, ...] = ("classifier",)

    def __post_init__(self) -> None:
        missing = [s for s in LAYER_SITES if s not in self.sites]
        unknown = sorted(set(self.sites) - set(LAYER_SITES)) + sorted(set(self.top) - set(TOP_SITES))
        if missing or unknown or "{i}" not in self.layer:
            raise ValueError(f"family {self.name!r}: sites missing {missing}, unknown {unknown}, layer {self.layer!r}")

    def _module_rx(self, site: str) -> str:
        """A regex over module names for ``site`` (group 1: the layer, for a layer site)."""
        if site in self.top:
            return re.escape(self.top[site])
        prefix = re.escape(self.layer).replace(re.escape("{i}"), r"(\d+)")
        return prefix + r"\." + re.escape(self.sites[site])

    @cached_property
    def bias_rules(self) -> dict[str, str]:
        """BitFit role -> regex over parameter names (group 1, when present, the layer)."""
        return {
            role: self._module_rx(site) + r"\.bias"
            for role, site in BIAS_ROLE_SITES.items()
            if site in self.sites or site in self.top
        }

    @cached_property
    def ia3_rules(self) -> dict[str, str]:
        """(IA)^3 role -> regex over module names (group 1: the layer)."""
        return {role: self._module_rx(site) for role, site in IA3_ROLE_SITES.items()}

    @cached_property
    def lora_rules(self) -> dict[str, str]:
        """LoRA role -> regex over module names (group 1: the layer)."""
        return {role: self._module_rx(site) for role, site in LORA_ROLE_SITES.items()}

    def max_positions(self, config: Any) -> int:
        """The longest input (in tokens, special ones included) the family's position table can embed."""
        table = int(getattr(config, "max_position_embeddings", 512))
        if self.positions == "absolute-padding-offset":
            return table - (int(config.pad_token_id) + 1)
        return table
