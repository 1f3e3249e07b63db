"""Runs one forward over a ragged batch and returns logits for the requests that need them.

Per call: apply the batch's slot deltas to the req-to-token replica, build the attention
metadata and let the backend plan (once, not per layer), evaluate RoPE cos/sin once per
layer type, run the model body over all new tokens, and project only the last token of
each `need_logits` request through the LM head (never the full vocabulary per prompt
token), except for the requests `forward_full` is asked to give every token's logits.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from kernels.attention.base import AttentionBackend, AttentionMetadata, AttentionShape
from kernels.config import ModelConfig
from kernels.forward_batch import ForwardBatch
from kernels.forward_context import ForwardContext
from kernels.host_staging import HostStaging
from kernels.kv_cache import KVCache, ReqToTokenTable
from kernels.layers import RotaryCache
from kernels.lm_head import LmHead


class ModelExecutor:
    """Holds references to the model, the KV cache, the table and the backend; on the CPU
    it packs the model's decoder linears (and builds the LM head) for the weight layout
    `linear` names or "auto" picks (kernels/linear.py); `linear_reason` says why."""

    def __init__(
        self,
        config: ModelConfig,
        model: nn.Module,
        kv_cache: KVCache,
        attention_backend: AttentionBackend,
        req_to_token: ReqToTokenTable,
        lm_head: LmHead | None = None,
        validate: bool = True,
        cuda_graphs: bool = False,
        linear: str = "aten",
        compile_steps: bool = False,
    ) -> None:
        from kernels.linear import BLOCK_LAYOUTS, choose_linear_backend, pack_linears
        from kernels.lm_head import fp16_plan, narrow_fp16_plan

        self.config = config
        self.model = model
        self.head_blocks_error: str | None = None  # why the head's Q8_0 blocks were not read
        self.linear_blocks_error: str | None = None  # why some linears' blocks were not read
        self.linear_blocks = 0  # decoder linears whose narrow calls read their GGUF's blocks
        self.linear_operator = ""  # their product as a torch op: built, or why not (q8_0)
        self.kv_cache = kv_cache
        self.attention = attention_backend
        self.req_to_token = req_to_token
        self.validate = validate
        self.dtype = model.embed_tokens.weight.dtype
        self.device = model.embed_tokens.weight.device
        plain = [m.weight for m in model.layers.modules() if type(m) is nn.Linear]
        if lm_head is None:
            plain.append(model.lm_head_weight)
        self.linear, self.linear_reason = choose_linear_backend(
            linear, self.device, self.dtype, plain
        )
        # The decoder's linears are packed in place once (a model packed by an earlier
        # executor has no plain nn.Linear left to pack).
        if self.linear != "aten":
            blocks = self._linear_blocks(model) if self.linear in BLOCK_LAYOUTS else {}
            pack_linears(model.layers, self.linear, blocks, prefix="layers.")
        if lm_head is None:
            lm_head = LmHead(
                model.lm_head_weight,
                config.final_logit_softcap,
                backend={"fp16": fp16_plan, "onednn+fp16": narrow_fp16_plan}.get(
                    self.linear, lambda: "auto"
                )(),
                q8_0=self._q8_0_head(model) if self.linear in ("fp16", "onednn+fp16") else None,
            )
        self.lm_head = lm_head
        # Sums a row-parallel product over tensor-parallel ranks (kernels/tensor_parallel);
        # None: one rank holds the whole model.
        self.reduce = None
        self.shape = AttentionShape.of(config)
        self.rotary: dict[str, RotaryCache] = {}
        for layer_type in sorted(set(config.layer_types)):
            spec = config.rope_local if layer_type == "sliding_attention" else config.rope
            self.rotary[layer_type] = RotaryCache(spec, config.head_dim, self.device)
        self.staging = HostStaging(self.device)
        self.graphs = None
        if cuda_graphs:
            from kernels.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self)
        # Small steps through one compiled graph once `compiled.ready` (kernels/compiled_step)
        self.compiled = None
        if compile_steps:
            from kernels.compiled_step import CompiledStep

            self.compiled = CompiledStep(self)

    def _q8_0_head(self, model: nn.Module):
        """The head's Q8_0 blocks as its GGUF stores them (kernels/q8_0), for the
        narrow calls of a layout that already approximates the head (its fp16 copy); None
        where the model is no such GGUF or the kernel is no faster here (LmHead's rule)."""
        from kernels.gguf_blocks import head_blocks
        from kernels.q8_0 import vectorized

        path = getattr(model, "gguf_path", None)
        if path is None or self.device.type != "cpu" or not vectorized():
            return None
        try:
            return head_blocks(path, self.config)
        except (OSError, ValueError) as exc:  # an unreadable file: the fp16 copy, as before
            self.head_blocks_error = f"{path}: {exc}"
            return None

    def _linear_blocks(self, model: nn.Module) -> dict:
        """The decoder linears' blocks that widen to Q8_0 (kernels/gguf_blocks), packed for
        the kernel, by module name, for the narrow calls of a layout that approximates its
        weights there (fp16 copies), under the head's rule (`_q8_0_head`). Each is checked
        against the weight the model loaded (equal, in the model's dtype); one that differs
        is left out, and named in `linear_blocks_error`."""
        from kernels.gguf_blocks import iter_linear_blocks
        from kernels.q8_0 import load_operator, operator_status, vectorized

        path = getattr(model, "gguf_path", None)
        if path is None or self.device.type != "cpu" or not vectorized():
            return {}
        if not any(type(m) is nn.Linear for m in model.layers.modules()):
            return {}  # packed already (by an earlier executor)
        out, differ = {}, []
        try:  # one projection's blocks at a time: packed, or dropped
            for name, blocks in iter_linear_blocks(path, self.config):
                weight = model.get_submodule(name).weight.detach()
                if blocks.shape == tuple(weight.shape) and torch.equal(
                    blocks.dequantized().to(weight.dtype), weight
                ):
                    out[name] = blocks.packed()
                else:
                    differ.append(name)
        except (OSError, ValueError) as exc:  # an unreadable file: the fp16 copies, as before
            self.linear_blocks_error = f"{path}: {exc}"
            return {}
        if differ:
            self.linear_blocks_error = f"blocks unlike the loaded weights: {', '.join(differ)}"
        self.linear_blocks = len(out)
        if out:
            load_operator()  # the blocks' product as one torch op, built now rather than mid-step
            self.linear_operator = operator_status()
        return out

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> Tensor:
        """float32 logits [num requests with need_logits, vocab], in batch order."""
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.run(batch, self._build(batch))
        if self._compiles(batch):
            rows = self._logit_rows(batch)
            logits = self._compiled_logits(batch, rows)
            if logits is not None:
                return logits
        hidden = self.forward_hidden(batch)
        if hidden.shape[0] == 0:
            return torch.empty((0, self.config.vocab), dtype=torch.float32, device=self.device)
        return self.lm_head(hidden)

    @torch.inference_mode()
    def forward_full(self, batch: ForwardBatch, full: list[bool]) -> tuple[Tensor, list[Tensor]]:
        """`forward`, plus the logits of every new token of the requests flagged in `full`
        (float32 [their new tokens, vocab] each, in batch order of the flagged requests;
        prompt logprobs need them). A flagged request's last-token logits are a row of both."""
        starts = np.zeros(batch.batch_size + 1, dtype=np.int64)
        np.cumsum(batch.extend_lens, out=starts[1:])
        last = [int(starts[i + 1]) - 1 for i, need in enumerate(batch.need_logits) if need]
        spans = [range(int(starts[i]), int(starts[i + 1])) for i, f in enumerate(full) if f]
        rows = sorted(set(last).union(*spans))
        where = {row: k for k, row in enumerate(rows)}
        picked_at = np.asarray([where[r] for r in last], dtype=np.int64)
        logits = None
        if self._compiles(batch):
            logits = self._compiled_logits(batch, np.asarray(rows, dtype=np.int64))
        if logits is not None:
            picked_t = torch.from_numpy(picked_at).to(self.device)
        else:
            meta = self._prepare(batch, np.asarray(rows, dtype=np.int64), picked_at)
            _, rows_t, picked_t = meta.extra
            logits = self.lm_head(self._body(meta, rows_t))
        # a span's rows are consecutive in `rows` (sorted, and the span is a whole range)
        per_request = [logits[where[s.start] : where[s.start] + len(s)] for s in spans]
        return logits[picked_t], per_request

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch) -> Tensor:
        """Final-norm hidden states [num requests with need_logits, hidden]; writes the KV."""
        rows = self._logit_rows(batch)
        meta = self._prepare(batch, *(() if rows is None else (rows,)))
        return self._body(meta, None if rows is None else meta.extra[1])

    def _compiles(self, batch: ForwardBatch) -> bool:
        return (
            self.compiled is not None
            and self.compiled.fits(batch.num_tokens)
            and self.compiled.pays(batch.extend_lens, batch.seq_lens)
        )

    def _compiled_logits(self, batch: ForwardBatch, rows: np.ndarray | None) -> Tensor | None:
        """Logits of `rows` (flat token indices; None: every token) through the compiled
        body; None where the graph would recompile (the step is then run eagerly: the slot
        deltas are applied again, which is idempotent)."""
        meta = self._build(batch) if rows is None else self._build(batch, rows)
        hidden = self.compiled.run(self.compiled.inputs(meta, meta.extra[0]))
        if hidden is None:
            return None
        if rows is not None:
            hidden = hidden.index_select(0, meta.extra[1])
        return self.lm_head(hidden)

    def _build(self, batch: ForwardBatch, *extra: np.ndarray) -> AttentionMetadata:
        """Apply the batch's slot deltas and build its attention metadata; `meta.extra` is
        the input ids, then `extra`, on the device (one transfer with the metadata)."""
        if batch.slot_deltas is not None:
            d = batch.slot_deltas
            self.req_to_token.apply_slot_deltas(d.rows, d.starts, d.lengths, d.flat_slots)
            self.kv_cache.map_swa(d.swa_full_pages, d.swa_pages)
        return AttentionMetadata.build(
            batch,
            self.req_to_token,
            self.kv_cache,
            self.shape,
            validate=self.validate,
            staging=self.staging,
            extra=(batch.flat_input_ids(), *extra),
        )

    def _prepare(self, batch: ForwardBatch, *extra: np.ndarray) -> AttentionMetadata:
        meta = self._build(batch, *extra)
        self.attention.plan(meta)
        return meta

    def _body(self, meta: AttentionMetadata, rows: Tensor | None) -> Tensor:
        rope = {
            layer_type: cache.cos_sin(meta.positions, self.dtype)
            for layer_type, cache in self.rotary.items()
        }
        ctx = ForwardContext(
            attention=self.attention, kv_cache=self.kv_cache, rope=rope, reduce=self.reduce
        )
        # The body always runs over every new token (their KV must be written), even when
        # no row is selected (a non-final prefill chunk).
        return self.model(meta.extra[0], ctx, rows)

    @staticmethod
    def _logit_rows(batch: ForwardBatch) -> np.ndarray | None:
        """Rows (flat token index) of the last new token of each need_logits request;
        None when that is every row (pure decode with logits for all)."""
        if batch.is_decode_only and all(batch.need_logits):
            return None
        wanted = np.asarray(batch.need_logits, dtype=bool)
        return np.cumsum(batch.extend_lens)[wanted] - 1


