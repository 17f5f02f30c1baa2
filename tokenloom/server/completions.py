"""POST /v1/completions: prompts in, text (or an SSE stream of text deltas) out.

Each prompt is one engine request with `n` choices; choice index = prompt index * n + choice.
With `echo`, a choice's first part starts with the prompt (and, with logprobs, the prompt's).
"""

from __future__ import annotations

from ..outputs import RequestOutput
from . import convert
from .generation import GenerationView
from .streams import ChoiceDelta


class _CompletionView(GenerationView):
    id_prefix = "cmpl"
    object = chunk_object = "text_completion"

    def __init__(self, *args):
        super().__init__(*args)
        self.prompts: list = []
        self.lps: dict[int, convert.CompletionLogprobs] = {}  # per choice: its text offsets run on
        self.sent_chars: dict[int, int] = {}  # per choice: characters of text sent so far
        self.skip_special_tokens = True

    async def engine_inputs(self):
        params = convert.completion_params(self.req)
        self.skip_special_tokens = params.skip_special_tokens
        self.prompts = convert.completion_prompts(self.req.prompt, params.n)
        ids = []
        for prompt in self.prompts:
            ids.append(await self.state.encode(prompt, "prompt") if isinstance(prompt, str) else prompt)
        return params, ids

    def _prompt_text(self, p: int, out: RequestOutput) -> str:
        prompt = self.prompts[p]
        return prompt if isinstance(prompt, str) else self.tok.decode(out.prompt_token_ids, False)

    def render(self, d: ChoiceDelta, streaming: bool) -> dict:
        text, logprobs = d.text, None
        if d.first:
            lp = self.lps[d.index] = convert.CompletionLogprobs(self.tok, self.skip_special_tokens)
            if self.req.echo:
                prompt_text = self._prompt_text(d.prompt_index, d.out)
                text = prompt_text + text
                if d.out.prompt_logprobs is not None:
                    logprobs = lp.part(d.out.prompt_token_ids, d.out.prompt_logprobs, prompt=True)
                lp.offset = len(prompt_text)  # the generated text's offsets start after the echoed prompt
        if d.logprobs is not None:
            logprobs = convert.merge_logprob_parts(logprobs, self.lps[d.index].part(d.token_ids, d.logprobs))
        sent = self.sent_chars[d.index] = self.sent_chars.get(d.index, 0) + len(text)
        if d.choice.finish_reason is not None:
            logprobs = convert.clamp_offsets(logprobs, sent)
        return {"text": text, "logprobs": logprobs}


CompletionView = _CompletionView
create_completion = _CompletionView.create
