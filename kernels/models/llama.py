"""Llama-family decoders on a ragged, paged-KV batch: Llama, Qwen2 and Qwen3.

The three differ only in switches read from the config:
  * Qwen2: bias on the q/k/v projections (`attention_bias`);
  * Qwen3: RMSNorm over head_dim on q and k before RoPE (`qk_norm`);
  * Llama: neither (optionally llama3/linear RoPE scaling, handled by the RopeSpec).
Pre-norm residual blocks with a SiLU gated MLP; norms multiply by w (not 1 + w).
Parameter names are HF's minus the leading "model.", with q/k/v and gate/up stacked
(`qkv_proj`, `gate_up_proj`: kernels/linear.py).
"""

from __future__ import annotations

from torch import Tensor, nn

from kernels.config import ModelConfig
from kernels.forward_context import ForwardContext
from kernels.layers import GatedMLP, RMSNorm, apply_rotary


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_bias = config.attention_bias
        # Qwen2 always biases q/k/v and never o_proj; Llama/Qwen3's attention_bias covers all four.
        o_bias = config.attention_bias and config.arch != "qwen2"
        self.split = (config.q_size, config.kv_size, config.kv_size)
        self.qkv_proj = nn.Linear(config.hidden, sum(self.split), bias=qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden, bias=o_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)

    def forward(
        self, x: Tensor, ctx: ForwardContext, layer_id: int, layer_type: str, is_sliding: bool
    ) -> Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        cos, sin = ctx.rope[layer_type]
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = ctx.attention.forward(layer_id, q, k, v, ctx.kv_cache, is_sliding)
        return ctx.summed(self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.layer_type = config.layer_types[layer_id]
        self.is_sliding = config.is_sliding(layer_id)
        self.self_attn = LlamaAttention(config)
        self.mlp = GatedMLP(config.hidden, config.intermediate, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden, config.norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden, config.norm_eps)

    def forward(self, hidden: Tensor, ctx: ForwardContext) -> Tensor:
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), ctx, self.layer_id, self.layer_type, self.is_sliding
        )
        return hidden + ctx.summed(self.mlp(self.post_attention_layernorm(hidden)))


class LlamaForCausalLM(nn.Module):
    """Token ids -> final hidden states of the selected rows (Llama / Qwen2 / Qwen3)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i) for i in range(config.num_layers)]
        )
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)

    @property
    def lm_head_weight(self) -> Tensor:
        return self.embed_tokens.weight if self.config.tie_embeddings else self.lm_head.weight

    def forward(self, input_ids: Tensor, ctx: ForwardContext, select: Tensor | None) -> Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, ctx)
        if select is not None:
            hidden = hidden.index_select(0, select)
        return self.norm(hidden)
