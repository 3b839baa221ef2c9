"""The trainer's packed model: K training runs of one task over one frozen encoder, in one padding-free batch.

Each run owns its trained values and its head: row ``r`` of this module's three parameters, one flat bank ``[K, V]``
of every run's trained biases (and scales) and the heads ``[K, C, H]`` and ``[K, C]``, so an optimizer, clipping or a
checkpoint treats all K runs in a handful of tensor ops. The encoder's weights are the frozen shared ones, read
through a ``PackedBert`` and never copied. A batch of right-padded rows, each tagged with its run, is packed (padding
never reaches a matrix product), the runs' bias banks are folded from the flat bank's columns at every forward
(``PackedBert.bank_columns`` is differentiable: a few small products), and the forward is the serving engine's. Its
backward therefore gives every run exactly the gradients the plain padded model (``patchserve.patches.model.TaskModel``)
gives it alone (``tests/test_packed_training.py`` checks logits and gradients in float32), and ``task_model(run)``
turns a run back into a plain TaskModel for patch extraction and evaluation.

On a CUDA device that runs flash attention in bfloat16 (compute capability 8.0 on), a model built with
``half_dtype=torch.bfloat16`` (``training_dtype``: the trainer's default there) encodes under bfloat16 autocast with
variable-length flash attention over the packed rows and its backward, as the serving engine attends; the frozen
weights, the trained values, the optimizer's state, pooling and the heads stay float32. On a CPU that multiplies
bfloat16 in hardware (the default there too) only the frozen weights' products run in bfloat16, against copies of
the weights made once, since elementwise bfloat16 ops are slower than float32 ones on a CPU: everything else stays
float32, attention on the exact path. Elsewhere (and with ``precision="float32"``) the model is float32 throughout,
with the exact attention, which the gradient tests check.

Several models built over one ``training_bert`` (several jobs on one base, as ``patchserve worker --concurrent-jobs``
trains them) put their rows through one packed encode: ``joint_forward`` stacks their bias banks, and each model's
heads then read only its own rows.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import logging
import math
import time
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from patchserve.patches.bitfit import apply_values
from patchserve.patches.format import LORA_A, LORA_B
from patchserve.patches.lora import LoraSpec, factor_pairs, lora_shapes
from patchserve.patches.model import TaskModel
from patchserve.patches.packed import POOL_MODES, Heads, PackedBatch, PackedBert
from patchserve.patches.packed_layout import exact_attention, to_device
from patchserve.patches.packed_lora import LoraFactors, module_factors

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "float32")  # patches.train_config.TrainConfig.precision


def cpu_has_bfloat16() -> bool:
    """Whether this CPU has bfloat16 matrix instructions (AVX512-BF16 or AMX); without them torch emulates bfloat16
    products, slower than float32 ones. Having them is not enough to train in it: ``cpu_bfloat16_is_faster``."""
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(probe is not None and bool(probe()) for probe in probes)


#: bfloat16 products are taken where they measure at most this share of float32's time: they are about half of an
#: update, and casting their inputs and outputs costs the rest of the gain below it
FASTER = 0.75


@functools.cache
def cpu_bfloat16_is_faster() -> bool:
    """Whether this CPU's bfloat16 products beat its float32 ones, measured once a process (about 0.1 s): a product
    of a packed batch's shape (256 tokens, hidden 384, intermediate 1,536), its input cast as ``half_product`` casts
    it, 5 timings each way interleaved, fastest against fastest. The instructions alone do not say it: a bfloat16
    product took 0.37-0.5x float32's time on a 2-core AMD EPYC with AVX512-BF16 and 0.12-0.4x on an Intel Xeon with
    AMX, but 1.4-1.8x on an Intel Xeon with AVX512-BF16 and no AMX (2 cores, 2026-12-02), where a bfloat16 update
    took 1.17x the float32 one's."""
    if not cpu_has_bfloat16():
        return False
    x = torch.randn(256, 384)
    weights = {dtype: torch.randn(1536, 384).to(dtype) for dtype in (torch.float32, torch.bfloat16)}
    best = dict.fromkeys(weights, math.inf)
    with torch.no_grad():
        for rep in range(7):  # the first two build each kernel (oneDNN's, with AMX, per shape)
            for dtype, w in weights.items():
                start = time.perf_counter()
                torch.nn.functional.linear(x.to(dtype), w)
                if rep >= 2:
                    best[dtype] = min(best[dtype], time.perf_counter() - start)
    share = best[torch.bfloat16] / best[torch.float32]
    log.info(
        "bfloat16 products take %.2fx float32's time on this CPU: training %s",
        share,
        "takes them" if share <= FASTER else "stays float32",
    )
    return share <= FASTER


