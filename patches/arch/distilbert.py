"""DistilBERT: BERT's layer (post-norm, the same attention) under its own names, no pooler, no token types; its
classification head is pre_classifier + classifier on the first token."""

from __future__ import annotations

from patchserve.patches.arch.base import Arch

DISTILBERT = Arch(
    "distilbert",
    ("distilbert",),
    "transformer.layer.{i}",
    {
        "attn_q": "attention.q_lin",
        "attn_k": "attention.k_lin",
        "attn_v": "attention.v_lin",
        "attn_out": "attention.out_lin",
        "norm_attn": "sa_layer_norm",
        "ffn_in": "ffn.lin1",
        "ffn_act": "ffn.activation",
        "ffn_out": "ffn.lin2",
        "norm_ffn": "output_layer_norm",
    },
    {"emb_norm": "embeddings.LayerNorm"},
    heads=("pre_classifier", "classifier"),
)
