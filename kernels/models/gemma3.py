"""Gemma 3 (text) on a ragged, paged-KV batch.

Per layer: input norm -> q/k/v projections -> per-head q/k RMSNorm -> RoPE (base 10k on
sliding layers, 1M on global ones) -> attention (sliding window on 5 of every 6 layers) ->
o_proj -> post-attention norm -> residual; then pre-FFN norm -> GELU-tanh gated MLP ->
post-FFN norm -> residual. Embeddings are scaled by sqrt(hidden) (rounded to the weight
dtype, as HF does); all norms scale by (1 + w). Parameter names are HF's minus "model.",
with q/k/v and gate/up stacked (`qkv_proj`, `gate_up_proj`: kernels/linear.py).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels.config import ModelConfig
from kernels.forward_context import ForwardContext
from kernels.layers import GatedMLP, GemmaRMSNorm, apply_rotary


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.split = (config.q_size, config.kv_size, config.kv_size)
        self.qkv_proj = nn.Linear(config.hidden, sum(self.split), bias=bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden, bias=bias)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.norm_eps)

    def forward(
        self, x: Tensor, ctx: ForwardContext, layer_id: int, layer_type: str, is_sliding: bool
    ) -> Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = self.q_norm(q.view(tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim))
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        cos, sin = ctx.rope[layer_type]
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = ctx.attention.forward(layer_id, q, k, v, ctx.kv_cache, is_sliding)
        return ctx.summed(self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.layer_type = config.layer_types[layer_id]
        self.is_sliding = config.is_sliding(layer_id)
        self.self_attn = Gemma3Attention(config)
        self.mlp = GatedMLP(config.hidden, config.intermediate, config.hidden_act)
        eps = config.norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden, eps)

    def forward(self, hidden: Tensor, ctx: ForwardContext) -> Tensor:
        attn = self.self_attn(
            self.input_layernorm(hidden), ctx, self.layer_id, self.layer_type, self.is_sliding
        )
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = ctx.summed(self.mlp(self.pre_feedforward_layernorm(hidden)))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3ForCausalLM(nn.Module):
    """Token ids -> final hidden states of the rows the caller selects (logits are the
    executor's job, through `lm_head_weight`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(
            [Gemma3DecoderLayer(config, i) for i in range(config.num_layers)]
        )
        self.norm = GemmaRMSNorm(config.hidden, config.norm_eps)
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        # fp32 sqrt(hidden), cast to the weight dtype at use (bf16 rounds it, as in HF).
        self.embed_scale = float(config.hidden) ** 0.5

    @property
    def lm_head_weight(self) -> Tensor:
        return self.embed_tokens.weight if self.config.tie_embeddings else self.lm_head.weight

    def forward(self, input_ids: Tensor, ctx: ForwardContext, select: Tensor | None) -> Tensor:
        weight = self.embed_tokens.weight
        hidden = self.embed_tokens(input_ids) * torch.tensor(self.embed_scale).to(weight.dtype)
        for layer in self.layers:
            hidden = layer(hidden, ctx)
        if select is not None:
            hidden = hidden.index_select(0, select)
        return self.norm(hidden)
