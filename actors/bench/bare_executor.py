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

    from kernels.attention import make_attention_backend
    from kernels.kv_cache import KVCache, ReqToTokenTable
    from kernels.model_executor import ModelExecutor

    weight = model.embed_tokens.weight
    dtype, device = weight.dtype, weight.device
    kv = KVCache(
        config.num_layers,
        rows * capacity + 1,
        config.num_kv_heads,
        config.head_dim,
        dtype,
        device=device,
    )
    table = ReqToTokenTable(rows, capacity, device=device)
    table.apply_slot_deltas(
        list(range(rows)),
        [0] * rows,
        [capacity] * rows,
        torch.arange(1, rows * capacity + 1, dtype=torch.int32),
    )
    from kernels.cuda_graphs import GRAPH_BACKENDS, graph_max_pages

    options = {} if attention == "torch" else {"device": device, "dtype": dtype}
    graphs = cuda_graphs and device.type == "cuda" and attention in GRAPH_BACKENDS
    if graphs:
        options["graph_max_pages"] = graph_max_pages(capacity, 1)
    return ModelExecutor(
        config,
        model,
        kv,
        make_attention_backend(attention, **options),
        table,
        lm_head=lm_head,
        validate=validate,
        cuda_graphs=graphs,
        linear=linear,
    )
