"""The architectures tokenloom runs: a small registry keyed by the GGUF file's `general.architecture`
and by the `architectures` names of a Hugging Face config.json. Each one is a file that turns its
metadata into the neutral `ModelConfig` and says how its checkpoints name and store the weights; the
layers themselves are shared (model/decoder.py). A name not here is refused, never run as another."""

from __future__ import annotations

from . import gemma3, llama, phi3, qwen2, qwen3
from .base import Architecture, GGUFMetadata

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (llama.ARCH, qwen2.ARCH, qwen3.ARCH, gemma3.ARCH, phi3.ARCH)}


def for_gguf(name: str | None, path: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"{path}: unsupported architecture {name!r}; tokenloom runs {tuple(ARCHITECTURES)}") from None


def for_hf_config(hf: dict, path: str) -> Architecture:
    names = list(hf.get("architectures") or [])
    for arch in ARCHITECTURES.values():
        if any(n in arch.hf_names for n in names) or (not names and hf.get("model_type") == arch.name):
            return arch
    known = [n for a in ARCHITECTURES.values() for n in a.hf_names]
    raise ValueError(f"{path}: unsupported architectures {names or hf.get('model_type')!r} in config.json; "
                     f"tokenloom runs {known}")


__all__ = ["ARCHITECTURES", "Architecture", "GGUFMetadata", "for_gguf", "for_hf_config"]
