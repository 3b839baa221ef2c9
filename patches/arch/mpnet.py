"""MPNet: BERT's layer under its own names (attention.attn.q ...), positions from padding_idx + 1, and a relative
position bias shared by every layer (no bias parameter of a site), RoBERTa's classification head."""

from __future__ import annotations

from patchserve.patches.arch.base import Arch

MPNET = Arch(
    "mpnet",
    ("mpnet",),
    "encoder.layer.{i}",
    {
        "attn_q": "attention.attn.q",
        "attn_k": "attention.attn.k",
        "attn_v": "attention.attn.v",
        "attn_out": "attention.attn.o",
        "norm_attn": "attention.LayerNorm",
        "ffn_in": "intermediate.dense",
        "ffn_act": "intermediate",
        "ffn_out": "output.dense",
        "norm_ffn": "output.LayerNorm",
    },
    {"emb_norm": "embeddings.LayerNorm", "pooler": "pooler.dense"},
    positions="absolute-padding-offset",
    heads=("classifier.dense", "classifier.out_proj"),  # RoBERTa's head on the first token
)