def training_dtype(device: torch.device, precision: str = "auto") -> torch.dtype | None:
    """The half-precision type a packed model trains in on ``device`` (None: float32 throughout) with
    ``precision="auto"``: bfloat16 on a CUDA device of compute capability 8.0 or later (autocast, with flash
    attention's bfloat16 kernels) and on a CPU whose bfloat16 products beat its float32 ones
    (``cpu_bfloat16_is_faster``: the frozen weights' products only); float32 on other CPUs and GPUs and with
    ``precision="float32"``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    if precision == "float32":
        return None
    if device.type == "cuda":
        usable = torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 0)
        return torch.bfloat16 if usable else None
    if device.type == "cpu" and cpu_bfloat16_is_faster():
        return torch.bfloat16
    return None


def training_bert(encoder: nn.Module) -> PackedBert:
    """A PackedBert for training over ``encoder``: LayerNorm betas and value biases are not folded, since a fold past
    a dropout is not exact (patches/packed.py). Models built over one of these (``PackedTaskModel(packed=...)``)
    share its frozen weights and can encode their rows together (``joint_forward``)."""
    return PackedBert(encoder, 1, fold_value_bias=False, fold_ln_bias=False)


class PackedTaskModel(nn.Module):
    """``forward(input_ids, attention_mask, token_type_ids=None, run=None)`` -> logits, as TaskModel's.

    ``encoder`` is a BertModel (``patchserve.patches.packed.packed_unsupported`` says which are not); ``heads`` holds
    each run's initial head (its count is the number of runs); ``trained`` names the biases (and (IA)^3 scales, for a
    ``bitfit-ia3`` patch) every run trains, initialised at the encoder's values; ``lora`` adds LoRA factors on its
    modules (a ``lora`` patch), each run's starting at ``lora_start[run]`` (B holds them unscaled: the forward and
    ``values`` scale it by the spec's alpha / rank). ``run`` gives each row's run
    (``[B]``; None: all rows are run 0). ``packed``: a ``training_bert(encoder)`` to share with other models
    (default: one of its own). ``half_dtype`` (``training_dtype``'s): on CUDA, encode under autocast to this type with
    flash attention; on the CPU, the frozen weights' products in this type, everything else in float32 with the
    exact attention; None: float32 throughout, with the exact attention."""

    def __init__(
        self,
        encoder: nn.Module,
        heads: Sequence[nn.Linear],
        kind: str,
        pooling: str,
        trained: Sequence[str],
        *,
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        packed: PackedBert | None = None,
        half_dtype: torch.dtype | None = None,
        lora: LoraSpec | None = None,
        lora_start: Sequence[dict[str, torch.Tensor]] = (),
    ) -> None:
        super().__init__()
        if not heads:
            raise ValueError("a packed task model needs at least one run (one head)")
        base = training_bert(encoder) if packed is None else packed
        if base.word.data_ptr() != cast(Any, encoder).get_input_embeddings().weight.data_ptr():
            raise ValueError("packed= must be a training_bert() of this encoder")
        unknown = sorted(set(trained) - set(base.base))
        if unknown:
            raise ValueError(f"the encoder has no biases or (IA)^3 sites {unknown[:5]}")
        if half_dtype is not None and base.device.type not in ("cuda", "cpu"):
            raise ValueError(f"half-precision training needs a CUDA device or a CPU, not {base.device}")
        self._frozen = (encoder, base)  # a tuple, not submodules: their weights are not this module's parameters
        self.half_dtype = half_dtype
        self.kind, self.pooling = kind, pooling
        self.trained = list(trained)
        self.hidden_dropout, self.attention_dropout = hidden_dropout, attention_dropout
        device = base.device
        self.lora = lora
        self.shapes = {n: tuple(base.base[n].shape) for n in self.trained}
        if lora is not None:  # the factors' columns follow the biases'
            if len(lora_start) != len(heads):
                raise ValueError("LoRA training needs each run's starting factors (lora_start)")
            shapes = lora_shapes(encoder)
            for module in lora.modules:
                out_f, in_f = shapes[module]
                self.shapes |= {module + LORA_A: (lora.rank, in_f), module + LORA_B: (out_f, lora.rank)}
        names = list(self.shapes)
        starts = list(itertools.accumulate((math.prod(self.shapes[n]) for n in names), initial=0))
        self.columns = {n: (a, b) for n, a, b in zip(names, starts, starts[1:], strict=False)}  # name -> span
        starting: Sequence[dict[str, torch.Tensor]] = lora_start if lora else [{}] * len(heads)
        rows = [  # each run's row: its starting factors, and the encoder's values
            torch.cat([start.get(n, base.base.get(n, torch.zeros(0))).to(device).flatten() for n in names])
            if names
            else torch.zeros(0, device=device)
            for start in starting
        ]
        self.bank = nn.Parameter(torch.stack(rows))  # [K, V]: run r's trained values, at the encoder's to begin with
        self.head_weight = nn.Parameter(torch.stack([h.weight.detach() for h in heads]).to(device))  # [K, C, H]
        self.head_bias = nn.Parameter(torch.stack([h.bias.detach() for h in heads]).to(device))  # [K, C]

    @property
    def encoder(self) -> nn.Module:
        return self._frozen[0]

    @property
    def packed(self) -> PackedBert:
        return self._frozen[1]

    @property
    def runs(self) -> int:
        return int(self.bank.shape[0])

    def values(self, run: int) -> dict[str, torch.Tensor]:
        """One run's trained values by name (views of its bank row; LoRA factors in their shapes, B scaled)."""
        out = {n: self.bank[run, a:b].view(self.shapes[n]) for n, (a, b) in self.columns.items()}
        if self.lora is not None:
            out |= {n: t * self.lora.scaling for n, t in out.items() if n.endswith(LORA_B)}
        return out

    def banks(self) -> dict[str, torch.Tensor]:
        """Every run's bias banks ``[K, D]``, folded from the flat bank's columns (differentiable)."""
        return self.banks_and_factors()[0]

    def banks_and_factors(self) -> tuple[dict[str, torch.Tensor], LoraFactors | None]:
        """``banks()``, and every run's LoRA factors by module (None without LoRA), from one split of the bank."""
        # one split, not a slice per name: its backward writes every column's gradient in one concatenation, where
        # a slice each would make a zero-filled bank-sized gradient per name and sum them
        widths = [b - a for a, b in self.columns.values()]
        columns = dict(zip(self.columns, self.bank.split(widths, dim=1), strict=True)) if widths else {}
        vals = self.packed.bank_columns({n: c for n, c in columns.items() if n in self.packed.base}, self.runs)
        if self.pooling != "pooler":  # no row is pooled by the pooler: skip its product
            vals.pop("pooler", None)
        if self.lora is None:
            return vals, None
        k, scaling = self.runs, self.lora.scaling
        pairs = {
            m: (a.view(k, *self.shapes[m + LORA_A]), b.view(k, *self.shapes[m + LORA_B]) * scaling)
            for m, (a, b) in factor_pairs(columns).items()
        }
        return vals, module_factors(self.packed, pairs)

    def heads(self) -> Heads:
        return Heads(self.head_weight, self.head_bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        run: torch.Tensor | None = None,
        lengths: Sequence[int] | None = None,
    ) -> torch.Tensor:
        return joint_forward([(self, input_ids, attention_mask, token_type_ids, run, lengths)])[0]

    def pack(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        run: torch.Tensor | None = None,
        lengths: Sequence[int] | None = None,
    ) -> tuple[PackedBatch, list[int]]:
        """The packed batch of right-padded rows (without the exact path's attention layout) and each row's length.

        ``lengths`` (each row's count of real tokens, known on the host: ``collate``'s) spares reading the mask
        back from the device; the layout is then made on the host and copied without waiting for the device, so a
        GPU's queue never drains between updates. ``run`` may be on the host too."""
        device = input_ids.device
        n_rows, width = input_ids.shape
        row_lengths = [int(n) for n in (attention_mask.sum(1).tolist() if lengths is None else lengths)]
        host_lengths = torch.tensor(row_lengths, dtype=torch.long)
        cu = torch.zeros(n_rows + 1, dtype=torch.long)
        cu[1:] = host_lengths.cumsum(0)
        n = int(cu[-1])
        seg = torch.repeat_interleave(torch.arange(n_rows), host_lengths)
        pos = torch.arange(n) - cu[:-1].repeat_interleave(host_lengths)
        # one copy: each token's place in the padded [B, width] grid, its position in its row, its row; then cu
        flat = to_device(torch.cat([seg * width + pos, pos, seg, cu]), device)
        grid, pos_d, seg_d, cu_d = flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n], flat[3 * n :]
        if run is None:
            run = torch.zeros(n_rows, dtype=torch.long)
        run = to_device(run.long(), device)
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        batch = PackedBatch(
            ids=input_ids.reshape(-1).index_select(0, grid),
            types=types.reshape(-1).index_select(0, grid),
            pos=pos_d,
            tok_slot=run.index_select(0, seg_d),
            seg=seg_d,
            cu=cu_d.int(),  # int32: flash attention's offsets
            row_slot=run,
            row_mode=torch.full((n_rows,), POOL_MODES[self.pooling], dtype=torch.long, device=device),
            max_len=max(row_lengths),
        )
        return batch, row_lengths

    def logits(self, x: torch.Tensor, batch: PackedBatch, banks: dict[str, torch.Tensor], width: int) -> torch.Tensor:
        """The heads over encoded tokens ``x`` of ``batch`` (this model's rows only): ``[B, C]``, or for tagging
        every token's logits back in the padded layout ``[B, width, C]``."""
        heads = self.heads()
        n_rows = batch.row_slot.shape[0]
        if self.kind == "token-classification":
            tokens = torch.arange(x.shape[0], device=x.device)
            logits = PackedBert.tag(x, tokens, batch.tok_slot, heads)
            out = logits.new_zeros(n_rows * width, logits.shape[1])
            out = out.index_copy(0, batch.seg * width + batch.pos, logits)
            return out.view(n_rows, width, -1)
        return self.packed.pool(x, batch, heads, banks)[:, self.packed.hidden :]

    def joint_key(self) -> tuple[Any, ...]:
        """Models with equal keys encode their rows together (``joint_forward``): the same frozen weights, dropout
        rates, mode and precision, and alike in training (IA)^3 scales or not (their banks have the same keys)."""
        scales = not self.packed.scale_names.isdisjoint(self.trained)
        key = id(self.packed), self.hidden_dropout, self.attention_dropout, self.training, scales, self.half_dtype
        return (*key, self.lora)

    @torch.no_grad()
    def task_model(self, run: int) -> TaskModel:
        """Run ``run`` as a plain TaskModel: a copy of the encoder with the run's biases, and its head (eval mode)."""
        encoder = copy.deepcopy(self.encoder)
        apply_values(encoder, {n: v.detach() for n, v in self.values(run).items()})
        weight = self.head_weight[run]
        head = nn.Linear(weight.shape[1], weight.shape[0]).to(weight.device)
        head.weight.copy_(weight)
        head.bias.copy_(self.head_bias[run])
        return TaskModel(encoder, head, self.kind, self.pooling).eval()


