"""What a GGUF's architecture means to kvactor: metadata -> `ModelConfig`, llama.cpp's tensor
names -> ours, and the changes llama.cpp's converter made to a tensor that we undo.

Supported: `gemma3`, and the Llama family `llama` (Llama 2/3.x, Mistral, SmolLM), `qwen2`
(Qwen 2.5, DeepSeek-R1 distills) and `qwen3`. Metadata keys are llama.cpp's
(`{arch}.embedding_length`, `{arch}.attention.head_count_kv`, ...); where a GGUF leaves a
value out, the default is the one llama.cpp and transformers' GGUF loader assume.

What the converter changed, and how we read it back:
  * Gemma norms are stored as `1 + w` (the model multiplies by `1 + w`): we subtract 1
    (`value_fixup`).
  * Llama's q and k rows are permuted (`LlamaModel.permute`: each head's rotary halves
    interleaved, for llama.cpp's rotate-adjacent RoPE): `row_order` gives HF's order.
    Qwen2/Qwen3 were converted without the permutation.
  * Llama 3.1+ carry their RoPE scaling as a `rope_freqs` tensor (a divisor per frequency),
    not as metadata: `llama3_rope` derives the scaling it encodes and checks it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kernels.config import ModelConfig, RopeSpec, UnsupportedModelError, gemma3_layer_types

SUPPORTED_GGUF_ARCHS = ("gemma3", "llama", "qwen2", "qwen3")
LLAMA_FAMILY = ("llama", "qwen2", "qwen3")

# Gemma 3 constants that the GGUF does not carry (llama.cpp and transformers hard-code them).
GEMMA3_ROPE_LOCAL_THETA = 10_000.0
GEMMA3_SLIDING_PATTERN = 6

_COMMON_BLOCK_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
BLOCK_NAMES: dict[str, dict[str, str]] = {
    "gemma3": {
        **_COMMON_BLOCK_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    **{
        arch: {**_COMMON_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"}
        for arch in LLAMA_FAMILY
    },
}
GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "embed_tokens",
    "output_norm": "norm",
    "output": "lm_head",
}
# Tensors that configure the model rather than hold parameters.
CONFIG_TENSORS = ("rope_freqs.weight",)

# Tokens that end a generation when the vocabulary has them (llama.cpp's end-of-generation
# list: Llama 3's turn and message ends, ChatML's, Gemma's, Phi's...).
END_OF_GENERATION_TEXTS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
    "<EOT>",
)


def param_name(arch: str, gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `layers.3.self_attn.q_proj.weight`; None for a tensor that
    configures the model (`rope_freqs`); KeyError for a tensor we do not know."""
    if gguf_name in CONFIG_TENSORS:
        return None
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        names = BLOCK_NAMES[arch]
        if part not in names:
            raise KeyError(f"unknown {arch} GGUF tensor {gguf_name!r}")
        return f"layers.{layer}.{names[part]}.{suffix}"
    if stem not in GLOBAL_NAMES:
        raise KeyError(f"unknown {arch} GGUF tensor {gguf_name!r}")
    return f"{GLOBAL_NAMES[stem]}.{suffix}"


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute` on q or k rows ([out, ...], out = n_head * d):
    it stored, per head, row pairs (i, i + d/2) adjacent; HF keeps the two halves apart."""
    half = rows.shape[0] // n_head // 2
    restored = rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(1, 2)
    return restored.reshape(rows.shape)


def row_order(config: ModelConfig, name: str, rows: int) -> np.ndarray | None:
    """The checkpoint's row order of a tensor as indices into the GGUF's rows, for the
    tensors llama.cpp permuted (Llama's q and k); None for every other tensor."""
    if config.arch != "llama":
        return None
    if ".self_attn.q_proj." in name:
        return unpermute_rows(np.arange(rows), config.num_heads)
    if ".self_attn.k_proj." in name:
        return unpermute_rows(np.arange(rows), config.num_kv_heads)
    return None


def value_fixup(arch: str, name: str) -> Callable[[np.ndarray], np.ndarray] | None:
    """The element-wise change that turns a dequantized GGUF tensor (fp32, our name) into
    the checkpoint's: Gemma's norms are stored as 1 + w; None where there is none."""
    if arch == "gemma3" and name.endswith("norm.weight"):
        return lambda array: array - np.float32(1.0)
    return None


# ---------------------------------------------------------------------------------------------
# Metadata -> ModelConfig
# ---------------------------------------------------------------------------------------------
class Metadata:
    """Typed reads of a `gguf.GGUFReader`'s fields."""

    def __init__(self, reader) -> None:
        self.reader = reader
        self.arch = self.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_key(self, name: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{name}", default)

    def required(self, name: str) -> Any:
        """`{arch}.{name}`, which every file of the architecture has; refused when absent."""
        value = self.arch_key(name)
        if value is None:
            raise UnsupportedModelError(f"the GGUF lacks {self.arch}.{name}")
        return value

    def token_id(self, key: str) -> int | None:
        value = self.get(f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    @property
    def tokens(self):
        field = self.reader.fields.get("tokenizer.ggml.tokens")
        if field is None:
            raise UnsupportedModelError("the GGUF has no vocabulary (tokenizer.ggml.tokens)")
        return field

    @property
    def vocab_size(self) -> int:
        return len(self.tokens.data)

    def token_ids(self, texts: tuple[str, ...]) -> list[int]:
        """Ids of the tokens whose text is in `texts`, in vocabulary order (llama.cpp marks
        them end-of-generation whatever type the file gave them)."""
        tokens = self.tokens
        wanted = {t.encode() for t in texts}
        return [i for i, part in enumerate(tokens.data) if bytes(tokens.parts[part]) in wanted]

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}


def read_config(reader) -> ModelConfig:
    """`ModelConfig` of a GGUF (architectures in `SUPPORTED_GGUF_ARCHS`)."""
    meta = Metadata(reader)
    if meta.arch not in SUPPORTED_GGUF_ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {meta.arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHS)}"
        )
    if int(meta.arch_key("expert_count", 0) or 0) > 0:
        raise UnsupportedModelError(
            f"mixture-of-experts GGUFs ({meta.arch}.expert_count = "
            f"{meta.arch_key('expert_count')}) are not supported"
        )
    config = _gemma3_config(meta) if meta.arch == "gemma3" else _llama_family_config(meta)
    _check_tensors(reader, config)
    config.extra.update(
        source="gguf",
        name=meta.get("general.name"),
        weight_types=weight_types(reader),
        linear_types=weight_types(reader, prefix="blk."),
        embedding_type=_type_of(reader, "token_embd.weight"),
        head_type=_type_of(
            reader, "token_embd.weight" if config.tie_embeddings else "output.weight"
        ),
    )
    return config


def _check_tensors(reader, config: ModelConfig) -> None:
    """Refuse, at start, a tensor that is no part of the model and an embedding whose rows
    are not the vocabulary."""
    for tensor in reader.tensors:
        try:
            param_name(config.arch, tensor.name)
        except KeyError:
            raise UnsupportedModelError(
                f"GGUF tensor {tensor.name!r} is not part of a {config.arch} model kvactor runs"
            ) from None
        if tensor.name == "token_embd.weight":
            rows, cols = (int(d) for d in reversed(tensor.shape))
            if (rows, cols) != (config.vocab, config.hidden):
                raise UnsupportedModelError(
                    f"token_embd.weight is {rows} x {cols}, not the vocabulary's {config.vocab}"
                    f" tokens x hidden {config.hidden}"
                )


def _type_of(reader, name: str) -> str | None:
    return next((t.tensor_type.name for t in reader.tensors if t.name == name), None)


def weight_types(reader, prefix: str = "") -> dict[str, int]:
    """Parameters per GGUF type over the 2-D weights whose names start with `prefix` (all:
    the linears, the embedding and the head; "blk.": the decoder linears)."""
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        if len(tensor.shape) == 2 and tensor.name.startswith(prefix):
            name = tensor.tensor_type.name
            counts[name] = counts.get(name, 0) + int(tensor.n_elements)
    return counts


def _special_ids(meta: Metadata, extra_eos: tuple[str, ...]) -> dict[str, Any]:
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = meta.token_id(key)
        if token is not None and token not in eos_ids:
            eos_ids.append(token)
    for token in meta.token_ids(extra_eos):
        if token not in eos_ids:
            eos_ids.append(token)
    return {
        "bos_id": meta.token_id("bos_token_id"),
        "eos_ids": tuple(eos_ids),
        "pad_id": meta.token_id("padding_token_id"),
    }


def _shapes(meta: Metadata) -> dict[str, Any]:
    """The ModelConfig fields every architecture reads alike from `{arch}.*` keys."""
    hidden = int(meta.required("embedding_length"))
    num_heads = int(meta.required("attention.head_count"))
    return {
        "num_layers": int(meta.required("block_count")),
        "hidden": hidden,
        "num_heads": num_heads,
        "num_kv_heads": int(meta.arch_key("attention.head_count_kv", num_heads)),
        "head_dim": int(meta.arch_key("attention.key_length", hidden // num_heads)),
        "intermediate": int(meta.required("feed_forward_length")),
        "vocab": meta.vocab_size,
    }


def _gemma3_config(meta: Metadata) -> ModelConfig:
    shapes = _shapes(meta)
    num_layers, head_dim = shapes["num_layers"], shapes["head_dim"]
    rope_kind = meta.arch_key("rope.scaling.type", "none")
    rope_factor = float(meta.arch_key("rope.scaling.factor", 1.0))
    global_kind = "linear" if rope_kind == "linear" and rope_factor != 1.0 else "default"
    rope = RopeSpec(
        theta=float(meta.arch_key("rope.freq_base", 1_000_000.0)),
        kind=global_kind,
        factor=rope_factor if global_kind == "linear" else 1.0,
    )
    return ModelConfig(
        arch="gemma3",
        **shapes,
        rope=rope,
        rope_local=RopeSpec(theta=GEMMA3_ROPE_LOCAL_THETA),
        layer_types=gemma3_layer_types(num_layers, GEMMA3_SLIDING_PATTERN),
        sliding_window=int(meta.arch_key("attention.sliding_window", 512)),
        norm_eps=float(meta.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        hidden_act="gelu_pytorch_tanh",
        # transformers' Gemma3TextConfig default (256) == head_dim for every size but 27B.
        query_pre_attn_scalar=float(head_dim),
        # transformers' Gemma 3 attention never applies attn_logit_softcapping; neither do we.
        attn_logit_softcap=None,
        final_logit_softcap=_optional_float(meta.arch_key("final_logit_softcapping")),
        tie_embeddings="output.weight" not in meta.tensor_names(),
        attention_bias=False,
        qk_norm=True,
        max_position=int(meta.arch_key("context_length", 32768)),
        # Gemma's chat turns end at <end_of_turn> (as in its generation_config).
        **_special_ids(meta, ("<end_of_turn>",)),
    )


def _llama_family_config(meta: Metadata) -> ModelConfig:
    arch = meta.arch
    shapes = _shapes(meta)
    num_layers, head_dim = shapes["num_layers"], shapes["head_dim"]
    if int(meta.arch_key("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError("GGUF with key_length != value_length is not supported")
    rotary_dims = int(meta.arch_key("rope.dimension_count", head_dim))
    if rotary_dims != head_dim:
        raise UnsupportedModelError(
            f"partial rotary embeddings ({rotary_dims} of {head_dim} dims) are not supported"
        )
    names = meta.tensor_names()
    rope = _llama_family_rope(meta, head_dim)
    return ModelConfig(
        arch=arch,
        **shapes,
        rope=rope,
        rope_local=rope,
        layer_types=("full_attention",) * num_layers,
        sliding_window=None,
        norm_eps=float(meta.arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
        hidden_act="silu",
        tie_embeddings="output.weight" not in names,
        # Qwen2 always biases q/k/v; a Llama-family GGUF with biases stores them.
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
        qk_norm=arch == "qwen3",
        max_position=int(meta.arch_key("context_length", 4096)),
        **_special_ids(meta, END_OF_GENERATION_TEXTS),
    )


def _llama_family_rope(meta: Metadata, head_dim: int) -> RopeSpec:
    theta = float(meta.arch_key("rope.freq_base", 10_000.0))
    kind = meta.arch_key("rope.scaling.type", "none")
    factor = float(meta.arch_key("rope.scaling.factor", 1.0))
    if "rope_freqs.weight" in meta.tensor_names():
        tensor = next(t for t in meta.reader.tensors if t.name == "rope_freqs.weight")
        original = int(meta.arch_key("rope.scaling.original_context_length", 8192))
        return llama3_rope(np.asarray(tensor.data, dtype=np.float32), theta, head_dim, original)
    if kind in ("none", None) or factor == 1.0:
        return RopeSpec(theta=theta)
    if kind == "linear":
        return RopeSpec(theta=theta, kind="linear", factor=factor)
    raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported")


def llama3_rope(
    freq_divisors: np.ndarray, theta: float, head_dim: int, original_max_position: int = 8192
) -> RopeSpec:
    """The llama3 `RopeSpec` whose scaling the `rope_freqs` tensor encodes (llama.cpp
    divides each inverse frequency by it). Its largest divisor is the factor; Meta's low and
    high frequency factors (1, 4) are the ones every Llama 3.x uses. Anything else is refused
    rather than run with RoPE the model was not trained with."""
    import torch

    from kernels.layers import rope_inv_freq

    factor = float(freq_divisors.max())
    if factor <= 1.0:
        return RopeSpec(theta=theta)
    spec = RopeSpec(
        theta=theta, kind="llama3", factor=factor, original_max_position=original_max_position
    )
    base = rope_inv_freq(RopeSpec(theta=theta), head_dim)
    want = (base / torch.from_numpy(freq_divisors)).numpy()
    got = rope_inv_freq(spec, head_dim).numpy()
    if want.shape != got.shape or not np.allclose(got, want, rtol=1e-4, atol=0):
        raise UnsupportedModelError(
            "the GGUF's rope_freqs tensor is not Llama 3's scaling (low/high frequency factors "
            "1 and 4); this RoPE variant is not supported"
        )
    return spec


def _optional_float(value) -> float | None:
    return None if value is None else float(value)
