"""The weight-only quantization layouts' constants, apart from their kernels (`kernels.quant`
imports torch; the memory plan and the unit tier read these without it)."""

QUANTIZATIONS = ("int8", "int4")
INT4_GROUP = 32  # input channels per int4 scale/zero pair (llama.cpp's block size)
INT4_ROWS = 16  # the int4 kernel's output channels come in multiples of this
# GGUF types whose blocks are the int4 layout (their codes carry over: kernels.gguf_int4)
INT4_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# model.quantization = "auto" on a quantized GGUF resolves to this: int4 where the GGUF stores
# 4-bit blocks (INT4_BLOCK_TYPES), int8 elsewhere (kernels.models.resolve_quantization)
AS_STORED = "gguf"
