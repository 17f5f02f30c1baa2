"""Each row's argmax and top k over a vocabulary, through the maxima of 64-wide chunks.

torch's `argmax` and `topk` walk a row element by element: on 32 rows of Qwen2.5's 151,936 logits they
take 1.4 and 1.9 ms of a 71 ms decode step, where `amax` over the same numbers takes 0.2. Both here take
the vectorized chunk maxima first and then look only inside the chunks that can hold the answer:
- the argmax is in the first chunk whose maximum is the row's maximum;
- each of the row's k largest values lies in a chunk whose maximum is at least the k-th largest, and at
  most k chunks are such (ties aside: then any k of them hold k values as large), so the k chunks with
  the largest maxima hold a top k.
Each row's result depends on that row alone (batch invariance). Logits holding a NaN, or a vocabulary
that is not whole chunks, go to torch's own ops.
"""

from __future__ import annotations

import torch

CHUNK = 64


def _chunked(logits: torch.Tensor, k: int = 1) -> torch.Tensor | None:
    """logits [rows, V] as [rows, V / CHUNK, CHUNK], or None where the fast path does not apply."""
    if (logits.dim() != 2 or logits.shape[0] == 0 or logits.shape[1] % CHUNK or logits.shape[1] < k * CHUNK
            or not logits.is_contiguous()):
        return None
    return logits.view(logits.shape[0], -1, CHUNK)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, the first one on a tie: `logits.argmax(-1)`'s result."""
    chunks = _chunked(logits)
    if chunks is None:
        return logits.argmax(dim=-1)
    chunk_max = chunks.amax(-1)
    best = chunk_max.amax(-1, keepdim=True)
    if best.isnan().any():  # argmax takes a NaN as the largest value; the comparisons below would not
        return logits.argmax(dim=-1)
    first = (chunk_max == best).byte().argmax(-1)  # the first chunk holding the row's maximum
    inside = chunks[torch.arange(logits.shape[0]), first]  # [rows, CHUNK]
    return first * CHUNK + (inside == best).byte().argmax(-1)


def topk_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, k] indices of k of each row's largest values (in no promised order): a top k as
    `logits.topk(k).indices` holds, the same set where no value ties the k-th."""
    chunks = _chunked(logits, k)
    if chunks is None:
        return logits.topk(k, dim=-1).indices
    chunk_max = chunks.amax(-1)
    if chunk_max.isnan().any():  # topk takes a NaN as the largest value (amax keeps it: one check)
        return logits.topk(k, dim=-1).indices
    rows = logits.shape[0]
    top_chunks = chunk_max.topk(k, dim=-1).indices  # [rows, k]
    candidates = chunks[torch.arange(rows)[:, None], top_chunks].reshape(rows, k * CHUNK)
    picked = candidates.topk(k, dim=-1).indices
    return top_chunks.gather(1, picked // CHUNK) * CHUNK + picked % CHUNK
