"""Per-request token constraints in the form the sampler applies them, built once per request.

`allowed_token_ids` and `logit_bias` reach the sampler through `RowConstraint` as a tuple and a dict
(any caller may build one); the engine passes these subclasses instead, which carry the tensors the
sampler needs, built once and shared by the request's `n` rows for every step. Rebuilding a
1M-entry index tensor per row per step is what let one request with `n=64` stall every stream.
"""

from __future__ import annotations

import torch


class TokenSet(tuple):
    """Allowed token ids (unique, sorted) with their boolean mask over the vocabulary, made once."""

    def __new__(cls, ids, vocab_size: int):
        self = super().__new__(cls, sorted(set(ids)))
        self.mask = torch.zeros(vocab_size, dtype=torch.bool)
        self.mask[torch.tensor(self, dtype=torch.long)] = True
        return self


class TokenBias(dict):
    """Logit bias (token id -> bias) with its ids and values as tensors, made once."""

    def __init__(self, bias: dict[int, float]):
        super().__init__(bias)
        self.ids = torch.tensor(list(self), dtype=torch.long)
        self.values_ = torch.tensor(list(self.values()), dtype=torch.float32)


def allowed_mask(allowed, vocab_size: int) -> torch.Tensor:
    """bool [vocab_size]: True for the allowed ids."""
    if isinstance(allowed, TokenSet) and allowed.mask.numel() == vocab_size:
        return allowed.mask
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[torch.as_tensor(list(allowed), dtype=torch.long)] = True
    return mask


def bias_tensors(bias: dict[int, float], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(bias, TokenBias):
        return bias.ids, bias.values_.to(dtype)
    return torch.tensor(list(bias), dtype=torch.long), torch.tensor(list(bias.values()), dtype=dtype)
