"""The GGUF readers against llama.cpp's own converter: each family's tiny random checkpoint of
tests/test_hf_configs.py (made and saved by transformers, Qwen2.5's tokenizer beside it) converted by
llama.cpp's convert_hf_to_gguf.py to float32, then tokenloom's float32 greedy tokens from that file
compared with transformers' from the directory (8 prompts x 32 tokens each).

    bash ../shared/tools/build_llamacpp.sh && .venv/bin/pip install sentencepiece
    .venv/bin/python scripts/check_gguf_converter.py [--llamacpp /tmp/llamacpp] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import test_hf_configs as t
from shaped_checkpoint import write_tokenizer

from tokenloom import SamplingParams
from tokenloom.engine.llm_engine import EngineConfig, LLMEngine
from tokenloom.llm import LLM
from tokenloom.model.loader import ModelSource, load_model
from tokenloom.model.tokenizer import load_tokenizer

VOCAB = 151936  # Qwen2.5's tokenizer, which the converter recognises


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llamacpp", default=os.path.join(tempfile.gettempdir(), "llamacpp"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import transformers

    results = {}
    for name, (cls, fields) in t.FAMILIES.items():
        work = Path(tempfile.mkdtemp(prefix=f"conv-{name}-"))
        config = getattr(transformers, cls)(**(t.COMMON | fields | {"vocab_size": VOCAB}))
        config._attn_implementation = "eager"
        torch.manual_seed(1234)
        model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if any(k in n for k in ("q_proj", "k_proj", "qkv_proj")):
                    p.mul_(8.0)
        model.save_pretrained(work / "hf")
        write_tokenizer(str(work / "hf"))
        gguf = work / "m.gguf"
        env = dict(os.environ, PYTHONPATH=os.path.join(args.llamacpp, "gguf-py"))
        run = subprocess.run([sys.executable, os.path.join(args.llamacpp, "convert_hf_to_gguf.py"), str(work / "hf"),
                              "--outfile", str(gguf), "--outtype", "f32"], env=env, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            results[name] = {"converted": False, "error": run.stderr.strip().splitlines()[-1]}
            print(name, results[name])
            continue
        prompts = [[p % VOCAB for p in prompt] for prompt in t.prompts()]
        expected = [t.hf_greedy(model, p, 32) for p in prompts]
        try:
            loaded = load_model(ModelSource("gguf", str(gguf)))
        except ValueError as e:
            results[name] = {"converted": True, "loaded": False, "error": str(e)}
            print(name, results[name])
            continue
        engine = LLMEngine(EngineConfig(max_model_len=1024, num_kv_blocks=64), model=loaded,
                           tokenizer=load_tokenizer(str(gguf)))
        outs = LLM(engine=engine).generate([{"prompt_token_ids": p} for p in prompts],
                                           SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        results[name] = {"converted": True, "loaded": True, "prompts_equal": sum(a == b for a, b in zip(got, expected)),
                         "prompts": len(prompts)}
        print(name, results[name], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
