"""A checkpoint with a released model's real shapes (Qwen3-0.6B, Llama-3.2-1B) and random weights, for speed runs where the weights
themselves cannot be had: saved by transformers, converted by llama.cpp's own convert_hf_to_gguf.py and
quantized by its llama-quantize (Q4_K_M), so every server reads the same file llama.cpp itself made.

The tokenizer is Qwen2.5's (the same 151,936-token BPE as Qwen3's), taken from the catalog's
Qwen2.5-Coder-0.5B GGUF and written as tokenizer.json, which the converter reads.

    bash ../shared/tools/build_llamacpp.sh                 # once: the converter's tree and llama-quantize
    .venv/bin/pip install sentencepiece                     # the converter imports it
    .venv/bin/python benchmarks/shaped_checkpoint.py qwen3-0.6b --out /tmp/qwen3-0.6b-shaped
    MODEL_FILE=/tmp/qwen3-0.6b-shaped/model-Q4_K_M.gguf MODEL=qwen3-0.6b-shaped \\
        PEERS="llama tokenloom-int4" bash benchmarks/peers.sh
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

SHAPES = {  # the released config.json fields that set the shapes (Qwen/Qwen3-0.6B)
    "qwen3-0.6b": ("Qwen3Config", {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                                   "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                                   "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default",
                                                                                   "rope_theta": 1e6},
                                   "bos_token_id": 151643, "eos_token_id": 151645}),
    # meta-llama/Llama-3.2-1B's shapes and RoPE table; its 128,256-token vocabulary cannot be had here, so
    # the head is Qwen2.5's 151,936 rows (18% more head work, for every server alike).
    "llama-3.2-1b": ("LlamaConfig", {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 8192,
                                     "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                                     "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                                     "tie_word_embeddings": True,
                                     "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                                         "factor": 32.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192},
                                     "bos_token_id": 151643, "eos_token_id": 151645}),
}


def write_tokenizer(out: str) -> None:
    from tokenloom.model import catalog
    from tokenloom.model.tokenizer import TokenizerWrapper

    wrapper = TokenizerWrapper.from_gguf(str(catalog.pull("qwen2.5-coder-0.5b", progress=False)))
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        f.write(wrapper.tokenizer.to_str())
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>",
                   "chat_template": wrapper.chat_template, "tokenizer_class": "Qwen2Tokenizer"}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--llamacpp", default=os.path.join(tempfile.gettempdir(), "llamacpp"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import transformers

    cls, fields = SHAPES[args.shape]
    os.makedirs(args.out, exist_ok=True)
    hf = os.path.join(args.out, "hf")
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**fields)).to(torch.bfloat16)
    model.save_pretrained(hf)
    del model
    write_tokenizer(hf)
    f16 = os.path.join(args.out, "model-F16.gguf")
    env = dict(os.environ, PYTHONPATH=os.path.join(args.llamacpp, "gguf-py"))
    subprocess.run([sys.executable, os.path.join(args.llamacpp, "convert_hf_to_gguf.py"), hf, "--outfile", f16,
                    "--outtype", "f16"], check=True, env=env)
    subprocess.run([os.path.join(args.llamacpp, "build", "bin", "llama-quantize"), f16,
                    os.path.join(args.out, "model-Q4_K_M.gguf"), "Q4_K_M"], check=True)
    os.remove(f16)
    print(os.path.join(args.out, "model-Q4_K_M.gguf"))


if __name__ == "__main__":
    main()
