"""Small ops of the packed model: training dropout (with a cheaper mask on the CPU), each token's row of the bias
banks (``token_biases``) and a frozen weight's product in half precision with the biases added (``half_product``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F


def keep_mask(shape: Sequence[int], keep: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """A bool tensor of ``shape`` whose elements are independently True with probability ``keep`` (to within
    2^-16: a dropout rate of 0.1 keeps 0.899994 of the elements; ``bernoulli_``'s own is quantised to 2^-31).

    Drawn from torch's generator (``torch.manual_seed`` governs it) 64 bits at a time: ``random_`` over the whole
    int64 range, read as four uniform 16-bit integers, each compared with one threshold: on the CPU cheaper than
    ``bernoulli_``, whose masks were a large share of a packed training update (docs/benchmarks/train_cost.md), and
    than two 32-bit halves a draw (0.91 against 1.55 ms for 442,000 elements on 2 cores)."""
    n = math.prod(shape)
    threshold = round(keep * 2**16) - 2**15  # int16 is uniform over [-2^15, 2^15)
    if threshold >= 2**15:  # keep rounds to 1
        return torch.ones(tuple(shape), dtype=torch.bool, device=device)
    ints = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(2**63), None).view(torch.int16)
    return (ints[:n] < threshold).view(tuple(shape))


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Training dropout at rate ``p`` (0: ``x`` itself): the same distribution as ``F.dropout``. On the CPU the mask
    is ``keep_mask``'s; elsewhere it is ``F.dropout``'s (fused on CUDA)."""
    if p <= 0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, training=True)
    keep = 1.0 - p
    return x * keep_mask(x.shape, keep, x.device).to(x.dtype).mul_(1.0 / keep)


def token_biases(
    banks: Mapping[str, torch.Tensor], slot: torch.Tensor, by_layer: bool
) -> Callable[[str], torch.Tensor]:
    """``bias(name)``: each token's row of bank ``name`` (``slot`` ``[N]`` gives the row), or the bank itself where
    it has one row (added by broadcasting). ``by_layer``: the banks of a layer are gathered together, in one
    concatenation and one gather, at the first one a layer asks for (a layer asks for its banks in turn, so each is
    gathered once), and their gradients scatter back in one op too: a handful of launches a layer instead of two
    for each bank. For a trainer's banks (a few rows each); a server's hold a row per slot, too many to concatenate
    at every batch."""
    current: dict[str, torch.Tensor] = {}

    def group(name: str) -> list[str]:  # "3.qkv" -> every bank of layer 3; "emb_ln", "out" alone
        prefix = name.split(".")[0] + "."
        return [k for k in banks if k.startswith(prefix) and k != "pooler"] if "." in name else [name]

    def bias(name: str) -> torch.Tensor:
        bank = banks[name]
        if bank.shape[0] == 1:
            return bank
        if not by_layer:  # (a trainer's bank may be a column view of its flat bank: gathered from a copy, it is
            return bank.contiguous().index_select(0, slot)  # read in rows, not element by element)
        if name not in current:
            members = group(name)
            current.clear()  # the layer before is done with its banks
            if len(members) == 1:
                current[name] = bank.index_select(0, slot)
            else:
                tokens = torch.cat([banks[k] for k in members], dim=1).index_select(0, slot)
                current.update(zip(members, tokens.split([banks[k].shape[1] for k in members], dim=1), strict=True))
        return current[name]

    return bias


#: token counts a half-precision product on the CPU is padded to a multiple of. oneDNN builds a kernel for every
#: shape it multiplies and keeps about a thousand; a trainer's batches have hundreds of token counts, times 8
#: products a layer (4 forward, 4 backward), so unpadded nearly every product built its kernel anew (2.7 ms against
#: 0.4-0.6 ms for one of [450, 1536] x [1536, 384] in bfloat16 on 2 cores with AMX). 64: an update took about
#: what it took at 128 (118 against 116 ms, one run of 400 each); the rows it adds cost less than they save.
PRODUCT_BUCKET = 64


class _HalfProduct(torch.autograd.Function):
    """``bias + x @ w.T`` with the product in ``w``'s half type over ``x`` padded to ``PRODUCT_BUCKET`` tokens, the
    sum in ``bias``'s type; backward: ``x``'s gradient from the same padded product, ``bias``'s the sum's own (summed
    over tokens where ``bias`` is one row broadcast to all). ``w`` is frozen: it gets none."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]  # x [N, in], w [out, in], bias [N or 1, out]
        xh = _padded(x, w.dtype)  # [M, in], M = N rounded up to the bucket
        ctx.save_for_backward(w)
        ctx.x_dtype, ctx.bias_rows = x.dtype, bias.shape[0]
        # cast, then add: an add that promotes bfloat16 to float32 as it goes is not vectorised on the CPU (6.2 against
        # 0.2 ms for [1728, 1536], 2 cores)
        return F.linear(xh, w)[:n].to(bias.dtype).add_(bias)  # [N, out] in bias's type

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None]:
        (w,) = ctx.saved_tensors
        n = grad.shape[0]
        gx = torch.mm(_padded(grad, w.dtype), w)[:n].to(ctx.x_dtype) if ctx.needs_input_grad[0] else None  # [N, in]
        gb = None
        if ctx.needs_input_grad[2]:
            gb = grad.sum(0, keepdim=True) if ctx.bias_rows == 1 and n != 1 else grad
        return gx, None, gb


def _padded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[N, D]`` cast to ``dtype`` in a ``[M, D]`` buffer, M = N rounded up to ``PRODUCT_BUCKET``, its extra
    rows zero (a product's row depends on its own row only: they are cut from the result)."""
    n = x.shape[0]
    out = x.new_empty((-(-n // PRODUCT_BUCKET) * PRODUCT_BUCKET, x.shape[1]), dtype=dtype)
    out[:n].copy_(x)
    out[n:].zero_()
    return out


def half_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``bias + x @ w.T`` ``[N, out]`` in ``bias``'s type, the product in ``w``'s (a half type) over ``x`` padded
    to a multiple of ``PRODUCT_BUCKET`` tokens, in its backward too: a trainer's products on a CPU that multiplies
    bfloat16 in hardware, against frozen half copies of the weights."""
    out: torch.Tensor = _HalfProduct.apply(x, w, bias)
    return out
