"""vocab_select's argmax and top k against torch's own ops, on the inputs where they could part."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.model import vocab_select


def logits_of(seed: int, rows: int, vocab: int, ties: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    if ties:  # few distinct values: maxima repeated within and across chunks
        x = (x * 2).round()
    return x


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(0, 9), chunks=st.integers(1, 40), ties=st.booleans())
def test_argmax_is_torchs_first_maximum(seed, rows, chunks, ties):
    x = logits_of(seed, rows, chunks * vocab_select.CHUNK, ties)
    assert torch.equal(vocab_select.argmax(x), x.argmax(dim=-1))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 9), chunks=st.integers(16, 60), ties=st.booleans(),
       k=st.sampled_from([1, 4, 16]))
def test_topk_holds_k_of_the_largest_values(seed, rows, chunks, ties, k):
    x = logits_of(seed, rows, chunks * vocab_select.CHUNK, ties)
    idx = vocab_select.topk_indices(x, k)
    assert idx.shape == (rows, k)
    assert all(len(set(r.tolist())) == k for r in idx)  # k distinct positions
    # the values picked are the k largest (as a multiset), whichever of tied positions were taken
    assert torch.equal(x.gather(1, idx).sort(-1).values, x.topk(k, dim=-1).values.sort(-1).values)


def test_each_row_alone_gives_the_same_answer():
    x = logits_of(3, 8, 2374 * vocab_select.CHUNK, ties=True)
    together = vocab_select.topk_indices(x, 16), vocab_select.argmax(x)
    alone = [(vocab_select.topk_indices(x[i : i + 1], 16), vocab_select.argmax(x[i : i + 1])) for i in range(8)]
    assert torch.equal(together[0], torch.cat([a[0] for a in alone]))
    assert torch.equal(together[1], torch.cat([a[1] for a in alone]))


@pytest.mark.parametrize("vocab", [100, 64 * 20 + 5])
def test_nan_rows_and_ragged_vocabularies_take_torchs_ops(vocab):
    x = logits_of(0, 3, vocab, ties=False)
    x[1, 7] = float("nan")
    x[2] = float("-inf")
    assert torch.equal(vocab_select.argmax(x), x.argmax(dim=-1))
    assert torch.equal(vocab_select.topk_indices(x, 4), x.topk(4, dim=-1).indices)
    y = logits_of(1, 3, 64 * 20, ties=False)
    y[0, 100] = float("nan")
    y[2] = float("-inf")
    assert torch.equal(vocab_select.argmax(y), y.argmax(dim=-1))
    assert torch.equal(vocab_select.topk_indices(y, 4), y.topk(4, dim=-1).indices)
