"""The Hugging Face architectures this model computes exactly, and what in their ``config.json`` says how.

``transformers``' ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` and
``MixtralForCausalLM`` are one decoder with switches: q/k/v biases (Qwen2 always, Llama and Qwen3 with
``attention_bias``, which also biases the output projection), RMSNorm per query and key head before the rotary
positions (Qwen3), a head size other than hidden/heads (``head_dim``), scaled rotary frequencies
(``rope_scaling``/``rope_parameters`` of type ``linear`` or ``llama3``), a sliding attention window (Mistral;
Qwen with ``use_sliding_window``), and a mixture of experts (Mixtral: softmax router, top-k renormalised,
SwiGLU experts). :func:`architecture_fields` turns those fields into :class:`~parallelisms.config.ModelConfig`
fields, refusing in one line what would compute differently; :func:`hf_architecture_config` writes them back.
"""

from __future__ import annotations

import math

from parallelisms.errors import require, require_finite

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_SCALINGS = ("none", "linear", "llama3")
_MISTRAL_WINDOW = 4096  # MistralConfig's sliding_window when config.json leaves it out


def _whole(where: str, name: str, value, low: int) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    require(ok and value >= low, f"{where}: {name} must be an integer of at least {low}, got {value!r}")
    return int(value)


def _rope_fields(where: str, rope: dict) -> dict:
    kind = rope.get("rope_type", rope.get("type", "default"))
    what = "NTK scaling that changes with the sequence length" if kind == "dynamic" else kind
    require(kind in ROPE_TYPES, f"{where} has rope_type {kind!r}; implemented: {', '.join(ROPE_TYPES)} ({what} "
                                f"is not)")
    require(rope.get("partial_rotary_factor", 1.0) == 1.0,
            f"{where} has partial_rotary_factor {rope.get('partial_rotary_factor')!r}; only 1.0 (every dimension "
            f"rotated) is implemented")
    if kind == "default":
        return {}
    require("factor" in rope, f"{where}: rope_type {kind!r} needs a factor")
    require_finite(f"{where}: rope factor", rope["factor"], above=0)
    fields = {"rope_scaling": kind, "rope_factor": float(rope["factor"])}
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            require(key in rope, f"{where}: rope_type 'llama3' needs {key}")
        fields.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                      rope_high_freq_factor=float(rope["high_freq_factor"]),
                      rope_original_max_len=_whole(where, "original_max_position_embeddings",
                                                   rope["original_max_position_embeddings"], 1))
    return fields


def _sliding_window(raw: dict, model_type: str) -> int:
    """The attention window transformers applies to some layer (0: none)."""
    window = raw.get("sliding_window", _MISTRAL_WINDOW if model_type == "mistral" else None)
    if model_type in ("qwen2", "qwen3"):
        if not raw.get("use_sliding_window"):
            return 0
        layer_types = raw.get("layer_types")
        layers = raw.get("num_hidden_layers", 0)
        sliding = ("sliding_attention" in layer_types if isinstance(layer_types, list)
                   else raw.get("max_window_layers", layers) < layers)
        if not sliding:
            return 0
    return window or 0


def architecture_fields(path, raw: dict, rope) -> dict:
    """The ModelConfig fields of a Hugging Face ``config.json`` ``raw`` beyond the Llama shape (``rope``: its
    rope_parameters or rope_scaling); one line naming the field for anything computed differently here."""
    where = f"--config {str(path)!r}"
    model_type = raw.get("model_type", "llama")
    require(model_type in ARCHITECTURES, f"{where} has model_type {model_type!r}; supported: "
                                         f"{', '.join(ARCHITECTURES)}")
    fields = {"hf_model_type": model_type, **_rope_fields(where, rope if isinstance(rope, dict) else {})}
    require(not raw.get("mlp_bias"), f"{where} has mlp_bias true; MLP biases are not implemented")
    bias = bool(raw.get("attention_bias")) and model_type in ("llama", "qwen3")
    fields.update(qkv_bias=bias or model_type == "qwen2", out_bias=bias, qk_norm=model_type == "qwen3")
    hidden, heads = raw.get("hidden_size"), raw.get("num_attention_heads")
    if raw.get("head_dim") is not None:
        head_dim = _whole(where, "head_dim", raw["head_dim"], 2)
        derived = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None
        if derived is None or head_dim != derived or hidden % heads:
            fields["head_dim_override"] = head_dim
    window = _sliding_window(raw, model_type)
    if window:
        fields["sliding_window"] = _whole(where, "sliding_window", window, 1)
    if model_type != "mixtral":
        fields["n_experts"] = 0  # num_local_experts means nothing to the dense architectures
    else:
        require("num_local_experts" in raw, f"{where} (mixtral) lacks num_local_experts")
        require(not raw.get("router_jitter_noise"), f"{where} has router_jitter_noise "
                                                    f"{raw.get('router_jitter_noise')!r}; only 0 (no noise) is "
                                                    f"implemented")
        require(not raw.get("output_router_logits"),
                f"{where} has output_router_logits true: transformers' load-balancing loss is over the whole batch, "
                f"this runtime's per sequence (independent of how the batch is split); set it false")
        fields.update(capacity_factor=0.0, aux_loss_coef=0.0)  # every assignment kept; the loss is the LM loss
    return fields


def check_architecture(cfg) -> None:
    """One line for architecture fields of a ModelConfig that no model here computes."""
    require(isinstance(cfg.head_dim_override, int) and cfg.head_dim_override >= 0,
            f"head_dim must be a positive integer, got {cfg.head_dim_override!r}")
    require(cfg.rope_scaling in _ROPE_SCALINGS, f"unknown rope_scaling {cfg.rope_scaling!r}; choose one of "
                                                f"{', '.join(_ROPE_SCALINGS)}")
    require_finite("rope factor", cfg.rope_factor, above=0)
    if cfg.rope_scaling == "llama3":
        require(math.isfinite(cfg.rope_high_freq_factor) and cfg.rope_high_freq_factor > cfg.rope_low_freq_factor > 0,
                f"llama3 rope: high_freq_factor {cfg.rope_high_freq_factor} must exceed low_freq_factor "
                f"{cfg.rope_low_freq_factor} > 0")
    require(isinstance(cfg.sliding_window, int) and cfg.sliding_window >= 0,
            f"sliding_window must be 0 (none) or a positive integer, got {cfg.sliding_window!r}")
    require(cfg.hf_model_type in ARCHITECTURES, f"unknown Hugging Face model_type {cfg.hf_model_type!r}; choose one "
                                                f"of {', '.join(ARCHITECTURES)}")


def export_model_type(cfg) -> str:
    """The model_type an export writes: the one read, or mixtral for a preset's mixture of experts."""
    return "mixtral" if cfg.n_experts and cfg.hf_model_type == "llama" else cfg.hf_model_type


def hf_architecture_config(cfg) -> dict:
    """The config.json fields of ``cfg``'s architecture (model_type, biases, head_dim, rope, window, experts)."""
    rope = {"rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling != "none":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_len)
    kind = export_model_type(cfg)
    out = {"architectures": [ARCHITECTURES[kind]], "model_type": kind,
           "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta, "rope_parameters": rope,
           "attention_bias": cfg.out_bias, "sliding_window": cfg.sliding_window or None}
    if kind in ("qwen2", "qwen3"):
        out["use_sliding_window"] = bool(cfg.sliding_window)
    if cfg.n_experts:
        out.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k, output_router_logits=False,
                   router_jitter_noise=0.0)
    return out

