"""Hugging Face Llama checkpoints in and out: ``config.json`` + ``model.safetensors`` with the parameter names
of ``transformers``' ``LlamaForCausalLM``.

The plain model is Llama's architecture, so the mapping is a renaming, except for the rotary positions: this
model rotates adjacent pairs (x[2i], x[2i+1]) as Meta's reference code does (Su et al. 2021), while Hugging Face
rotates the first half of each head against the second. Their conversion script permutes the rows of the query
and key projections for that; :func:`_to_hf_rotary` is the same permutation and :func:`_from_hf_rotary` its
inverse, so the exported model computes the same logits in ``transformers``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from parallelisms.config import ModelConfig, load_hf_config
from parallelisms.errors import ConfigError, require

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"

_LAYER_NAMES = {  # ours (under layers.{i}.) -> Hugging Face's (under model.layers.{i}.)
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w_gate.weight": "mlp.gate_proj.weight", "feed_forward.w_up.weight": "mlp.up_proj.weight",
    "feed_forward.w_down.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def hf_name(name: str) -> str:
    """Hugging Face's name of our parameter ``name``."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, index, rest = name.split(".", 2)
    return f"model.layers.{index}.{_LAYER_NAMES[rest]}"


def _to_hf_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query/key projection from interleaved pairs to half-split order, per head."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _from_hf_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rotary_heads(name: str, cfg: ModelConfig) -> int | None:
    if name.endswith("attention.wq.weight"):
        return cfg.n_heads
    if name.endswith("attention.wk.weight"):
        return cfg.n_kv_heads
    return None


EXPORT_DTYPES = ("float32", "bfloat16", "same")


def export_dtype(choice: str | None, trained, mixed_precision: str = "fp32"):
    """The dtype ``--export-dtype`` names: ``same`` is the trained parameters' dtype ``trained`` (float64 under
    ``--dtype float64``; the fp32 master weights under bf16 mixed precision); None is the natural export,
    bfloat16 for a bf16 mixed-precision run and float32 otherwise (a float64 run too, as Hugging Face
    checkpoints are at most float32)."""
    if choice == "same":
        return trained
    if choice is None:
        return torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    return getattr(torch, choice)


def hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """A ``LlamaForCausalLM`` config.json for ``cfg`` whose weights are stored in ``dtype`` (``torch_dtype``, and
    ``dtype`` as transformers 5 names it)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
            "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
            "torch_dtype": dtype, "dtype": dtype}


def export_hf(model_state_dict: dict[str, torch.Tensor], model_config: ModelConfig, out_dir: str | Path,
              dtype: torch.dtype = torch.float32) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (Hugging Face names, in ``dtype``) of the full state dict
    ``model_state_dict`` (our parameter names) into ``out_dir``; returns the directory. A tied model
    (``tie_embeddings``) is written tied: ``tie_word_embeddings`` true and no ``lm_head.weight``."""
    from safetensors.torch import save_file

    require(not model_config.n_experts, "exporting a mixture-of-experts model to Hugging Face is not implemented; "
                                        "export a dense model")
    require(model_config.mlp == "swiglu", "exporting a GELU-MLP model to Hugging Face is not implemented; export a "
                                          "SwiGLU (Llama) model")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in model_state_dict.items():
        if model_config.tie_embeddings and name == "output.weight":  # the embedding's copy
            continue
        t = tensor.detach().to("cpu", dtype)
        heads = _rotary_heads(name, model_config)
        tensors[hf_name(name)] = (t if heads is None else _to_hf_rotary(t, heads)).contiguous()
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(hf_config(model_config, str(dtype).removeprefix("torch.")), indent=2)
                                   + "\n")
    return out


def load_hf_model_config(hf_dir: str | Path) -> ModelConfig:
    """The model of a Hugging Face directory (one line if it is not a Llama-architecture checkpoint)."""
    folder = Path(hf_dir)
    require(folder.is_dir(), f"--init-from {str(folder)!r} is not a directory; pass a Hugging Face model directory "
                             f"(config.json + model.safetensors)")
    require((folder / WEIGHTS_FILE).is_file(), f"--init-from {str(folder)!r} has no {WEIGHTS_FILE}; pass a directory "
                                               f"with config.json and model.safetensors")
    return load_hf_config(folder / CONFIG_FILE)


def load_hf(hf_dir: str | Path, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model config and the full state dict, by our parameter names, of a Hugging Face Llama directory.
    A tied head (``tie_word_embeddings``) is the embedding (a ``lm_head.weight`` in the file is ignored, as
    ``transformers`` ties it); training keeps it tied (:mod:`parallelisms.parallel.tied`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg = load_hf_model_config(hf_dir)
    require(not cfg.n_experts, f"--init-from {str(hf_dir)!r} is a mixture of experts; only dense Llama checkpoints "
                               f"are read")
    require(cfg.mlp == "swiglu", f"--init-from {str(hf_dir)!r} has hidden_act 'gelu' (a GELU MLP); only SwiGLU "
                                 f"Llama checkpoints are read")
    path = Path(hf_dir) / WEIGHTS_FILE
    try:
        weights = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"--init-from {str(path)!r} cannot be read as safetensors ({exc})") from None
    if (cfg.tie_embeddings or "lm_head.weight" not in weights) and "model.embed_tokens.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    from parallelisms.model import build_model

    shapes = {n: tuple(p.shape) for n, p in build_model(cfg, device="meta").named_parameters()}
    missing = [hf_name(n) for n in shapes if hf_name(n) not in weights]
    require(not missing, f"--init-from {str(path)!r} lacks {', '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''}; a LlamaForCausalLM checkpoint has them")
    wrong = next((n for n, shape in shapes.items() if tuple(weights[hf_name(n)].shape) != shape), None)
    require(wrong is None, lambda: f"--init-from {str(path)!r}: {hf_name(wrong)} has shape "
                                   f"{tuple(weights[hf_name(wrong)].shape)}, its config.json implies {shapes[wrong]}")
    state = {}
    for name in shapes:
        t = weights[hf_name(name)].to(dtype)
        heads = _rotary_heads(name, cfg)
        state[name] = t if heads is None else _from_hf_rotary(t, heads)
    return cfg, state
