"""The model executor alone, for benchmarks that bypass the engine: `rows` requests, each
owning a contiguous run of `capacity` slots (row r holds slots r * capacity + 1 ...; slot
0 is the padding page), so no allocator is needed. The model's device is the KV's; on CUDA
`attention` names the backend ("torch" elsewhere) and `cuda_graphs` replays decode steps
as the engine's runner does."""

from __future__ import annotations


def bare_executor(
    config,
    model,
    rows: int,
    capacity: int,
    lm_head=None,
    validate: bool = True,
    attention: str = "torch",
    cuda_graphs: bool = False,
    linear: str = "aten",
):
    import torch

    from kernels.cuda_graphs import GRAPH_BACKENDS
    from kernels.model_executor import build_executor

    weight = model.embed_tokens.weight
    executor = build_executor(
        config,
        model,
        lm_head,
        device=str(weight.device),
        dtype=weight.dtype,
        attention=attention,
        linear=linear,
        num_pages=rows * capacity,  # pages of one slot: slot 0 pads, row r's follow
        swa_num_pages=0,
        page_size=1,
        max_rows=rows - 1,  # + the table's padding row: rows rows
        row_capacity=capacity,
        cuda_graphs=cuda_graphs and weight.device.type == "cuda" and attention in GRAPH_BACKENDS,
        validate=validate,
    )
    executor.req_to_token.apply_slot_deltas(
        list(range(rows)),
        [0] * rows,
        [capacity] * rows,
        torch.arange(1, rows * capacity + 1, dtype=torch.int32),
    )
    return executor
