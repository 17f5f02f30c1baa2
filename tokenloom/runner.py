"""ModelRunner (a `step.Runner`): owns the model and the KV tensors; turns a `StepPlan` into one forward.

Per step: copy swapped blocks, build the flat batch (token ids, positions, slot mapping, the slots
each sequence attends to), run the model with the LM head only on rows that sample (and on prompt
rows of requests asking for prompt logprobs), then sample under each row's constraint from the plan.
A plain greedy row (`argmax_only`) asks the head for its argmax alone, never its logits, and so do its
speculative drafts' rows, verified on those argmaxes. Decode tokens of all sequences are handled as one
group with vectorised index math; each prefill chunk is one span.
"""

from __future__ import annotations

import time
from itertools import pairwise

import numpy as np
import torch

from .model import kv_quant
from .model.decoder import DecoderModel, ForwardBatch, GroupSlots, PrefillSpan
from .model.kv_layout import KVLayout, window_start
from .model.lora import LoRABatch, LoRAStacks
from .model.sampler import Sampler, top_logprobs
from .process_memory import zeroed
from .step import Runner, StepPlan, StepResult, is_decode, samples

# A prefill chunk shorter than this runs with the decode rows through the kernel built for few rows (int4:
# it reads 4-bit weights); longer chunks go through the one built for many rows (dense bf16), whose
# weights the step then reads as well. Where the two cost the same on a 2-core AVX-512 machine.
SHORT_CHUNK = 16


def argmax_only(seq, constraints) -> bool:
    """Does the sequence's next token need its rows' argmax alone (greedy, no logprobs, penalties nor
    constraints; drafts are verified against the argmax of each of their rows)? A head that can then
    finds it without the rows' logits (DecoderModel.greedy_tokens): on a 151k vocabulary they are 600 KB
    a row."""
    p = seq.params
    return p.greedy and p.logprobs is None and not p.penalised and not any(constraints or ())


