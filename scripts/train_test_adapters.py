"""Train the small LoRA adapters the end-to-end tests use: SmolLM2-135M-Instruct learns, in minutes on a
CPU, a behaviour anyone can see in its output (tests/data/lora/<name>/, PEFT's format):

- `shout`: answers in CAPITAL LETTERS;
- `pirate`: starts every answer with "Arr! ".

The training data is the base model's own greedy answers to a few dozen questions, transformed
(uppercased; prefixed), so the adapter learns the behaviour and little else. Made with transformers +
peft (test dependencies), the model loaded by transformers from the bundled GGUF.

    .venv/bin/python scripts/train_test_adapters.py [--steps 120]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import peft
import torch
import transformers
from safetensors.torch import load_file, save_file

from tokenloom import LLM, SamplingParams
from tokenloom.model.load import model_path

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "lora"
TOPICS = ["the moon", "bread", "rivers", "chess", "volcanoes", "music", "trains", "bees", "winter", "maps",
          "coffee", "robots", "the ocean", "gardens", "libraries", "bicycles", "clouds", "dogs", "castles",
          "computers", "mountains", "rain", "the sun", "birds", "cheese", "paper", "boats", "forests"]
QUESTIONS = [f"Tell me one fact about {t}." for t in TOPICS] + [f"What do you like about {t}?" for t in TOPICS]
BEHAVIOURS = {"shout": str.upper, "pirate": lambda text: "Arr! " + text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120)
    args = ap.parse_args()
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
        model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                          target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
        examples = []
        for q, a in zip(QUESTIONS, answers, strict=True):
            prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
            p_ids = tok.encode(prompt)
            a_ids = tok.tokenizer.encode(transform(a) + "<|im_end|>", add_special_tokens=False).ids
            examples.append((p_ids, a_ids))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
        rng = random.Random(0)
        model.train()
        for step in range(args.steps):
            batch = rng.sample(examples, 4)
            loss = 0.0
            for p_ids, a_ids in batch:
                ids = torch.tensor([p_ids + a_ids])
                labels = torch.tensor([[-100] * len(p_ids) + a_ids])
                loss = loss + model(input_ids=ids, labels=labels).loss / len(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 20 == 0:
                print(f"{name} step {step}: loss {loss.item():.3f}", flush=True)
        model.save_pretrained(str(OUT / name))
        weights = OUT / name / "adapter_model.safetensors"  # kept in bfloat16: half the bytes in the repo
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(weights)).items()}, str(weights))
        base = model.unload()  # the base without this adapter's layers, for the next one
        print(f"saved {OUT / name}")


if __name__ == "__main__":
    main()
