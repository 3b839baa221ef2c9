"""The families whose layer is BERT's, under BERT's module names: BERT, RoBERTa, XLM-R, CamemBERT, ELECTRA."""

from __future__ import annotations

from patchserve.patches.arch.base import Arch

BERT_SITES = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_out": "attention.output.dense",
    "norm_attn": "attention.output.LayerNorm",
    "ffn_in": "intermediate.dense",
    "ffn_act": "intermediate",
    "ffn_out": "output.dense",
    "norm_ffn": "output.LayerNorm",
}
_TOP = {"emb_norm": "embeddings.LayerNorm", "pooler": "pooler.dense"}
_LAYER = "encoder.layer.{i}"

BERT = Arch("bert", ("bert",), _LAYER, BERT_SITES, _TOP)
# RoBERTa and the families built on its code count positions from padding_idx + 1; their classification head is
# classifier.dense + classifier.out_proj on the first token
_TWO_LAYER_HEAD = ("classifier.dense", "classifier.out_proj")
ROBERTA = Arch(
    "roberta",
    ("roberta", "xlm-roberta", "camembert"),
    _LAYER,
    BERT_SITES,
    _TOP,
    positions="absolute-padding-offset",
    heads=_TWO_LAYER_HEAD,
)
# ELECTRA's discriminator: BERT's layer, no pooler (its classification head reads the first token, as RoBERTa's)
ELECTRA = Arch("electra", ("electra",), _LAYER, BERT_SITES, {"emb_norm": "embeddings.LayerNorm"}, heads=_TWO_LAYER_HEAD)
