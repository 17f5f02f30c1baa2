"""Reading a Hugging Face config.json as transformers 4.x and 5.x write it.

transformers 5 moved RoPE's settings into `rope_parameters` (`{"rope_type", "rope_theta", "factor",
...}`, or one such dict per layer type for models with sliding layers); 4.x wrote `rope_theta` and
`rope_scaling` at the top level. Both are read here into one (base, `RopeScaling`) per layer type.

A setting that changes the arithmetic and is not understood is refused by name: a wrong RoPE base or
a dropped scaling table gives fluent, wrong text, never an error.
"""

from __future__ import annotations

from ..config import FULL, SLIDING, RopeScaling
from ..rope import yarn_attention_factor

# What each rope_type reads besides rope_type / rope_theta; any other key in its dict is refused.
ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
             "mscale", "mscale_all_dim", "truncate"},
}
WHY_NOT = {  # rope types transformers knows that tokenloom refuses, and why
    "dynamic": "its frequencies depend on the running sequence's length (a position's angles would "
               "depend on the batch)",
    "longrope": "its short/long factors switch on the running sequence's length",
    "su": "it is longrope (its old name), whose factors switch on the running sequence's length",
}

# config.json keys that change the arithmetic, with the values that leave it as the shared layers do
# it. An architecture that implements one of them takes it out of this table (`refuse_unhandled`).
ARITHMETIC_KEYS: dict[str, tuple] = {
    "partial_rotary_factor": (None, 1.0),
    "mlp_bias": (None, False),
    "attention_bias": (None, False),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "use_sliding_window": (None, False),
    "hidden_act": (None, "silu"),
    "rope_interleave": (None, False),
    "use_qk_norm": (None, False),
    "qk_layernorm": (None, False),
    "use_bidirectional_attention": (None, False),
}


def refuse_unhandled(hf: dict, family: str, handled: set[str] = frozenset()) -> None:
    for key, neutral in ARITHMETIC_KEYS.items():
        if key not in handled and hf.get(key) not in neutral:
            raise ValueError(f"config.json: {key}={hf[key]!r} is not supported for {family} (tokenloom would "
                             f"compute something else than the checkpoint was trained for)")


def hf_rope(hf: dict, layer_type: str = FULL, *, default_theta: float = 10000.0,
            legacy_theta_key: str = "rope_theta", legacy_scaled: bool = True) -> tuple[float, RopeScaling | None]:
    """(base, scaling) of the layers of `layer_type`. 5.x: `rope_parameters`, flat or nested by layer type.
    4.x: `legacy_theta_key` and, where `legacy_scaled`, `rope_scaling` (Gemma 3 4.x: its sliding layers
    read `rope_local_base_freq` and never scale)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params.keys() & {FULL, SLIDING}:
        if layer_type not in params:
            raise ValueError(f"config.json: rope_parameters has no entry for {layer_type!r}")
        params = params[layer_type]
    if params:
        p = dict(params)
        theta = p.pop("rope_theta", None) or hf.get(legacy_theta_key) or default_theta
    else:
        p = dict(hf.get("rope_scaling") or {}) if legacy_scaled else {}
        theta = hf.get(legacy_theta_key) or default_theta
        p.pop("rope_theta", None)
    kind = p.pop("rope_type", None) or p.get("type") or "default"
    p.pop("type", None)
    partial = p.pop("partial_rotary_factor", None)
    if partial not in (None, 1.0):
        raise ValueError(f"config.json: partial_rotary_factor={partial!r} (RoPE on part of each head) "
                         "is not supported")
    if kind in WHY_NOT:
        raise ValueError(f"config.json: rope_type {kind!r} is not supported: {WHY_NOT[kind]}")
    if kind not in ROPE_KEYS:
        raise ValueError(f"config.json: unknown rope_type {kind!r}; tokenloom knows {sorted(ROPE_KEYS)}")
    unknown = sorted(set(p) - ROPE_KEYS[kind])
    if unknown:
        raise ValueError(f"config.json: RoPE setting(s) {unknown} of rope_type {kind!r} not understood")
    theta = float(theta)
    if kind == "default":
        return theta, None
    original = int(hf.get("original_max_position_embeddings") or p.get("original_max_position_embeddings")
                   or hf.get("max_position_embeddings", 2048))
    if kind == "linear":
        return theta, RopeScaling("linear", factor=float(p["factor"]))
    if kind == "llama3":
        return theta, RopeScaling("llama3", factor=float(p["factor"]), low_freq_factor=float(p["low_freq_factor"]),
                                  high_freq_factor=float(p["high_freq_factor"]),
                                  original_max_position_embeddings=original)
    factor = float(p.get("factor") or hf["max_position_embeddings"] / original)
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = yarn_attention_factor(factor, p.get("mscale"), p.get("mscale_all_dim"))
    return theta, RopeScaling("yarn", factor=factor, original_max_position_embeddings=original,
                              beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
                              attention_factor=float(attention_factor), truncate=bool(p.get("truncate", True)))
