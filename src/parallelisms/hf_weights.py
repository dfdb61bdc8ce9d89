"""Hugging Face weights by our parameter names: the renaming, the rotary row order, and Mixtral's experts.

Names follow ``transformers``' Llama / Mistral / Qwen2 / Qwen3 / Mixtral checkpoints (Mixtral's experts as the
Hub and ``save_pretrained`` store them: ``block_sparse_moe.experts.{e}.w1/w2/w3``, one [out, in] matrix each,
where this model stacks them as [experts, in, out]; the fused 3-D tensors of ``transformers`` 5's module are read
too, :func:`unfuse_experts`). :func:`to_hf` and :func:`from_hf` convert one parameter.
"""

from __future__ import annotations

import torch

from parallelisms.errors import require
from parallelisms.hf_arch import export_model_type

_LAYER_NAMES = {  # ours (under layers.{i}.) -> Hugging Face's (under model.layers.{i}.)
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias", "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias", "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w_gate.weight": "mlp.gate_proj.weight", "feed_forward.w_up.weight": "mlp.up_proj.weight",
    "feed_forward.w_down.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.router.weight": "block_sparse_moe.gate.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
# Mixtral's experts as the Hub (and save_pretrained) stores them: one [out, in] matrix per expert
_EXPERT_NAMES = {"feed_forward.experts.w_gate": "w1", "feed_forward.experts.w_up": "w3",
                 "feed_forward.experts.w_down": "w2"}


def hf_name(name: str) -> str:
    """Hugging Face's name of our parameter ``name`` (an expert stack: the first expert's)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, index, rest = name.split(".", 2)
    if rest in _EXPERT_NAMES:
        return f"model.layers.{index}.block_sparse_moe.experts.0.{_EXPERT_NAMES[rest]}.weight"
    return f"model.layers.{index}.{_LAYER_NAMES[rest]}"


def hf_names(name: str, cfg) -> list[str]:
    """Every Hugging Face tensor our parameter ``name`` is made of (one, or one per expert)."""
    first = hf_name(name)
    if ".experts.0." not in first:
        return [first]
    return [first.replace(".experts.0.", f".experts.{e}.") for e in range(cfg.n_experts)]


def _rotary_heads(name: str, cfg) -> int | None:
    """Heads whose rows follow the rotary pair order: q and k projections (and biases), the per-head norms."""
    if ".attention.wq." in name:
        return cfg.n_heads
    if ".attention.wk." in name:
        return cfg.n_kv_heads
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return 1
    return None


def _to_hf_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query/key projection from interleaved pairs to half-split order, per head. This model rotates
    adjacent pairs (x[2i], x[2i+1]) as Meta's reference code does (Su et al. 2021), Hugging Face the first half
    of each head against the second; their conversion script permutes the rows so, and so do we."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def _from_hf_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, -1).transpose(1, 2).reshape(w.shape)


def to_hf(name: str, tensor: torch.Tensor, cfg) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of our parameter ``name``."""
    names = hf_names(name, cfg)
    if len(names) > 1:  # an expert stack [E, in, out] -> E matrices [out, in]
        return {n: tensor[e].t().contiguous() for e, n in enumerate(names)}
    heads = _rotary_heads(name, cfg)
    return {names[0]: (tensor if heads is None else _to_hf_rotary(tensor, heads)).contiguous()}


def from_hf(name: str, weights: dict[str, torch.Tensor], cfg) -> torch.Tensor:
    """Our parameter ``name`` from the Hugging Face tensors ``weights`` (which hold every name of :func:`hf_names`)."""
    names = hf_names(name, cfg)
    if len(names) > 1:
        return torch.stack([weights[n].t() for n in names])
    heads = _rotary_heads(name, cfg)
    return weights[names[0]] if heads is None else _from_hf_rotary(weights[names[0]], heads)


def unfuse_experts(weights: dict[str, torch.Tensor], cfg, where: str) -> dict[str, torch.Tensor]:
    """``weights`` with Mixtral's experts in the per-expert names :func:`hf_names` reads: ``transformers`` 5's
    module holds each layer's experts fused, ``mlp.experts.gate_up_proj`` [experts, 2 x ffn, hidden] (the gate's
    rows, then the up projection's) and ``mlp.experts.down_proj`` [experts, hidden, ffn], with the router as
    ``mlp.gate.weight``; a file saved from that state dict holds them so (``save_pretrained`` writes the per-expert
    names, which this reads as they are). A fused tensor of another shape is one line naming it."""
    if not cfg.n_experts:
        return weights
    out = dict(weights)
    experts, ffn, dim = cfg.n_experts, cfg.ffn_dim, cfg.dim
    for i in range(cfg.n_layers):
        fused, legacy = f"model.layers.{i}.mlp", f"model.layers.{i}.block_sparse_moe"
        shapes = {"experts.gate_up_proj": (experts, 2 * ffn, dim), "experts.down_proj": (experts, dim, ffn)}
        for key, shape in shapes.items():
            name = f"{fused}.{key}"
            require(name not in out or tuple(out[name].shape) == shape,
                    lambda: f"{where}: {name} has shape {tuple(out[name].shape)}, its config.json implies {shape}")
        if f"{fused}.experts.gate_up_proj" in out:
            gate, up = out.pop(f"{fused}.experts.gate_up_proj").split(ffn, dim=1)
            for e in range(experts):
                out[f"{legacy}.experts.{e}.w1.weight"], out[f"{legacy}.experts.{e}.w3.weight"] = gate[e], up[e]
        if f"{fused}.experts.down_proj" in out:
            for e, down in enumerate(out.pop(f"{fused}.experts.down_proj")):
                out[f"{legacy}.experts.{e}.w2.weight"] = down
        if f"{fused}.gate.weight" in out:
            out[f"{legacy}.gate.weight"] = out.pop(f"{fused}.gate.weight")
    return out


def check_exportable(cfg) -> None:
    """One line unless ``cfg``'s features are what its Hugging Face architecture computes (a mixture of experts
    built from a preset is written as Mixtral, which needs every assignment kept: no capacity limit)."""
    kind = export_model_type(cfg)
    bias = {"qwen2": (True, False), "mistral": (False, False), "mixtral": (False, False)}.get(
        kind, (cfg.qkv_bias, cfg.qkv_bias))
    require((cfg.qkv_bias, cfg.out_bias) == bias, f"a {kind} model with q/k/v bias {cfg.qkv_bias} and output bias "
                                                  f"{cfg.out_bias} has no Hugging Face architecture here")
    require(cfg.qk_norm == (kind == "qwen3"), f"q/k norm {cfg.qk_norm} on a {kind} model: only qwen3 has it")
    require(bool(cfg.n_experts) == (kind == "mixtral"), f"{'experts' if cfg.n_experts else 'no experts'} on a "
                                                        f"{kind} model: only mixtral is a mixture of experts")
    require(not cfg.capacity_factor, f"capacity_factor {cfg.capacity_factor:g} drops tokens Mixtral keeps; only a "
                                     f"mixture of experts without a capacity limit exports")

