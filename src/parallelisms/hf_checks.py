"""A Hugging Face ``model.safetensors`` against its ``config.json``, checked before launch from the file's header
(read without the tensors): every tensor the config implies, in the implied shape and a floating-point dtype,
and nothing else except the tensors ``transformers`` also drops (a tied ``lm_head.weight``, old rotary
``inv_freq`` buffers); a checkpoint with more layers than ``num_hidden_layers`` says so.
"""

from __future__ import annotations

import re
from pathlib import Path

from parallelisms.errors import ConfigError, require

# tensors transformers itself drops on load: old checkpoints' rotary buffers
_DROPPED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_FLOATS = {"F64", "F32", "F16", "BF16"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_FUSED = re.compile(r"model\.layers\.\d+\.mlp\.(experts\.(gate_up_proj|down_proj)|gate\.weight)")


def _unfused(header: dict, cfg, where: str) -> dict:
    """``header`` with transformers 5's fused Mixtral experts under the per-expert names they are read as
    (:func:`parallelisms.hf_weights.unfuse_experts`, run on meta tensors of the header's shapes)."""
    import torch

    from parallelisms.hf_weights import unfuse_experts

    fused = {n: torch.empty(shape, device="meta") for n, (_, shape) in header.items() if _FUSED.fullmatch(n)}
    if not fused or not cfg.n_experts:
        return header
    dtype = {_LAYER.match(n).group(1): header[n][0] for n in fused}  # a layer's experts: one dtype
    out = {n: v for n, v in header.items() if n not in fused}
    for name, t in unfuse_experts(fused, cfg, where).items():
        out[name] = (dtype[_LAYER.match(name).group(1)], tuple(t.shape))
    return out


def expected_shapes(cfg) -> dict[str, tuple]:
    """Hugging Face name -> the shape ``cfg`` implies, for every tensor of its model."""
    from parallelisms.hf_weights import to_hf
    from parallelisms.model import build_model

    expected = {}
    for name, param in build_model(cfg, device="meta").named_parameters():
        expected.update({n: tuple(t.shape) for n, t in to_hf(name, param, cfg).items()})
    return expected


def check_hf_weights(folder, cfg) -> None:
    """One line unless ``folder``'s ``model.safetensors`` holds, by its header, exactly the tensors ``cfg``
    implies, in their shapes and a floating-point dtype (module docstring)."""
    from safetensors import SafetensorError, safe_open

    path = Path(folder) / "model.safetensors"
    where = f"--init-from {str(path)!r}"
    try:
        with safe_open(str(path), "pt") as f:
            header = {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape())) for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"{where} cannot be read as safetensors ({str(exc).splitlines()[0][:120]})") from None
    header = _unfused(header, cfg, where)
    expected = expected_shapes(cfg)
    if cfg.tie_embeddings or "lm_head.weight" not in header:  # the head is the embedding (hf.load_hf)
        header.pop("lm_head.weight", None)
        expected = {n: s for n, s in expected.items() if n != "lm_head.weight"}
    extra = sorted(n for n in header if n not in expected and not _DROPPED.fullmatch(n))
    layers = {int(m.group(1)) for n in extra if (m := _LAYER.match(n))}
    require(not layers or max(layers) < cfg.n_layers,
            lambda: f"{where} holds {max(layers) + 1} layers but its config.json has num_hidden_layers "
                    f"{cfg.n_layers}; set num_hidden_layers to {max(layers) + 1}, or drop the extra layers' tensors")
    require(not extra, lambda: f"{where} holds {len(extra)} tensor(s) its config.json ({cfg.hf_model_type}) does not "
                               f"use: {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}; remove them or fix "
                               f"the config")
    missing = [n for n in expected if n not in header]
    require(not missing, lambda: f"{where} lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; its "
                                 f"config.json ({cfg.hf_model_type}) implies them")
    wrong = next((n for n, shape in expected.items() if header[n][1] != shape), None)
    require(wrong is None, lambda: f"{where}: {wrong} has shape {header[wrong][1]}, its config.json implies "
                                   f"{expected[wrong]}")
    odd = next((n for n, (dtype, _) in header.items() if n in expected and dtype not in _FLOATS), None)
    require(odd is None, lambda: f"{where}: {odd} is {header[odd][0]}, not floating point; weights must be F32, F16, "
                                 f"BF16 or F64")
