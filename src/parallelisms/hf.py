"""Hugging Face checkpoints in and out: ``config.json`` + ``model.safetensors`` with the parameter names of
``transformers``' ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` or
``MixtralForCausalLM`` (:mod:`parallelisms.hf_arch` says which features each has).

The plain model is their architecture, so the mapping is a renaming (:mod:`parallelisms.hf_weights`), except for
the rotary positions: this model rotates adjacent pairs (x[2i], x[2i+1]) as Meta's reference code does (Su et al.
2021), while Hugging Face rotates the first half of each head against the second, so the rows of the query and key
projections (and their biases and per-head norms) are permuted, and the exported model computes the same logits in
``transformers``. An export writes the architecture it read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from parallelisms.config import ModelConfig, load_hf_config
from parallelisms.errors import ConfigError, require
from parallelisms.hf_arch import hf_architecture_config
from parallelisms.hf_checks import check_hf_weights
from parallelisms.hf_weights import check_exportable, from_hf, to_hf, unfuse_experts

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"

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
    """The config.json for ``cfg`` whose weights are stored in ``dtype`` (``torch_dtype``, and ``dtype`` as
    transformers 5 names it): its architecture (model_type, biases, head_dim, rope, window, experts, tying)."""
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu", "tie_word_embeddings": cfg.tie_embeddings,
            "mlp_bias": False, "torch_dtype": dtype, "dtype": dtype, **hf_architecture_config(cfg)}


def export_hf(model_state_dict: dict[str, torch.Tensor], model_config: ModelConfig, out_dir: str | Path,
              dtype: torch.dtype = torch.float32) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (Hugging Face names, in ``dtype``) of the full state dict
    ``model_state_dict`` (our parameter names) into ``out_dir``; returns the directory. A tied model
    (``tie_embeddings``) is written tied: ``tie_word_embeddings`` true and no ``lm_head.weight``."""
    from safetensors.torch import save_file

    check_exportable(model_config)
    require(model_config.mlp == "swiglu", "exporting a GELU-MLP model to Hugging Face is not implemented; export a "
                                          "SwiGLU (Llama) model")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in model_state_dict.items():
        if model_config.tie_embeddings and name == "output.weight":  # the embedding's copy
            continue
        tensors.update(to_hf(name, tensor.detach().to("cpu", dtype), model_config))
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(hf_config(model_config, str(dtype).removeprefix("torch.")), indent=2)
                                   + "\n")
    return out


def load_hf_model_config(hf_dir: str | Path) -> ModelConfig:
    """The model of a Hugging Face directory (one line if it is not an architecture this model computes)."""
    folder = Path(hf_dir)
    require(folder.is_dir(), f"--init-from {str(folder)!r} is not a directory; pass a Hugging Face model directory "
                             f"(config.json + model.safetensors)")
    require((folder / WEIGHTS_FILE).is_file(), f"--init-from {str(folder)!r} has no {WEIGHTS_FILE}; pass a directory "
                                               f"with config.json and model.safetensors")
    cfg = load_hf_config(folder / CONFIG_FILE)
    require(cfg.mlp == "swiglu", f"--init-from {str(hf_dir)!r} has hidden_act 'gelu' (a GELU MLP); only SwiGLU "
                                 f"checkpoints are read")
    check_hf_weights(folder, cfg)  # the header: every tensor the config implies, nothing else, floating point
    return cfg


def load_hf(hf_dir: str | Path, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model config and the full state dict, by our parameter names, of a Hugging Face directory.
    A tied head (``tie_word_embeddings``) is the embedding (a ``lm_head.weight`` in the file is ignored, as
    ``transformers`` ties it), returned under both names; training keeps it one weight
    (:mod:`parallelisms.parallel.tied`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg = load_hf_model_config(hf_dir)
    path = Path(hf_dir) / WEIGHTS_FILE
    try:
        weights = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"--init-from {str(path)!r} cannot be read as safetensors ({exc})") from None
    weights = unfuse_experts(weights, cfg, f"--init-from {str(path)!r}")
    if (cfg.tie_embeddings or "lm_head.weight" not in weights) and "model.embed_tokens.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    from parallelisms.model import build_model

    expected = {}  # Hugging Face name -> the shape config.json implies
    for name, param in build_model(cfg, device="meta").named_parameters(remove_duplicate=False):
        expected.update({n: tuple(t.shape) for n, t in to_hf(name, param, cfg).items()})
    missing = [n for n in expected if n not in weights]
    require(not missing, f"--init-from {str(path)!r} lacks {', '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''}; its config.json ({cfg.hf_model_type}) implies them")
    wrong = next((n for n, shape in expected.items() if tuple(weights[n].shape) != shape), None)
    require(wrong is None, lambda: f"--init-from {str(path)!r}: {wrong} has shape {tuple(weights[wrong].shape)}, "
                                   f"its config.json implies {expected[wrong]}")
    names = [n for n, _ in build_model(cfg, device="meta").named_parameters(remove_duplicate=False)]
    return cfg, {name: from_hf(name, weights, cfg).to(dtype) for name in names}
