"""The LM head in a few bits, rescored (`RescoredHead`): int4 logits over the vocabulary (`int4_head`, on
the C kernels; int8 without them), then each row's best candidates recomputed exactly in float32: the
argmax is the float32 head's, the rest within the scan's error. A greedy row's argmax alone comes from a
scan that keeps each row's best few values and never stores its logits (`RescoredHead.argmax`, the
kernels' `int4_top`). Which head a model gets is the plan's choice (`STRATEGIES`)."""

from __future__ import annotations

import torch
from torch import nn

from .. import vocab_select
from ..gguf_tensors import StoredRows
from ..heap import trim_heap
from .gemm import QuantGemm, why_not
from .layouts import q4_1_from_dense
from .modules import Int4Linear


class RescoredHead(nn.Module):
    """The LM head in a few bits for the whole vocabulary, then each row's `top` best candidates
    recomputed exactly from the float32 weight (`weight`, shared with the embedding; `StoredRows` reads
    those rows from the file). The scan is the head's biggest read of a decode step: in int4 (on the C
    kernels: `int4_head`) it is half int8's bytes. On its own a few-bit head flips near-tie argmaxes
    on natural text (int4 more than int8); rescored, the
    argmax is the float32 head's whenever it is among the scan's top `top` (the gap it must bridge is
    the scan's rounding noise), and the other logits are the scan's, within its error."""

    def __init__(self, approx: nn.Module, weight: torch.Tensor | StoredRows, top: int = 16):
        super().__init__()
        self.approx = approx
        self.weight = weight
        self.top = top

    @property
    def format(self) -> str:
        return f"int{self.approx.bits}" if isinstance(self.approx, Int4Linear) else "int8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scan = self.approx
        logits = scan(x if getattr(scan, "kernel", None) is not None else x.to(torch.bfloat16)).float()
        idx = vocab_select.topk_indices(logits, min(self.top, logits.shape[-1]))  # [rows, top]
        return logits.scatter_(1, idx, self._exact(x, idx))

    def _exact(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The float32 logits of rows `x` at vocabulary ids `idx` [rows, n]. An elementwise product and a
        sum: each row's result is the same whatever the number of rows (and whatever the ids' order)."""
        return (self.weight[idx].float() * x.float().unsqueeze(1)).sum(-1)

    @property
    def scans(self) -> bool:
        """Does `argmax` find float32 rows' argmax without their logits (the C kernels' int4 scan)?"""
        approx = self.approx
        return (isinstance(approx, Int4Linear) and approx.kernel is not None and approx.bits == 4
                and approx.out_features >= self.top + 2)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of `forward(x)` (the first on a tie), without its [rows, vocab] logits (600 KB a
        row of a 151k vocabulary): the C kernels' `int4_top` scans the vocabulary keeping each
        row's top + 2 largest values. Those decide alone when the top-th and the next two differ: the
        candidates are then the one top set `forward` rescores, and the best other id is one too, so the
        argmax is the better of the best rescored candidate and that id's scan value. A row where they
        tie (or that met a NaN) takes `forward`'s own path, and so do rows in another dtype than float32
        (`forward` rounds their scan to it)."""
        scan, keep, k = self.approx, self.top + 2, self.top
        if not self.scans or x.dtype != torch.float32 or not x.shape[0]:
            return vocab_select.argmax(self.forward(x))
        x = x.contiguous()
        values, ids, unordered = scan.kernel.int4_top(x, scan.codes, scan.scales, scan.offsets, keep)
        best, order = values.topk(keep, dim=1)  # each thread's lists merged: [rows, top + 2], largest first
        best_ids = ids.gather(1, order)
        candidates, other, other_id = best_ids[:, :k], best[:, k], best_ids[:, k]
        # A list left short (-1: a NaN row) reads row 0; such a row ties at -inf or met a NaN: unsure below.
        exact = self._exact(x, candidates.clamp_min(0))
        top = exact.amax(1)
        first_top = torch.where(exact == top[:, None], candidates, scan.out_features).amin(1)  # argmax's tie rule
        token = torch.where(other > top, other_id,
                            torch.where(other == top, torch.minimum(first_top, other_id), first_top))
        unsure = (unordered | (best[:, k - 1] == other) | (other == best[:, k + 1]) | exact.isnan().any(1)).nonzero()
        if len(unsure):
            rows = unsure.flatten()
            token[rows] = vocab_select.argmax(self.forward(x[rows]))
        return token


def int4_head(weight: torch.Tensor | StoredRows, kernel: QuantGemm, rows: int = 2048) -> Int4Linear:
    """The head's scan as Int4Linear on the C kernels, quantized `rows` rows at a time (no float32 copy
    of a whole vocabulary), the chunks' packed buffers stacked (the kernels' layout is in blocks of 16
    rows, so `rows` is a multiple of 16 and a vocabulary the kernels take fills them). In Q4_1's codes, not symmetric
    ones (Q4_0's, a little smaller): the scan's values are the logits outside the rescored few, and
    symmetric codes raised Gemma 3's KL against float32 past what the tests allow (test_architectures)."""
    chunks = weight.chunks(rows) if isinstance(weight, StoredRows) else weight.split(rows)
    parts = []
    for chunk in chunks:
        parts.append(Int4Linear(q4_1_from_dense(chunk), torch.bfloat16, kernel=kernel))
        del chunk
        trim_heap()  # a chunk's float32 temporaries (several times its packed size) back to the OS
    head = parts[0]
    for part in parts:  # a chunk of all-zero rows reads as symmetric; the stacked head keeps every offset
        if part.offsets is None:
            part.offsets = part.scales * -8
    for name in ("codes", "scales", "offsets"):
        setattr(head, name, torch.cat([getattr(part, name) for part in parts]))
    head.out_features = sum(part.out_features for part in parts)
    return head



DENSE, INT4_RESCORED, INT8_RESCORED = "dense", "int4 rescored", "int8 rescored"


def format_of(logits_proj: nn.Module | None) -> str:
    """The name of a model's head as built (`DecoderModel.logits_proj`; None: the dense one)."""
    if isinstance(logits_proj, RescoredHead):
        return INT4_RESCORED if isinstance(logits_proj.approx, Int4Linear) else INT8_RESCORED
    return DENSE if logits_proj is None else "int8"


class RescoredStrategy:
    """A rescored head on the int4 path (the int8 path and the exact one keep the dense head): the scan
    in int4 on the C kernels when the vocabulary fills their blocks, else in int8 on torch's op."""

    def __init__(self, name: str, bits: int):
        self.name, self.bits = name, bits

    def can_implement(self, needs, cpu) -> tuple[bool, str | None]:
        if needs.exact:
            return False, needs.exact
        if needs.quantization != "int4":
            return False, f"{needs.quantization} weights keep the dense head"
        if self.bits == 4:
            if needs.before["projections"].impl is None:
                return False, "its scan runs on the C kernels, and they do not run here"
            if (reason := why_not(needs.config.vocab_size, needs.config.hidden_size)) is not None:
                return False, f"the head's {reason}"
        return True, None

    def build(self, needs, cpu) -> None:
        return None  # the loader builds the head from the weights (quantize_model)


class DenseStrategy:
    name = DENSE

    def can_implement(self, needs, cpu) -> tuple[bool, str | None]:
        return True, None

    def build(self, needs, cpu) -> None:
        return None


STRATEGIES = (RescoredStrategy(INT4_RESCORED, 4), RescoredStrategy(INT8_RESCORED, 8), DenseStrategy())
