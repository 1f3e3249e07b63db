"""Shared helpers for the model tests: a contiguous-slot allocator and a greedy driver.

`ContiguousSlots` stands in for the lead's allocator: row r owns the slots
[first + r * capacity, first + (r + 1) * capacity), handed out in order and announced to the
executor through the slot deltas of each batch, exactly as the real allocator will do.
`GreedyRunner` drives an executor through chunked prefill and batched decode.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from kernels.attention import make_attention_backend
from kernels.config import ModelConfig
from kernels.forward_batch import ForwardBatch, SlotDeltas
from kernels.kv_cache import KVCache, ReqToTokenTable
from kernels.lm_head import LmHead
from kernels.model_executor import ModelExecutor

# One LM head per model: building one may pack a copy of the (large) tied embedding.
_HEADS: weakref.WeakKeyDictionary[torch.nn.Module, LmHead] = weakref.WeakKeyDictionary()


# The tiny random HF models' shared config fields (a vocabulary of TINY_VOCAB ids; 0-2 are
# pad, bos, eos).
TINY_VOCAB = 512
TINY_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    max_position_embeddings=256,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# A Gemma 3 with a sliding window of 8 (shorter than the tests' contexts) and soft-capping.
TINY_GEMMA3_WINDOW8 = dict(
    num_hidden_layers=3,
    num_key_value_heads=1,
    head_dim=16,
    sliding_window=8,
    query_pre_attn_scalar=24,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    final_logit_softcapping=30.0,
)


def shared_lm_head(config: ModelConfig, model: torch.nn.Module) -> LmHead:
    head = _HEADS.get(model)
    if head is None:
        head = LmHead(model.lm_head_weight, config.final_logit_softcap)
        _HEADS[model] = head
    return head


@dataclass
class ContiguousSlots:
    """Row r -> slots first_slot + r * row_capacity + position; page 0 stays unused."""

    num_rows: int
    row_capacity: int
    first_slot: int
    allocated: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.allocated = [0] * self.num_rows

    @property
    def num_slots_needed(self) -> int:
        return self.first_slot + self.num_rows * self.row_capacity

    def extend(self, rows: list[int], new_lens: list[int]) -> SlotDeltas:
        """Reserve `new_lens[i]` more positions for rows[i]; the deltas to send along."""
        starts, flat = [], []
        for row, n in zip(rows, new_lens):
            start = self.allocated[row]
            if start + n > self.row_capacity:
                raise ValueError("row full")
            base = self.first_slot + row * self.row_capacity
            flat.extend(range(base + start, base + start + n))
            starts.append(start)
            self.allocated[row] = start + n
        return SlotDeltas(rows=list(rows), starts=starts, lengths=list(new_lens), flat_slots=flat)

    def release(self, row: int) -> None:
        self.allocated[row] = 0


def make_executor(
    config: ModelConfig,
    model: torch.nn.Module,
    num_rows: int,
    row_capacity: int,
    page_size: int = 1,
    lm_head: LmHead | None = None,
    linear: str = "aten",
) -> tuple[ModelExecutor, ContiguousSlots]:
    dtype = model.embed_tokens.weight.dtype
    slots = ContiguousSlots(num_rows, row_capacity, first_slot=page_size)
    total = slots.num_slots_needed
    total += (-total) % page_size
    kv = KVCache(
        config.num_layers, total, config.num_kv_heads, config.head_dim, dtype, page_size=page_size
    )
    table = ReqToTokenTable(num_rows, row_capacity)
    executor = ModelExecutor(
        config,
        model,
        kv,
        make_attention_backend("torch"),
        table,
        lm_head=lm_head or (shared_lm_head(config, model) if linear == "aten" else None),
        linear=linear,
    )
    return executor, slots


@dataclass
class GreedyRunner:
    """Greedy generation for several prompts at once, with optional chunked prefill."""

    executor: ModelExecutor
    slots: ContiguousSlots

    def prefill_logits(self, prompts: list[list[int]], chunk: int | None = None) -> torch.Tensor:
        """Prefill every prompt (rows 0..n-1) in chunks; logits of each last prompt token."""
        n = len(prompts)
        done = [0] * n
        last: list[torch.Tensor | None] = [None] * n
        while any(done[i] < len(prompts[i]) for i in range(n)):
            reqs = [i for i in range(n) if done[i] < len(prompts[i])]
            pieces = [prompts[i][done[i] : done[i] + (chunk or len(prompts[i]))] for i in reqs]
            final = [done[i] + len(p) == len(prompts[i]) for i, p in zip(reqs, pieces)]
            deltas = self.slots.extend(reqs, [len(p) for p in pieces])
            batch = ForwardBatch(reqs, [done[i] for i in reqs], pieces, final, deltas)
            logits = self.executor.forward(batch)
            for row_out, i in enumerate(i for i, f in zip(reqs, final) if f):
                last[i] = logits[row_out]
            for i, p in zip(reqs, pieces):
                done[i] += len(p)
        return torch.stack(last)  # type: ignore[arg-type]

    def generate(
        self,
        prompts: list[list[int]],
        max_new: int,
        chunk: int | None = None,
        stop_ids: tuple[int, ...] = (),
    ) -> list[list[int]]:
        """Greedy continuations (up to max_new tokens, stopping after a stop id)."""
        for row in range(len(prompts)):
            self.slots.release(row)
        logits = self.prefill_logits(prompts, chunk)
        outputs = [[int(t)] for t in logits.argmax(-1)]
        lens = [len(p) for p in prompts]
        for _ in range(max_new - 1):
            live = [
                i for i, out in enumerate(outputs) if len(out) < max_new and out[-1] not in stop_ids
            ]
            if not live:
                break
            deltas = self.slots.extend(live, [1] * len(live))
            batch = ForwardBatch.decode(
                live,
                [lens[i] + len(outputs[i]) - 1 for i in live],
                [outputs[i][-1] for i in live],
                deltas,
            )
            next_ids = self.executor.forward(batch).argmax(-1).tolist()
            for i, t in zip(live, next_ids):
                outputs[i].append(int(t))
        return outputs


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def char_vocab(pieces: list[str], eos: int = 1) -> dict[str, int]:
    """A character-level vocabulary (<pad> 0, <eos> `eos`, then every printable character
    but \t \r \v \f) with `pieces` as extra multi-character tokens: the grammar tests'."""
    import string

    vocab = {"<pad>": 0, "<eos>": eos}
    for c in string.printable:
        if c not in "\t\r\x0b\x0c":
            vocab[c] = len(vocab)
    for piece in pieces:
        vocab[piece] = len(vocab)
    return vocab