# (model, input_ids, attention_mask, token_type_ids, run[, lengths]): PackedTaskModel.forward's arguments
Part = (
    tuple[PackedTaskModel, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
    | tuple[PackedTaskModel, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, Sequence[int] | None]
)


def joint_forward(parts: Sequence[Part]) -> list[torch.Tensor]:
    """Logits of several packed task models (several jobs' runs) whose rows go through one packed encode.

    Each part is ``(model, input_ids, attention_mask, token_type_ids, run[, lengths])`` as
    ``PackedTaskModel.forward`` takes them; every model must have the same ``joint_key()`` (one ``PackedBert``: the
    same frozen weights). The models' bias banks are stacked, each model's run indices shifted past the runs of the
    models before it, so every row meets exactly its own run's biases: the result, and its gradients, are each
    model's own forward's (the dropout masks aside, which are drawn for the joint stream). Each model's heads then run
    on its own rows' tokens."""
    if not parts:
        return []
    first = parts[0][0]
    if any(model.joint_key() != first.joint_key() for model, *_ in parts):
        raise ValueError("joint_forward needs models over one PackedBert, at one dropout and mode")
    packed_bert = first.packed
    packs = [part[0].pack(*part[1:]) for part in parts]
    all_banks, all_lora = zip(*(model.banks_and_factors() for model, *_ in parts), strict=True)
    lora = all_lora[0]
    if len(parts) == 1:
        joint, lengths = packs[0]
        banks = all_banks[0]
    else:  # one batch: each model's run slots, rows and tokens shifted past those of the models before it
        batches = [b for b, _ in packs]
        lengths = [n for _, row_lengths in packs for n in row_lengths]
        slot_off = list(itertools.accumulate((model.runs for model, *_ in parts[:-1]), initial=0))
        row_off = list(itertools.accumulate((len(n) for _, n in packs[:-1]), initial=0))
        tok_off = list(itertools.accumulate((sum(n) for _, n in packs[:-1]), initial=0))
        joint = PackedBatch(
            ids=torch.cat([b.ids for b in batches]),
            types=torch.cat([b.types for b in batches]),
            pos=torch.cat([b.pos for b in batches]),
            tok_slot=torch.cat([b.tok_slot + o for b, o in zip(batches, slot_off, strict=True)]),
            seg=torch.cat([b.seg + o for b, o in zip(batches, row_off, strict=True)]),
            cu=torch.cat([batches[0].cu[:1], *(b.cu[1:] + o for b, o in zip(batches, tok_off, strict=True))]),
            row_slot=torch.cat([b.row_slot + o for b, o in zip(batches, slot_off, strict=True)]),
            row_mode=torch.cat([b.row_mode for b in batches]),
            max_len=max(b.max_len for b in batches),
        )
        # the encoder's banks only (the pooler's is each model's own, used by its pooling below)
        banks = {k: torch.cat([b[k] for b in all_banks]) for k in all_banks[0] if k != "pooler"}
        if lora is not None:  # (equal joint keys: every model has the same LoRA modules)
            lora = LoraFactors(
                a={k: torch.cat([f.a[k] for f in all_lora if f is not None]) for k in lora.a},
                b={k: torch.cat([f.b[k] for f in all_lora if f is not None]) for k in lora.b},
            )
    # on CUDA the encoder runs under autocast with flash attention (pooling and the heads below stay float32, as
    # encode's output is); on the CPU only the frozen weights' products take the half type, attention stays exact
    flash = first.half_dtype is not None and joint.ids.is_cuda
    if not flash:  # exact attention: the rows grouped by length on the CPU, padded to the longest on a GPU
        exact_attention(joint, lengths, packed_bert.n_heads)
    half = torch.autocast("cuda", dtype=first.half_dtype) if flash else contextlib.nullcontext()
    with half:
        x = packed_bert.encode(
            joint,
            "flash" if flash else "exact",
            banks=banks,
            hidden_dropout=first.hidden_dropout if first.training else 0.0,
            attention_dropout=first.attention_dropout if first.training else 0.0,
            # a GPU launches a handful of kernels a layer instead of two a bank; on the CPU, where launches cost
            # nothing, the layer's concatenated gradient was an extra copy (3 runs: 1.07x the time, 2 CPU cores)
            gather_by_layer=joint.ids.is_cuda,
            lora=lora,
            matmul_dtype=None if flash else first.half_dtype,
        )
    out, start = [], 0
    for (model, ids, *_), (b, row_lengths), model_banks in zip(parts, packs, all_banks, strict=True):
        n = sum(row_lengths)
        out.append(model.logits(x[start : start + n], b, model_banks, ids.shape[1]))
        start += n
    return out
