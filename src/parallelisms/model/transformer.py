"""A decoder-only transformer in plain PyTorch (Llama family), with no parallel code in it.

Token embedding, pre-norm blocks of RMSNorm, causal self-attention with rotary positions
(Su et al. 2021) and optional grouped key/value heads (Ainslie et al. 2023), a SwiGLU MLP
(Shazeer 2020), a GELU MLP (GPT-2/3) or a mixture of SwiGLU experts (model/moe.py), a final RMSNorm and an output head
(with ``tie_embeddings`` the embedding's own parameter, as ``transformers`` ties them; see
:mod:`parallelisms.parallel.tied` for the layouts).
The Hugging Face variants (Qwen2's q/k/v biases, Qwen3's per-head q/k norm and explicit head size, Llama 3.1's
scaled rotary frequencies) are switched on by the config. Parallelisms swap its modules
(`wq`, `w_up`, `output`, `loss`, `core`, ...) for parallel ones; every shape the forward needs is read
from the tensors themselves, so a module holding a shard of the heads or of the FFN width still works.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from parallelisms.config import ModelConfig
from parallelisms.model.moe import MoE
from parallelisms.model.numerics import upcast


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang and Sennrich 2019)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = upcast(x)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_frequencies(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The rotation frequency of each pair of a head, theta^(-2i/d) (Su et al. 2021), scaled as ``transformers``'
    rope types are: ``linear`` divides every frequency by the factor (Chen et al. 2023); ``llama3`` divides the
    low frequencies (wavelength beyond original_max_len / low_freq_factor) by it, keeps the high ones (below
    original_max_len / high_freq_factor) and interpolates between (Llama 3.1, Meta 2024)."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(dtype) / d)
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_scaling != "llama3":
        return inv_freq
    factor, low, high, context = (cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                                  cfg.rope_original_max_len)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, smoothed, scaled)


def rotary_tables(cfg: ModelConfig, positions: int, dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [positions, head_dim // 2] for rotary position embeddings, computed in
    ``dtype`` (float64 runs are float64 end to end)."""
    angles = torch.outer(torch.arange(positions, dtype=dtype), rotary_frequencies(cfg, dtype))
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [batch, seq, heads, head_dim] by the position angles [seq, head_dim/2]."""
    x_even, x_odd = upcast(x).unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class CausalAttentionCore(nn.Module):
    """softmax(QK^T / sqrt(d)) V under a causal mask, q/k/v as [batch, heads, seq, head_dim].

    Key/value heads shared by several query heads (GQA) are repeated here. Context parallelism
    replaces this module with ring attention; Ulysses wraps it with all-to-alls.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def rotate_queries_keys(attention: nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q and k [batch, seq, heads, head_dim] (when ``attention`` has one), then
    the rotary positions."""
    if attention.q_norm is not None:
        q, k = attention.q_norm(q), attention.k_norm(k)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class Attention(nn.Module):
    """Causal self-attention: ``n_heads`` query heads of ``head_dim`` (dim / n_heads unless the config sets
    it), optional q/k/v biases (Qwen2) and output bias, optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.q_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.q_dim, cfg.dim, bias=cfg.out_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.core = CausalAttentionCore()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = rotate_queries_keys(self, q, k, cos, sin)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP, w_down(silu(w_gate x) * w_up x), or (``cfg.mlp == "gelu"``, GPT-2/3) w_down(gelu(w_up x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False) if cfg.mlp == "swiglu" else None
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w_gate is None:
            return self.w_down(F.gelu(self.w_up(x)))
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.n_experts:
            self.feed_forward = MoE(cfg.dim, cfg.ffn_dim, cfg.n_experts, cfg.top_k, cfg.capacity_factor,
                                    cfg.router_skew)
        else:
            self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class CrossEntropy(nn.Module):
    """Mean next-token cross-entropy over all tokens; tensor parallelism swaps in a vocabulary-parallel one."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(upcast(logits.flatten(0, -2)), targets.flatten())


class Transformer(nn.Module):
    """The reference model. ``forward(tokens)`` gives logits; ``forward(tokens, targets)`` the mean loss.

    ``positions`` (default ``0..seq-1``) lets a rank holding a slice of the sequence rotate by the
    right angles. A pipeline stage is the same class holding some of the layers, with the embedding or the
    head absent (``None``) where they live on another stage (:meth:`stage`): its input is then the hidden
    states, its output the hidden states. ``layers`` is a ``ModuleDict`` keyed by the layer index, so a
    stage keeps the plain model's parameter names. ``seq_shards`` > 1 when the residual stream between
    layers holds 1/seq_shards of the sequence (tensor parallelism's sequence parallelism).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.seq_shards = 1
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # one parameter, listed once by named_parameters (as the embedding)
            self.output.weight = self.tok_embeddings.weight
        self.loss = CrossEntropy()
        self.set_rotary_dtype(torch.float32)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:  # hidden states in (a later stage) may hold a shard of the sequence
            seq = tokens.shape[1] * (1 if self.tok_embeddings is not None else self.seq_shards)
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.output is None:
            return h
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        loss = self.loss(logits, targets)
        aux = self.aux_loss_term()
        return loss if aux is None else loss + aux

    def aux_loss_term(self) -> torch.Tensor | None:
        """The load-balancing term of the last forward's loss over this model's (or stage's) layers: the
        auxiliary loss coefficient times the sum of their MoE auxiliary losses; None for a dense model. A
        pipeline stage without the head backpropagates its own term beside its output."""
        if not (self.cfg.n_experts and self.cfg.aux_loss_coef and self.layers):
            return None
        return self.cfg.aux_loss_coef * sum(layer.feed_forward.aux_loss for layer in self.layers.values())

    def set_rotary_dtype(self, dtype: torch.dtype) -> None:
        """(Re)build the rotary tables for ``cfg.max_seq_len`` positions, computed in ``dtype``."""
        cos, sin = rotary_tables(self.cfg, self.cfg.max_seq_len, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def stage(self, layers: range, first: bool, last: bool) -> "Transformer":
        """A pipeline stage: this model's ``layers`` (shared modules, plain names), with the embedding only
        on the ``first`` stage and the final norm, head and loss only on the ``last`` (torchtitan cuts its
        stages the same way: the model class with absent parts)."""
        stage = Transformer.__new__(Transformer)
        nn.Module.__init__(stage)
        stage.cfg, stage.seq_shards = self.cfg, self.seq_shards
        stage.tok_embeddings = self.tok_embeddings if first else None
        stage.layers = nn.ModuleDict({str(i): self.layers[str(i)] for i in layers})
        stage.norm, stage.output, stage.loss = (self.norm, self.output, self.loss) if last else (None, None, None)
        stage.register_buffer("rope_cos", self.rope_cos, persistent=False)
        stage.register_buffer("rope_sin", self.rope_sin, persistent=False)
        return stage


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> Transformer:
    """Deterministic initialisation from ``seed``: N(0, 0.02) for matrices, scaled by 1/sqrt(2L) on the
    projections into the residual stream (GPT-2, Radford et al. 2019), ones for norms. Drawn on the CPU in
    parameter order, so every process and every layout gets the same full model."""
    gen = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.cfg.n_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            std = residual_std if name.endswith(("wo.weight", "w_down.weight", "experts.w_down")) else 0.02
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    return model


def build_model(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Transformer:
    """Build the full model, initialised from ``seed`` (drawn in fp32, then cast to ``dtype``: every dtype
    starts from the same values); on ``device='meta'`` nothing is allocated."""
    cfg.validate()
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return Transformer(cfg)
    model = init_weights(Transformer(cfg), seed)
    model.set_rotary_dtype(dtype)
    return model.to(device=device, dtype=dtype)
