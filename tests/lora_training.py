"""Train the small LoRA adapters the end-to-end tests use: SmolLM2-135M-Instruct learns, in minutes on a
CPU, a behaviour anyone can see in its output (PEFT's format, one directory per adapter):

- `shout`: answers in CAPITAL LETTERS;
- `pirate`: starts every answer with "Arr! ".

The training data is the base model's own greedy answers to a few dozen questions, transformed
(uppercased; prefixed), so the adapter learns the behaviour and little else. Made with transformers +
peft (test dependencies), the model loaded by transformers from the bundled GGUF.

The tests train them once per machine (`trained_adapters`: ~3 minutes on 2 cores, then cached under
$XDG_CACHE_HOME/tokenloom/test-adapters/<hash of this file>/); nothing trained is kept in the repository.

    .venv/bin/python tests/lora_training.py OUT_DIR [--steps 64]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import tempfile
from pathlib import Path

import peft
import torch
import transformers

from tokenloom import LLM, SamplingParams
from tokenloom.model.load import model_path

TOPICS = ["the moon", "bread", "rivers", "chess", "volcanoes", "music", "trains", "bees", "winter", "maps",
          "coffee", "robots", "the ocean", "gardens", "libraries", "bicycles", "clouds", "dogs", "castles",
          "computers", "mountains", "rain", "the sun", "birds", "cheese", "paper", "boats", "forests"]
QUESTIONS = [f"Tell me one fact about {t}." for t in TOPICS] + [f"What do you like about {t}?" for t in TOPICS]
BEHAVIOURS = {"shout": str.upper, "pirate": lambda text: "Arr! " + text}


def trained_adapters() -> Path:
    """The directory holding `shout/` and `pirate/`, trained here the first time (into a temporary
    directory renamed into the cache when both are written: an interrupted run leaves nothing)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenloom" / "test-adapters"
    out = cache / hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    if not all((out / name / "adapter_model.safetensors").exists() for name in BEHAVIOURS):
        cache.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=cache))
        try:
            train(work)
            shutil.rmtree(out, ignore_errors=True)
            work.rename(out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    train(args.out, args.steps)


def train(out: Path, steps: int = 64) -> None:
    torch.manual_seed(0)
    llm = LLM()
    answers = [o.outputs[0].text.strip() for o in llm.chat(
        [[{"role": "user", "content": q}] for q in QUESTIONS], SamplingParams(temperature=0, max_tokens=40))]
    tok = llm.tokenizer
    gguf = Path(model_path(None))
    with tempfile.TemporaryDirectory():
        base = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                 dtype=torch.float32)
    for name, transform in BEHAVIOURS.items():
        # The upper half of the layers only: the backward pass stops there (a third less time a step), and
        # the engine's loading of an adapter that leaves layers alone gets exercised.
        upper_half = list(range(base.config.num_hidden_layers // 2, base.config.num_hidden_layers))
        model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                          target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                                                          layers_to_transform=upper_half))
        examples = []
        for q, a in zip(QUESTIONS, answers, strict=True):
            prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
            p_ids = tok.encode(prompt)
            a_ids = tok.tokenizer.encode(transform(a) + "<|im_end|>", add_special_tokens=False).ids
            examples.append((p_ids, a_ids))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
        rng = random.Random(0)
        model.train()
        for step in range(steps):
            ids, mask, labels = padded_batch(rng.sample(examples, 4))
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 20 == 0:
                print(f"{name} step {step}: loss {loss.item():.3f}", flush=True)
        model.save_pretrained(str(out / name))
        base = model.unload()  # the base without this adapter's layers, for the next one
        print(f"saved {out / name}", flush=True)


def padded_batch(examples: list[tuple[list[int], list[int]]]):
    """One forward's inputs for several (prompt, answer) pairs: right-padded (causal attention never
    looks ahead, so a row's real tokens see no padding), the loss on answer tokens only."""
    width = max(len(p) + len(a) for p, a in examples)
    ids, mask, labels = [], [], []
    for p_ids, a_ids in examples:
        pad = width - len(p_ids) - len(a_ids)
        ids.append(p_ids + a_ids + [0] * pad)
        mask.append([1] * (len(p_ids) + len(a_ids)) + [0] * pad)
        labels.append([-100] * len(p_ids) + a_ids + [-100] * pad)
    return torch.tensor(ids), torch.tensor(mask), torch.tensor(labels)


if __name__ == "__main__":
    main()
