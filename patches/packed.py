"""The packed model: a padding-free forward of a BERT encoder over rows of any mix of tasks (or training runs).

Rows are packed into one token stream ``[N, H]`` with cumulative row offsets ``cu`` (``[R + 1]``). Every linear
layer, LayerNorm and activation then works on real tokens only; attention is the only op that mixes tokens, and
it is restricted to each row: variable-length flash attention on CUDA in half precision, and on the CPU (or in
float32) an exact path that pads only the attention itself.

Each row's task enters as *folded bias banks* ``[slots, D]``, gathered per token by the token's slot index and
added in the epilogue of the matrix product that precedes it (``addmm``). Besides dropping the key bias (softmax
is shift-invariant within a row) and folding the value bias into the attention-output bias (attention weights
sum to 1), every LayerNorm's beta is folded into what follows it: into the next query/key/value biases through
their weights, and into the bias added before the next residual sum. That leaves four per-row vectors per layer
(qkv, attention output, intermediate, output), plus the last LayerNorm's beta added once at the end. All folds
are exact in real arithmetic; ``tests/test_packed.py`` checks each one against the unfolded model.

Pooling (mean / cls / pooler, chosen per row) and the heads (every resident head in one padded bank) are part of
the same forward, so a batch of any mix is one fixed sequence of device ops: CUDA graphs capture it once per
token-count bucket (``server/engine/graphs.py``).

The trainer runs the same forward and its backward (``patches/packed_model.py``): there the banks are computed from
each run's bias parameters at every step (``bank_values`` is differentiable) and passed to ``encode``/``pool``, and
dropout is applied where BERT applies it. The folds that move a LayerNorm beta or the value bias past a dropout are
not exact under dropout, so a training model builds its PackedBert with ``fold_value_bias=False, fold_ln_bias=False``
(dropping the key bias stays exact: the key bias gets no gradient in the plain model either).

A ``bitfit-ia3`` patch sets (IA)^3 scales: per layer, one on the key and value projections' outputs (the *scale bank*
``{i}.s`` ``[slots, 3H]``, ones over the query part, multiplied into the query/key/value product's output after its
bias) and one on the feed-forward intermediate after its activation (``{i}.si``). The folds stay exact: the key
scale does not break the key bias's drop (q . (s * b_k) is still one constant per query), and the value bias folds
into the attention-output bias scaled (attention weights sum to 1, so V's scale passes through them per feature).
The scale banks exist only once a patch with scales has been loaded (``generation`` counts that, so captured graphs
are dropped); until then a BitFit-only server pays nothing for them.

A ``lora`` patch adds each row's low-rank products to the four matrix products of every layer it targets
(``patches/packed_lora.py``). The folds stay exact with it: a beta or value bias folded through a weight is folded
through that task's updated weight ``W + B A`` (``fold_through``), since the low-rank product of the stream is taken
without them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from patchserve.patches.bitfit import bias_parameters, ia3_base
from patchserve.patches.lora import factor_pairs
from patchserve.patches.packed_attention import AttentionGroups, grouped_attention
from patchserve.patches.packed_lora import LoraBank, LoraFactors, LowRank, fold_products, fold_through
from patchserve.patches.packed_ops import dropout, half_product, token_biases

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
}

POOL_MODES = {"mean": 0, "cls": 1, "pooler": 2}


def packed_unsupported(model: nn.Module) -> str | None:
    """Why the packed engine cannot run ``model`` (None: it can)."""
    config = getattr(model, "config", None)
    if type(model).__name__ != "BertModel" or config is None:
        return f"the packed engine covers BertModel encoders, not {type(model).__name__}"
    if getattr(config, "position_embedding_type", "absolute") not in (None, "absolute"):
        return f"position_embedding_type {config.position_embedding_type!r} (only absolute positions are packed)"
    if config.hidden_act not in _ACTIVATIONS:
        return f"activation {config.hidden_act!r} is not one of {sorted(_ACTIVATIONS)}"
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return "decoder / cross-attention encoders are not packed"
    return None


@dataclass
class _Layer:
    wqkv: torch.Tensor  # [3H, H]: query, key, value weights stacked
    wo: torch.Tensor
    g1: torch.Tensor  # LayerNorm gains (shared by every task)
    eps1: float
    wi: torch.Tensor
    wf: torch.Tensor
    g2: torch.Tensor
    eps2: float
    names: dict[str, str]  # role -> bias parameter name


ProductWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # a layer's qkv, o, i, f weights


@dataclass
class PackedBatch:
    """Device tensors of one packed batch. N tokens (maybe padded to a bucket), R rows (maybe padded).

    Tokens past ``cu[-1]`` and rows past the real ones are padding: their ``seg`` is ``R`` (no row), so they never
    reach a pooled vector. ``pidx``/``key_mask`` exist only for the exact (padded-attention) path."""

    ids: torch.Tensor  # [N] int32
    types: torch.Tensor  # [N]
    pos: torch.Tensor  # [N]
    tok_slot: torch.Tensor  # [N] the token's bank row
    seg: torch.Tensor  # [N] the token's row, R for padding
    cu: torch.Tensor  # [R + 1] int32 cumulative row offsets
    row_slot: torch.Tensor  # [R]
    row_mode: torch.Tensor  # [R] POOL_MODES value
    max_len: int  # the longest row (flash attention's grid bound)
    pidx: torch.Tensor | None = None  # [N] position of each token in a padded [R * max_len] layout
    key_mask: torch.Tensor | None = None  # [R, 1, 1, max_len] bool, True for real keys
    groups: AttentionGroups | None = None  # the exact path's rows grouped by length (on the CPU)


class Heads(NamedTuple):
    """Task heads by slot: weights ``[S, C, H]`` and biases ``[S, C]`` (a HeadBank's tensors, or a trainer's)."""

    weight: torch.Tensor
    bias: torch.Tensor


class HeadBank:
    """Every resident task head in two device tensors: weights ``[S, C, H]`` and biases ``[S, C]``, C the largest
    output count so far (padded with zeros). Growing C reallocates: ``generation`` counts that, so captured graphs
    that read the old tensors are dropped."""

    def __init__(self, n_slots: int, hidden: int, device: torch.device, dtype: torch.dtype, width: int = 8) -> None:
        self.weight = torch.zeros(n_slots, width, hidden, device=device, dtype=dtype)
        self.bias = torch.zeros(n_slots, width, device=device, dtype=dtype)
        self.generation = 0

    @property
    def width(self) -> int:
        return int(self.weight.shape[1])

    @torch.no_grad()
    def write(self, slot: int, weight: torch.Tensor, bias: torch.Tensor) -> None:
        n_out = weight.shape[0]
        if n_out > self.width:
            width = max(n_out, 2 * self.width)
            w = self.weight.new_zeros(self.weight.shape[0], width, self.weight.shape[2])
            b = self.bias.new_zeros(self.bias.shape[0], width)
            w[:, : self.width] = self.weight
            b[:, : self.width] = self.bias
            self.weight, self.bias = w, b
            self.generation += 1
        self.weight[slot].zero_()
        self.bias[slot].zero_()
        self.weight[slot, :n_out] = weight.to(self.weight.device, self.weight.dtype)
        self.bias[slot, :n_out] = bias.to(self.bias.device, self.bias.dtype)


class PackedBert:
    """The frozen weights of a BertModel (shared, never copied per task) plus the folded per-slot bias banks."""

    def __init__(
        self,
        model: nn.Module,
        n_slots: int,
        *,
        drop_key_bias: bool = True,
        fold_value_bias: bool = True,
        fold_ln_bias: bool = True,
    ) -> None:
        reason = packed_unsupported(model)
        if reason is not None:
            raise ValueError(reason)
        bert: Any = model  # a BertModel: its submodules are read by name
        cfg = bert.config
        self.hidden = int(cfg.hidden_size)
        self.n_heads = int(cfg.num_attention_heads)
        self.head_dim = self.hidden // self.n_heads
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.drop_key_bias, self.fold_value_bias, self.fold_ln_bias = drop_key_bias, fold_value_bias, fold_ln_bias
        emb = bert.embeddings
        self.word: torch.Tensor = emb.word_embeddings.weight.detach()
        self.position: torch.Tensor = emb.position_embeddings.weight.detach()
        types = getattr(emb, "token_type_embeddings", None)
        self.token_type: torch.Tensor | None = types.weight.detach() if types is not None else None
        self.emb_g: torch.Tensor = emb.LayerNorm.weight.detach()
        self.emb_eps = float(emb.LayerNorm.eps)
        self.layers: list[_Layer] = []
        for i, layer in enumerate(bert.encoder.layer):
            att, p = layer.attention, f"encoder.layer.{i}."
            self.layers.append(
                _Layer(
                    wqkv=torch.cat([att.self.query.weight, att.self.key.weight, att.self.value.weight])
                    .detach()
                    .contiguous(),
                    wo=att.output.dense.weight.detach(),
                    g1=att.output.LayerNorm.weight.detach(),
                    eps1=float(att.output.LayerNorm.eps),
                    wi=layer.intermediate.dense.weight.detach(),
                    wf=layer.output.dense.weight.detach(),
                    g2=layer.output.LayerNorm.weight.detach(),
                    eps2=float(layer.output.LayerNorm.eps),
                    names={
                        "q": p + "attention.self.query.bias",
                        "k": p + "attention.self.key.bias",
                        "v": p + "attention.self.value.bias",
                        "o": p + "attention.output.dense.bias",
                        "ln1": p + "attention.output.LayerNorm.bias",
                        "i": p + "intermediate.dense.bias",
                        "f": p + "output.dense.bias",
                        "ln2": p + "output.LayerNorm.bias",
                        "sk": p + "attention.self.key",  # (IA)^3 sites: modules whose outputs are scaled
                        "sv": p + "attention.self.value",
                        "si": p + "intermediate",
                    },
                )
            )
        pooler = getattr(bert, "pooler", None)
        self.pooler_w: torch.Tensor | None = pooler.dense.weight.detach() if pooler is not None else None
        self.device, self.dtype = self.word.device, self.word.dtype
        #: every bias and (IA)^3 scale of the encoder at its base value, float32 (what a task that does not set it gets)
        self.base = {n: p.detach().float().clone() for n, p in bias_parameters(model).items()}
        self.base.update({n: v.to(self.device) for n, v in ia3_base(model).items()})
        self.scale_names = frozenset(layer.names[s] for layer in self.layers for s in ("sk", "sv", "si"))
        self.scales = False  # whether the banks hold per-slot (IA)^3 scales (once a patch with them is loaded)
        self.generation = 0  # counts changes of the banks' set (captured graphs read the old one)
        self.lora: LoraBank | None = None  # the resident tasks' LoRA factors, once a LoRA patch has been loaded
        # LoRA's stacked form up to this many factor columns (None: packed_lora.STACKED_MAX_COLUMNS, measured on the
        # CPU); captured CUDA graphs keep the form of their capture (bench/engine.py sets it on a new runner)
        self.lora_stacked_max_columns: int | None = None
        self._product_weights: dict[torch.dtype, list[ProductWeights]] = {}  # product_weights' copies, by type
        base = self.bank_values([{}])  # every slot starts as the base encoder
        self.banks = {k: v.to(self.dtype).expand(n_slots, -1).contiguous() for k, v in base.items()}

    # --- banks ---------------------------------------------------------------------------------------------------
    def bank_values(self, tasks: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Folded bank rows ``[K, D]`` (float32) of K tasks, from their biases (base values where a task has none).
        The scale banks come too when this model holds them (``scales``) or a task sets an (IA)^3 scale.

        The K tasks fold together: each fold through a weight is one ``[K, in] @ [in, out]`` product, so loading
        many patches at once (a cold batch, a preload) costs a few matrix products, not K matrix-vector ones."""

        def get(name: str) -> torch.Tensor:  # [K, D]
            base = self.base[name]
            values = [t.get(name) for t in tasks]
            return torch.stack([base if v is None else v.to(self.device, torch.float32) for v in values])

        scaled = self.scales or any(not self.scale_names.isdisjoint(t) for t in tasks)
        return self._fold(get, scaled, fold_products(self, tasks))

    def bank_columns(self, columns: Mapping[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
        """``bank_values`` of K tasks given as columns: each name's ``[K, D]`` values (float32, on this model's
        device; a trainer's flat bank viewed per name, differentiable); names not given take their base value."""

        def get(name: str) -> torch.Tensor:  # [K, D]
            column = columns.get(name)
            return self.base[name].expand(k, -1) if column is None else column

        return self._fold(get, self.scales or not self.scale_names.isdisjoint(columns), {})

    def _fold(
        self, get: Callable[[str], torch.Tensor], scaled: bool, lora: Mapping[str, list[Any]]
    ) -> dict[str, torch.Tensor]:
        """The folded banks of K tasks whose values ``get(name)`` gives as ``[K, D]``; ``scaled``: with scale banks;
        ``lora``: the tasks' LoRA factors by site (``fold_products``), through which a fold passes too."""

        def mv(weight: torch.Tensor, vecs: torch.Tensor, site: str) -> torch.Tensor:  # [K, in] -> [K, out]
            return vecs @ weight.float().t() + fold_through(lora, site, vecs)

        h = self.hidden
        vals: dict[str, torch.Tensor] = {}
        # the beta of the LayerNorm in front, not yet added; None where betas are not folded (a trainer's banks): then
        # nothing is carried, and no product or sum of zeros is made (each would be a launch, and its backward one)
        beta = get("embeddings.LayerNorm.bias")
        carry: torch.Tensor | None = beta
        if not self.fold_ln_bias:
            vals["emb_ln"], carry = beta, None
        for i, layer in enumerate(self.layers):
            n = layer.names
            bq, bk, bv, bo = get(n["q"]), get(n["k"]), get(n["v"]), get(n["o"])
            if carry is not None:
                # [K, 3H]: the carried beta through the query, key and value weights
                folded = mv(layer.wqkv, carry, f"{i}.qkv")
                bq, bv = bq + folded[:, :h], bv + folded[:, 2 * h :]
                bk = bk if self.drop_key_bias else bk + folded[:, h : 2 * h]
                bo = bo + carry  # the residual stream carries the normalised value without its beta
            if self.drop_key_bias:
                bk = torch.zeros_like(bk)
            if scaled:
                sk, sv = get(n["sk"]), get(n["sv"])
                vals[f"{i}.s"] = torch.cat([torch.ones_like(sk), sk, sv], dim=1)
                vals[f"{i}.si"] = get(n["si"])
            if self.fold_value_bias:  # attention weights sum to 1: the scaled value bias passes through them
                bo = bo + mv(layer.wo, bv * sv if scaled else bv, f"{i}.o")
                bv = torch.zeros_like(bv)
            vals[f"{i}.qkv"], vals[f"{i}.o"] = torch.cat([bq, bk, bv], dim=1), bo
            b1 = get(n["ln1"])
            if self.fold_ln_bias:
                vals[f"{i}.i"] = get(n["i"]) + mv(layer.wi, b1, f"{i}.i")
                vals[f"{i}.f"] = get(n["f"]) + b1
            else:
                vals[f"{i}.ln1"], vals[f"{i}.i"], vals[f"{i}.f"] = b1, get(n["i"]), get(n["f"])
            beta = get(n["ln2"])
            carry = beta
            if not self.fold_ln_bias:
                vals[f"{i}.ln2"], carry = beta, None
        if carry is not None:
            vals["out"] = carry
        if self.pooler_w is not None:
            vals["pooler"] = get("pooler.dense.bias")
        return vals

    @torch.no_grad()
    def write_slots(self, slots: Sequence[int], tasks: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Fold ``tasks``' biases and write them into bank rows ``slots`` (one per task)."""
        index = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        values = self.bank_values(tasks)
        if not set(values) <= set(self.banks):  # the first patch with scales: every slot gets their banks
            self._add_scale_banks()
        for k, v in values.items():
            self.banks[k].index_copy_(0, index, v.to(self.dtype))
        if self.lora is None and any(map(factor_pairs, tasks)):  # the first LoRA patch: LoRA rows from now on
            self.lora = LoraBank(self, next(iter(self.banks.values())).shape[0])
        if self.lora is not None:
            for slot, task in zip(slots, tasks, strict=True):
                self.lora.write(slot, task)

    def _add_scale_banks(self) -> None:
        """Give every slot (IA)^3 scale banks at their base values (which the slots loaded so far keep)."""
        n_slots = next(iter(self.banks.values())).shape[0]
        self.scales = True
        for k, v in self.bank_values([{}]).items():
            if k not in self.banks:
                self.banks[k] = v.to(self.dtype).expand(n_slots, -1).contiguous()
        self.generation += 1

    @property
    def bank_bytes_per_slot(self) -> int:
        """Device bytes one slot's bias banks take (the heads are the HeadBank's)."""
        return sum(b[0].numel() * b.element_size() for b in self.banks.values())

    @property
    def vectors_per_layer(self) -> int:
        """Per-row bias vectors added in each layer (the cost a patch adds)."""
        return sum(1 for k in self.banks if k.startswith("0."))

    # --- forward -------------------------------------------------------------------------------------------------
    def encode(
        self,
        b: PackedBatch,
        attention: str,
        *,
        banks: Mapping[str, torch.Tensor] | None = None,
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        gather_by_layer: bool = False,
        lora: LoraFactors | None = None,
        matmul_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Final token states ``[N, H]``, float32 (the last LayerNorm, its beta, pooling and heads run in float32,
        so half precision rounds them once less than the plain model does); padding tokens hold anything.

        ``banks`` replaces the resident banks (a trainer's, computed from its parameters); a bank of one row is
        added to every token by broadcasting, without a gather. The dropouts are BERT's (after the embeddings, on
        the attention probabilities, after the attention-output and output projections): a trainer's, 0 to serve.
        ``gather_by_layer``: ``token_biases``' (a trainer's few banks). ``lora``: LoRA factors with ``banks`` (the
        resident ones without). ``matmul_dtype``: the four products of the frozen weights in every layer take their
        input in this type, against copies of the weights in it (``product_weights``), and their output is added to
        the biases in the stream's type; everything else (the biases, LoRA's products, attention, LayerNorms,
        activations) stays in the stream's type (a trainer on a CPU with native bfloat16 products)."""
        h = self.hidden
        if banks is None:
            banks, lora = self.banks, self.lora.factors if self.lora is not None else None
        bias = token_biases(banks, b.tok_slot, gather_by_layer)
        low = LowRank(lora, b, stacked_max_columns=self.lora_stacked_max_columns)
        weights = self.product_weights(matmul_dtype) if matmul_dtype is not None else None

        def product(x: torch.Tensor, w: torch.Tensor, site: str) -> torch.Tensor:
            """``x @ w.T`` plus the biases of ``site``."""
            if weights is None:
                return torch.addmm(bias(site), x, w.t())
            return half_product(x, w, bias(site))

        def drop(t: torch.Tensor) -> torch.Tensor:
            return dropout(t, hidden_dropout)

        def norm(x: torch.Tensor, gain: torch.Tensor, beta: str, eps: float) -> torch.Tensor:
            """LayerNorm with the shared gain, then the beta bank ``beta`` where there is one (else it is folded)."""
            y = F.layer_norm(x, (h,), gain.to(x.dtype), None, eps)
            return y + bias(beta) if beta in banks else y

        x = F.embedding(b.ids, self.word) + F.embedding(b.pos, self.position)
        if self.token_type is not None:
            x = x + F.embedding(b.types, self.token_type)
        x = drop(norm(x, self.emb_g, "emb_ln", self.emb_eps))
        for i, layer in enumerate(self.layers):
            wqkv, wo, wi, wf = (layer.wqkv, layer.wo, layer.wi, layer.wf) if weights is None else weights[i]
            qkv = low.add(f"{i}.qkv", x, product(x, wqkv, f"{i}.qkv"))
            if f"{i}.s" in banks:  # (IA)^3: keys and values scaled per row (in qkv's type: autocast's bfloat16)
                qkv = qkv * bias(f"{i}.s").to(qkv.dtype)
            ctx = self._attend(qkv, b, attention, attention_dropout)
            y = drop(low.add(f"{i}.o", ctx, product(ctx, wo, f"{i}.o")))
            x = norm(y + x, layer.g1, f"{i}.ln1", layer.eps1)
            y = self.act(low.add(f"{i}.i", x, product(x, wi, f"{i}.i")))
            if f"{i}.si" in banks:  # (IA)^3: the intermediate scaled per row
                y = y * bias(f"{i}.si").to(y.dtype)
            y = drop(low.add(f"{i}.f", y, product(y, wf, f"{i}.f")))
            if i == len(self.layers) - 1:  # the output: normalised, its beta added, pooled and headed in float32
                y, x = y.float(), x.float()
            x = norm(y + x, layer.g2, f"{i}.ln2", layer.eps2)
        if "out" in banks:
            x = x + bias("out")
        return x

    def product_weights(self, dtype: torch.dtype) -> list[ProductWeights]:
        """Every layer's four product weights (qkv, attention output, intermediate, output) in ``dtype``: copied once
        and kept, since they are frozen (a trainer's bfloat16 products on the CPU: 2 bytes a weight more)."""
        if dtype not in self._product_weights:
            self._product_weights[dtype] = [
                (la.wqkv.to(dtype), la.wo.to(dtype), la.wi.to(dtype), la.wf.to(dtype)) for la in self.layers
            ]
        return self._product_weights[dtype]

    def _attend(self, qkv: torch.Tensor, b: PackedBatch, attention: str, dropout_p: float = 0.0) -> torch.Tensor:
        n, nh, d = qkv.shape[0], self.n_heads, self.head_dim
        if attention == "flash":
            q, k, v = qkv.view(n, 3, nh, d).unbind(1)
            out = torch.ops.aten._flash_attention_forward(
                q, k, v, b.cu, b.cu, b.max_len, b.max_len, dropout_p, False, False, scale=1.0 / math.sqrt(d)
            )[0]
            return out.reshape(n, self.hidden)
        if b.groups is not None:  # a batch on the CPU: rows grouped by length, dropout ``dropout()``'s
            return grouped_attention(qkv, b.groups, dropout_p)
        # exact path: pad only the attention, [R, heads, T, d], keys masked per row
        assert b.pidx is not None and b.key_mask is not None
        r, t = b.key_mask.shape[0], b.key_mask.shape[-1]
        padded = qkv.new_zeros(r * t, 3 * self.hidden).index_copy_(0, b.pidx, qkv)
        q, k, v = padded.view(r, t, 3, nh, d).permute(2, 0, 3, 1, 4).unbind(0)  # each [R, heads, T, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=b.key_mask, dropout_p=dropout_p)
        return out.transpose(1, 2).reshape(r * t, self.hidden).index_select(0, b.pidx)

    def pool(
        self,
        x: torch.Tensor,
        b: PackedBatch,
        heads: HeadBank | Heads,
        banks: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``[R, H + C]``: each row's pooled vector (its own pooling mode) and its head's logits (zero-padded).
        ``banks`` as in ``encode``; without a ``pooler`` bank no row is pooled by the pooler."""
        banks = self.banks if banks is None else banks
        r = b.row_slot.shape[0]
        # padding tokens (seg == R) may hold anything, NaN included (flash attention never writes them): zero them,
        # since 0 * NaN would reach every row through the pooling product
        x = torch.where((b.seg < r).unsqueeze(1), x, 0.0)
        if x.is_cuda:  # a one-hot matmul: deterministic, accumulated in float32 by the GEMM
            onehot = (b.seg.unsqueeze(0) == torch.arange(r, device=x.device, dtype=b.seg.dtype).unsqueeze(1)).to(
                x.dtype
            )
            total = onehot @ x
        else:
            total = x.new_zeros(r, self.hidden).index_add_(0, b.seg, x)
        lengths = (b.cu[1:] - b.cu[:-1]).clamp(min=1).to(x.dtype).unsqueeze(1)
        starts = b.cu[:-1].clamp(max=x.shape[0] - 1)
        cls = x.index_select(0, starts)
        mode = b.row_mode.unsqueeze(1)
        pooled = torch.where(mode == POOL_MODES["mean"], total / lengths, cls)
        if self.pooler_w is not None and "pooler" in banks:
            bias = banks["pooler"].index_select(0, b.row_slot).to(x.dtype)
            pooler = torch.tanh(torch.addmm(bias, cls, self.pooler_w.t().to(x.dtype)))
            pooled = torch.where(mode == POOL_MODES["pooler"], pooler, pooled)
        w = heads.weight.index_select(0, b.row_slot).to(x.dtype)  # [R, C, H]
        hb = heads.bias.index_select(0, b.row_slot).to(x.dtype)  # [R, C]
        logits = torch.baddbmm(hb.unsqueeze(2), w, pooled.unsqueeze(2)).squeeze(2)
        return torch.cat([pooled, logits], dim=1)

    @staticmethod
    def tag(x: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, heads: HeadBank | Heads) -> torch.Tensor:
        """Per-token logits ``[M, C]`` of the tagging rows' tokens (``tokens`` index x; ``slots`` their heads)."""
        w = heads.weight.index_select(0, slots).to(x.dtype)  # [M, C, H]
        hb = heads.bias.index_select(0, slots).to(x.dtype)
        return torch.baddbmm(hb.unsqueeze(2), w, x.index_select(0, tokens).unsqueeze(2)).squeeze(2)