def build_executor(
    config: ModelConfig,
    model: nn.Module,
    lm_head: LmHead | None,
    *,
    device: str,
    dtype: torch.dtype,
    attention: str,
    linear: str,
    num_pages: int,
    swa_num_pages: int,
    page_size: int,
    max_rows: int,
    row_capacity: int,
    cuda_graphs: bool = False,
    validate: bool = False,
) -> ModelExecutor:
    """The runner's executor: `model` on `device`, a KV pool of `num_pages` pages (plus the
    page 0 every unmapped slot points at), the req-to-token table of `max_rows` rows (plus
    the padding row), the `attention` backend by name."""
    from kernels.attention import make_attention_backend
    from kernels.cuda_graphs import graph_max_pages

    model = model.to(device)
    kv = KVCache(
        num_layers=config.num_layers,
        num_slots=(num_pages + 1) * page_size,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=dtype,
        device=device,
        page_size=page_size,
        sliding_layers=config.sliding_layers,
        swa_num_pages=swa_num_pages,
    )
    table = ReqToTokenTable(max_rows + 1, row_capacity, device=device)
    options = {} if attention == "torch" else {"device": device, "dtype": dtype}
    if cuda_graphs:
        options["graph_max_pages"] = graph_max_pages(row_capacity, page_size)
    return ModelExecutor(
        config,
        model,
        kv,
        make_attention_backend(attention, **options),
        table,
        lm_head=lm_head,
        validate=validate,
        cuda_graphs=cuda_graphs,
        linear=linear,
    )
