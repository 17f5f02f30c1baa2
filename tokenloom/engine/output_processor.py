"""Output processing: a sequence's text (incremental detokenization, where a stop string cuts it, the
tail held back while it could still become one) and the `RequestOutput` of a request.

The core calls these as it moves a sequence on; nothing here decides a sequence's state."""

from __future__ import annotations

from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..step import Sequence
from .request_state import RequestState


class OutputProcessor:
    @staticmethod
    def detokenize(state: RequestState, seq: Sequence, token: int) -> int:
        """Append the text `token` completes to the sequence's output; returns how long it was."""
        delta = state.detokenizers[seq.index].step(token)
        seq.output_text += delta
        return len(delta)

    @staticmethod
    def cut_at_stop_string(seq: Sequence, delta_len: int) -> bool:
        """Find a stop string completed by the latest text and cut the output exactly there."""
        text = seq.output_text
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(0, len(text) - delta_len - longest + 1)
        found = [(i, s) for s in seq.params.stop if (i := text.find(s, search_from)) != -1]
        if not found:
            return False
        idx, stop = min(found)
        seq.output_text = text[: idx + len(stop)] if seq.params.include_stop_str_in_output else text[:idx]
        seq.stop_reason = stop
        return True

    @staticmethod
    def visible_text(seq: Sequence) -> str:
        """While running, hold back the tail that could be the start of a stop string."""
        if seq.finished or not seq.params.stop:
            return seq.output_text
        hold = max(len(s) for s in seq.params.stop) - 1
        return seq.output_text[: len(seq.output_text) - hold] if hold else seq.output_text

    def make_output(self, state: RequestState) -> RequestOutput:
        first, times = state.seqs[0], [s.times for s in state.seqs]
        outputs = [
            CompletionOutput(s.index, self.visible_text(s), s.output_token_ids,
                             "error" if state.error is not None else s.finish_reason, s.stop_reason,
                             s.logprobs if s.params.logprobs is not None else None, state.error,
                             *pooled_hidden(s))
            for s in state.seqs
        ]
        metrics = RequestMetrics(
            arrival_time=first.times.arrival,
            first_scheduled_time=min((t.first_scheduled for t in times if t.first_scheduled), default=None),
            first_token_time=min((t.first_token for t in times if t.first_token), default=None),
            last_token_time=max((t.last_token or 0 for t in times), default=None),
            finished_time=max((t.finished or 0 for t in times), default=None) if state.finished else None,
            num_cached_tokens=first.num_cached_prompt_tokens,
            num_preemptions=sum(s.num_preemptions for s in state.seqs),
            slo=first.params.slo,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=state.finished,
            prompt_logprobs=first.prompt_logprobs if first.params.prompt_logprobs is not None else None,
            metrics=metrics,
            num_cached_tokens=first.num_cached_prompt_tokens,
            error=state.error,
        )

    @staticmethod
    def error_output(state: RequestState) -> RequestOutput:
        """A bare error output, for a failed request whose output could not be made: it still ends once."""
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                             [CompletionOutput(s.index, "", [], "error", None, None, state.error)
                              for s in state.seqs], finished=True, error=state.error)


def pooled_hidden(seq: Sequence) -> tuple[list[float] | None, list[float] | None]:
    """The mean final hidden state so far and over the prompt, for a request that asked for them
    (SamplingParams.pool_hidden)."""
    if not seq.params.pool_hidden or seq.hidden_sum is None or not seq.hidden_count:
        return None, None
    prompt = seq.prompt_hidden.tolist() if seq.prompt_hidden is not None else None
    return (seq.hidden_sum / seq.hidden_count).tolist(), prompt