class ModelRunner(Runner):
    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, num_host_blocks: int = 0, seed: int = 0,
                 kv_dtype: torch.dtype | None = None):
        """`kv_dtype`: the KV cache's element type; None = the model's `kv_cache_dtype`, else its weights'."""
        self.model = model
        cfg = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, kv_dtype or model.kv_cache_dtype or param.dtype
        self.block_size = block_size
        # Plain greedy rows skip the logits only where the head finds their argmax without them; elsewhere
        # a step with other sampling rows would run the head twice.
        self._head_scans = model.head_scans_argmax and param.dtype == torch.float32

        self.layout = KVLayout.of(cfg)

        def cache(n: int, device) -> torch.Tensor:  # [layer slot, K/V, slot, kv head, head dim]
            shape = (self.layout.layers_per_page, 2, n * block_size, cfg.num_kv_heads,
                     kv_quant.row_elements(self.dtype, cfg.dim_per_head))  # int8: + each row's scale
            return zeroed(shape, self.dtype) if torch.device(device).type == "cpu" else torch.zeros(
                shape, dtype=self.dtype, device=device)

        self.kv_cache = cache(num_blocks, self.device)
        planes = [self.layout.place(layer)[1] for layer in range(cfg.num_layers)]
        self.layer_caches = [(self.kv_cache[p, 0], self.kv_cache[p, 1]) for p in planes]
        self.host_cache = cache(num_host_blocks, "cpu") if num_host_blocks else None
        self.sampler = Sampler(seed)
        # adapters' weights stacked per set that shares steps, in the dtype the layer ops' LoRA kernel takes
        self.lora_stacks = LoRAStacks(model.layer_ops.lora_dtype)
        self.last_forward_time = 0.0

    # -- swap ------------------------------------------------------------------------------------

    def _slots(self, block_ids, device=None) -> torch.Tensor:
        """The cache slots of whole blocks, in order (on `device`, default the cache's)."""
        ids = torch.tensor(block_ids, dtype=torch.long)
        return (ids[:, None] * self.block_size + torch.arange(self.block_size)).flatten().to(device or self.device)

    def _copy_blocks(self, pairs: list[tuple[int, int]], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks, given as (source block, destination block), between the device and host caches."""
        if pairs:
            sources, destinations = zip(*pairs, strict=True)
            dst[:, :, self._slots(destinations, dst.device)] = src[:, :, self._slots(sources, src.device)].to(dst.device)

    # -- KV handed between engines (disaggregated prefill) -------------------------------------

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks' K/V: [layer slot, K/V, len(block_ids) * block_size, kv head, head dim] (one KV
        group: a slot per layer)."""
        return self.kv_cache[:, :, self._slots(block_ids)].cpu()

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Fill the blocks with K/V that `read_blocks` gave (of an engine running the same model)."""
        expected = (*self.kv_cache.shape[:2], len(block_ids) * self.block_size, *self.kv_cache.shape[3:])
        if tuple(kv.shape) != expected or kv.dtype != self.dtype:
            raise ValueError(f"kv: a {tuple(kv.shape)} {kv.dtype} tensor does not fit {len(block_ids)} blocks of this "
                             f"cache ({expected}, {self.dtype})")
        self.kv_cache[:, :, self._slots(block_ids)] = kv.to(self.device)

    # -- one step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: StepPlan) -> list[StepResult]:
        self._copy_blocks(out.swap_out, self.kv_cache, self.host_cache)
        self._copy_blocks(out.swap_in, self.host_cache, self.kv_cache)
        if out.is_empty:
            return []
        input_ids, batch, sample_rows, prompt_rows, argmax_rows, pooled_rows = self._prepare(out)
        start = time.perf_counter()
        hidden, logits = self.model(input_ids, batch, self.layer_caches)
        for k, (q0, first, last) in pooled_rows.items():
            self._pool(out.scheduled[k][0], hidden[q0 : q0 + last - first], first, last)
        drafts = [out.scheduled[k][0].spec_token_ids for k in argmax_rows]
        flat = [r for first, d in zip(argmax_rows.values(), drafts, strict=True) for r in range(first, first + 1 + len(d))]
        tokens = self.model.greedy_tokens(hidden[flat]).tolist() if flat else []
        self.last_forward_time = time.perf_counter() - start
        results = self._sample(out, logits, sample_rows, prompt_rows)
        ends = np.cumsum([0] + [1 + len(d) for d in drafts])
        taken = self.sampler.take_argmax([tokens[a:b] for a, b in pairwise(ends)], drafts,
                                         [results[k].seq.prompt_token_ids for k in argmax_rows])
        for k, emitted in zip(argmax_rows, taken, strict=True):
            res = results[k]
            if isinstance(emitted, BaseException):  # the sampler's fault hook failed this sequence alone
                res.token_id = emitted
                continue
            res.accepted, res.token_id = emitted[:-1], emitted[-1]
            res.accepted_logprobs = [None] * len(res.accepted)
        return results

    @staticmethod
    def _pool(seq, rows: torch.Tensor, first: int, last: int) -> None:
        """Add the hidden rows of positions [first, last) to the sequence's sum; the prompt's mean is kept
        apart once the last prompt position is in (a chunk may run past it after a recompute)."""
        cut = min(max(seq.num_prompt_tokens - first, 0), last - first)
        for part, ends_prompt in ((rows[:cut], first + cut == seq.num_prompt_tokens), (rows[cut:], False)):
            if len(part):
                total = part.float().sum(dim=0)
                seq.hidden_sum = total if seq.hidden_sum is None else seq.hidden_sum + total
                if ends_prompt:
                    seq.prompt_hidden = seq.hidden_sum / seq.num_prompt_tokens
        seq.hidden_count = last

    def _prepare(self, out: StepPlan):
        bs, groups = self.block_size, range(self.layout.num_groups)
        tokens: list[int] = []
        positions: list[np.ndarray] = []
        # Per KV group (model/kv_layout.py): the slots its layers write, its decode rows' tables and its
        # prefill spans' context slots. One group unless the model has sliding-window layers.
        slots: list[list[np.ndarray]] = [[] for _ in groups]
        decode_tables: list[list[np.ndarray]] = [[] for _ in groups]
        context_slots: list[list[torch.Tensor]] = [[] for _ in groups]
        context_starts: list[list[int]] = [[] for _ in groups]
        decode_idx, decode_ctx = [], []
        # The paged C kernel also takes prompt tokens as single queries (each with its own context
        # length, i.e. the causal mask): faster than gather + SDPA at every length measured.
        per_token = self.model.decode_attention.takes_prefill_rows
        prefills: list[PrefillSpan] = []
        logits_rows: list[int] = []
        sample_rows: dict[int, int] = {}  # scheduled index -> first logits row (one more per draft)
        argmax_rows: dict[int, int] = {}  # scheduled index -> its first flat row (one more per draft), argmax alone
        prompt_rows: dict[int, tuple[int, int, int]] = {}  # scheduled index -> (logits row, position, count)
        pooled_rows: dict[int, tuple[int, int, int]] = {}  # pool_hidden: scheduled index -> (row, from, to position)
        row_lora: list = []  # per flat row: its LoRA adapter or None (padding rows: the row they repeat)
        # Decode rows first (with any static-batch padding right after them), then short prefill chunks,
        # then long ones: the model sends the first groups and the last to different kernels.
        # A row with speculative drafts is a decode with more queries: it goes with the decodes, each of
        # its queries through the paged decode attention (the same arithmetic as without drafts).
        decodes = [k for k, (s, n) in enumerate(out.scheduled) if is_decode(n) or s.spec_token_ids]
        chunks = sorted((k for k, (s, n) in enumerate(out.scheduled) if not (is_decode(n) or s.spec_token_ids)),
                        key=lambda k: out.scheduled[k][1] >= SHORT_CHUNK)
        for k in decodes + chunks:
            seq, n = out.scheduled[k]
            if k == (chunks or [None])[0] and out.num_padding and decode_idx:
                self._pad(out.num_padding, tokens, positions, slots, decode_idx, decode_tables, decode_ctx)
                row_lora.extend([row_lora[0]] * out.num_padding)
            start, ctx = seq.num_computed_tokens, seq.num_computed_tokens + n
            q0 = len(tokens)
            tokens.extend(seq.step_token_ids(start, ctx))
            row_lora.extend([seq.lora] * n)
            tables = [np.asarray(t, dtype=np.int64) for t in seq.block_tables]
            if self.layout.num_groups > 1:  # a sliding group's released entries (HOLE) read block 0, unread
                tables = [np.maximum(t, 0) for t in tables]
            pos = np.arange(start, ctx)
            positions.append(pos)
            for g in groups:
                slots[g].append(tables[g][pos // bs] * bs + pos % bs)
            if is_decode(n) or per_token or seq.spec_token_ids:
                decode_idx.extend(range(q0, q0 + n))
                for g in groups:
                    decode_tables[g].extend([tables[g]] * n)
                decode_ctx.extend(range(start + 1, ctx + 1))
            else:
                for g, window in zip(groups, self.layout.group_windows, strict=True):
                    # A sliding group's context starts where the span's first query starts reading.
                    first = window_start(start, window)
                    ctx_pos = np.arange(first, ctx)
                    context_slots[g].append(torch.from_numpy(tables[g][ctx_pos // bs] * bs + ctx_pos % bs).to(self.device))
                    context_starts[g].append(first)
                mask = None
                if start > 0:  # query i (at position start+i) sees context positions <= start+i
                    mask = torch.from_numpy(np.arange(ctx)[None, :] <= pos[:, None]).to(self.device)
                prefills.append(PrefillSpan(q0, n, context_slots[0][-1], mask, context_starts[0][-1]))
            if seq.params.pool_hidden and (last := ctx - len(seq.spec_token_ids)) > seq.hidden_count:
                # Positions pooled once only (after a recompute-preemption the rows before are not added
                # again), and drafts not at all (they may be rejected).
                first = max(start, seq.hidden_count)
                pooled_rows[k] = (q0 + first - start, first, last)
            if seq.params.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
                # The row at prompt position p predicts prompt token p+1; the last prompt position samples.
                # After a recompute-preemption, positions whose logprobs exist are not done again.
                first = max(start, len(seq.prompt_logprobs) - 1)
                last = min(ctx, seq.num_prompt_tokens - 1)
                if last > first:
                    prompt_rows[k] = (len(logits_rows), first, last - first)
                    logits_rows.extend(range(q0 + first - start, q0 + last - start))
            if samples(seq, n):
                first_row = q0 + n - 1 - len(seq.spec_token_ids)  # the last known token's row, then each draft's
                if self._head_scans and argmax_only(seq, out.constraints.get(k)):
                    argmax_rows[k] = first_row
                else:
                    sample_rows[k] = len(logits_rows)
                    logits_rows.extend(range(first_row, q0 + n))
        if not chunks and out.num_padding and decode_idx:
            self._pad(out.num_padding, tokens, positions, slots, decode_idx, decode_tables, decode_ctx)
            row_lora.extend([row_lora[0]] * out.num_padding)

        dev = self.device
        slot_mappings = [torch.from_numpy(np.concatenate(s)).to(dev) for s in slots]
        tables = [self._padded_tables(t) for t in decode_tables]
        batch = ForwardBatch(
            positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            slot_mapping=slot_mappings[0],
            num_decodes=len(decode_idx),
            decode_like_rows=sum(n for _, n in out.scheduled if n < SHORT_CHUNK) + (out.num_padding if decodes else 0),
            decode_block_tables=tables[0],
            decode_context_lens=torch.tensor(decode_ctx, dtype=torch.long, device=dev),
            block_size=bs,
            prefills=prefills,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            lora=self._lora_batch(row_lora),
            other_groups=tuple(GroupSlots(slot_mappings[g], tables[g], context_slots[g], context_starts[g])
                               for g in groups[1:]),
        )
        return (torch.tensor(tokens, dtype=torch.long, device=dev), batch, sample_rows, prompt_rows, argmax_rows,
                pooled_rows)

    def _padded_tables(self, rows: list[np.ndarray]) -> torch.Tensor:
        """[rows, longest] block tables, zero-padded."""
        tables = np.zeros((len(rows), max((len(t) for t in rows), default=0)), dtype=np.int64)
        for r, t in enumerate(rows):
            tables[r, : len(t)] = t
        return torch.from_numpy(tables).to(self.device)

    def _lora_batch(self, row_lora: list) -> LoRABatch | None:
        """The rows of each adapter in the step (padding rows take their row's, so they write the same K/V)."""
        rows: dict[int, tuple] = {}
        for r, adapter in enumerate(row_lora):
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].append(r)
        if not rows:
            return None
        groups = sorted(rows.values(), key=lambda g: g[0].name)  # one order per set: its stacks are reused
        return LoRABatch(groups, self.lora_stacks, len(row_lora), self.device)

    @staticmethod
    def _pad(pad, tokens, positions, slots, decode_idx, decode_tables, decode_ctx) -> None:
        """Padding rows repeat the first decode row: same token, position and slot, so they rewrite the
        identical K/V and change nothing, but cost what a padded slot of a static batch costs.
        `slots` and `decode_tables`: per KV group."""
        decode_idx.extend(range(len(tokens), len(tokens) + pad))
        tokens.extend([tokens[0]] * pad)
        positions.extend([positions[0]] * pad)
        for group_slots, group_tables in zip(slots, decode_tables, strict=True):
            group_slots.extend([group_slots[0]] * pad)
            group_tables.extend([group_tables[0]] * pad)
        decode_ctx.extend([decode_ctx[0]] * pad)

    def _sample(self, out, logits, sample_rows, prompt_rows) -> list[StepResult]:
        logits = logits.cpu()
        results = [StepResult(seq, n, None) for seq, n in out.scheduled]
        if sample_rows:
            sampled = [results[k].seq for k in sample_rows]
            rows = [r for k, first in sample_rows.items() for r in range(first, first + 1 + len(results[k].seq.spec_token_ids))]
            tokens, logprobs = self.sampler(
                logits if rows == list(range(len(logits))) else logits[rows],  # every row samples: no copy
                [s.params for s in sampled],
                [s.prompt_token_ids for s in sampled],
                [s.output_token_ids for s in sampled],
                [s.generator for s in sampled],
                [out.constraints.get(k) or [None] * (1 + len(s.spec_token_ids)) for k, s in zip(sample_rows, sampled, strict=True)],
                [s.spec_token_ids for s in sampled],
            )
            for k, emitted, lps in zip(sample_rows, tokens, logprobs, strict=True):
                res = results[k]
                if isinstance(emitted, BaseException):  # the sampler failed on this sequence alone
                    res.token_id = emitted
                    continue
                res.accepted, res.token_id = emitted[:-1], emitted[-1]
                res.accepted_logprobs, res.logprobs = lps[:-1], lps[-1]
        for k, (row, position, count) in prompt_rows.items():
            seq = results[k].seq
            lp = logits[row : row + count].log_softmax(dim=-1)
            targets = seq.token_ids[position + 1 : position + 1 + count]
            results[k].prompt_logprobs = [
                top_logprobs(lp[i], targets[i], seq.params.prompt_logprobs) for i in range(count)
            ]
        return results
