"""Tensor parallelism (kernels/tensor_parallel.py): two gloo ranks, this process rank 0 and a
`python -m kernels.tensor_parallel` process rank 1, each holding half the model, against the
same model on one rank: greedy tokens equal and logits within fp32 rounding, on tiny random
Llama / Qwen2 / Qwen3 models with 4 KV heads (split 2 + 2), a GQA Llama with 2, and a Gemma 3
with one KV head (copied to both ranks) and a sliding window shorter than the prompts.
Prompts are prefilled in chunks, decoded in ragged batches; a vocabulary that does not
split evenly pads the last rank's rows. A rank that dies breaks the group with an error
naming the failure, and a rank that cannot start fails the launch naming it."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kernels.model_executor import build_executor
from kernels.models import load_config, load_model
from kernels.tensor_parallel import (
    ParallelExecutor,
    RankSettings,
    TensorParallelError,
    TpGroup,
    build_rank,
    check_split,
    core_placement,
    cuda_gpus,
    data_group,
    gloo_group,
    launch,
    split_of,
    stop_ranks,
)
from tests.model.model_fixtures import (
    TINY_COMMON,
    TINY_GEMMA3_WINDOW8,
    ContiguousSlots,
    GreedyRunner,
    rel_l2,
)

pytestmark = [pytest.mark.model]

POOL = dict(num_pages=160, swa_num_pages=0, page_size=16, max_rows=4, row_capacity=512)
ODD_VOCAB = 509  # not a multiple of 2: rank 1's vocabulary rows end in padding


def _configs():
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(TINY_COMMON, vocab_size=ODD_VOCAB)
    return {
        "llama_4kv": LlamaConfig(
            **common, num_hidden_layers=2, num_key_value_heads=4, tie_word_embeddings=False
        ),
        "qwen2_bias_4kv": Qwen2Config(
            **dict(common, num_attention_heads=8),
            num_hidden_layers=2,
            num_key_value_heads=4,
            tie_word_embeddings=True,
        ),
        "qwen3_qk_norm_4kv": Qwen3Config(
            **common, num_hidden_layers=2, num_key_value_heads=4, head_dim=16
        ),
        "llama_gqa_2kv": LlamaConfig(
            **common, num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=False
        ),
        "gemma3_1kv_window8": Gemma3TextConfig(**common, **TINY_GEMMA3_WINDOW8),
    }


def _save_tiny(name: str, tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(4321)
    hf = AutoModelForCausalLM.from_config(_configs()[name], dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases: each must be split (or not) right
        for param_name, param in hf.named_parameters():
            if "norm" in param_name or param_name.endswith("bias"):
                param.uniform_(-0.5, 0.5)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=list(_configs()))
def tiny_folder(request, tmp_path_factory) -> Path:
    return _save_tiny(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    return _save_tiny("llama_4kv", tmp_path_factory)


def _settings(model: str | None, world: int = 2, data_backend: str = "") -> RankSettings:
    cores, threads, _ = core_placement(world, sorted(os.sched_getaffinity(0)))
    return RankSettings(
        model=model,
        dtype="float32",
        attention="torch",
        linear="aten",
        threads=threads,
        world=world,
        cores=cores,
        data_backend=data_backend,
        **POOL,
    )


def _one_rank(model: str | None):
    config, module = load_model(model, torch.float32)
    return build_executor(
        config,
        module,
        None,
        device="cpu",
        dtype=torch.float32,
        attention="torch",
        linear="aten",
        **POOL,
    )


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (7, 29, 45)]


def _run(executor, prompts):
    runner = GreedyRunner(executor, ContiguousSlots(4, 512, first_slot=16))
    logits = runner.prefill_logits(prompts, chunk=16)
    return logits, runner.generate(prompts, 12, chunk=16)


@pytest.fixture
def two_ranks():
    """launch(settings) -> a ParallelExecutor; the ranks are stopped afterwards."""
    started = []

    def start(model: str | None, data_backend: str = ""):
        settings = _settings(model, data_backend=data_backend)
        group, processes = launch(settings)
        started.append(processes)
        config, local = build_rank(settings, group)
        return ParallelExecutor(local, group), processes

    yield start
    for processes in started:
        stop_ranks(processes)


def test_two_ranks_equal_one_rank(tiny_folder, two_ranks):
    config = load_config(tiny_folder)
    prompts = _prompts(config.vocab)
    tp, _ = two_ranks(str(tiny_folder))
    split_logits, split_tokens = _run(tp, prompts)
    whole_logits, whole_tokens = _run(_one_rank(str(tiny_folder)), prompts)
    assert split_logits.shape == (len(prompts), ODD_VOCAB)
    assert rel_l2(split_logits, whole_logits) < 1e-5
    assert split_tokens == whole_tokens
    # the shares: half the query heads, half or a copy of the KV heads, half the MLP
    local = tp.local.config
    assert local.num_heads * 2 == config.num_heads
    assert local.num_kv_heads == max(1, config.num_kv_heads // 2)
    assert local.intermediate * 2 == config.intermediate
    assert tp.local.kv_cache.num_kv_heads == local.num_kv_heads


class _CommandsOnly:
    """A control group that broadcasts rank 0's commands and refuses any other collective."""

    def __init__(self, pg) -> None:
        self.pg = pg
        self.broadcasts = 0

    def broadcast(self, *args):
        self.broadcasts += 1
        return self.pg.broadcast(*args)

    def __getattr__(self, name: str):
        raise AssertionError(f"a step's {name} went over the control group")


def test_a_data_group_of_its_own_carries_every_step_collective(llama_folder, two_ranks):
    """CUDA ranks sum and gather over NCCL beside the gloo control group; here a second gloo
    group stands in for NCCL (the same formation, under the store's "data/" prefix): steps
    with the control group refusing all but commands equal the whole model."""
    prompts = _prompts(load_config(llama_folder).vocab)
    tp, _ = two_ranks(str(llama_folder), data_backend="gloo")
    assert tp.group.data_backend == "gloo" and tp.group.data_pg is not tp.group.pg
    control = tp.group.pg = _CommandsOnly(tp.group.pg)
    split_logits, split_tokens = _run(tp, prompts)
    whole_logits, whole_tokens = _run(_one_rank(str(llama_folder)), prompts)
    assert split_tokens == whole_tokens
    assert rel_l2(split_logits, whole_logits) < 1e-5
    assert control.broadcasts > 0  # the commands still went this way


def test_cuda_ranks_take_a_gpu_each_and_need_nccl():
    assert cuda_gpus(2, 2) == [0, 1] and cuda_gpus(2, 8) == [0, 1]
    with pytest.raises(ValueError, match="2 tensor-parallel ranks .* need a GPU each; .* 1 "):
        cuda_gpus(2, 1)
    store = torch.distributed.HashStore()
    with pytest.raises(TensorParallelError, match="backend must be one of"):
        data_group(store, 0, 1, "mpi", "127.0.0.1")
    if not torch.distributed.is_nccl_available():  # a CPU build: named, not a crash
        with pytest.raises(TensorParallelError, match="has no NCCL"):
            data_group(store, 0, 1, "nccl", "127.0.0.1")


class _ReportingDataGroup:
    """NCCL's side of a data group as the runner sees it: `get_error` (what its watchdog
    found) and `abort`."""

    def __init__(self, group: TpGroup) -> None:
        self.group = group
        self.error = SimpleNamespace(name="SUCCESS")
        self.broken_at_abort: list = []  # the group's `broken` each time abort ran

    def get_error(self):
        return self.error

    def abort(self) -> None:
        self.broken_at_abort.append(self.group.broken)


def _one_rank_group() -> TpGroup:
    store = torch.distributed.HashStore()
    group = TpGroup(gloo_group(store, 0, 1, "127.0.0.1"), 0, 1, store)
    group.check()  # one group, healthy: nothing to report
    group.data_pg, group.data_backend = _ReportingDataGroup(group), "nccl"
    return group


def test_a_failure_the_data_group_reports_fails_the_step_and_breaks_the_group():
    """NCCL tells its watchdog, not the step waiting on it, that a collective failed: the
    step's results count only after `check`, which then breaks the group."""
    group = _one_rank_group()
    group.check()
    group.data_pg.error = SimpleNamespace(name="REMOTE_ERROR")
    with pytest.raises(TensorParallelError, match="nccl data group reports REMOTE_ERROR"):
        group.check()
    with pytest.raises(TensorParallelError, match="broken"):
        group.control_all_reduce(torch.ones(1))


def test_an_abort_breaks_the_group_before_it_ends_the_collectives():
    group = _one_rank_group()
    why = "tensor-parallel rank 1 exited with code -9"
    group.abort(why)
    assert group.data_pg.broken_at_abort == [why]  # broken first: no step answered after
    with pytest.raises(TensorParallelError, match="rank 1 exited with code -9"):
        group.check()  # the step an abort cut short is not answered


def test_one_gloo_group_is_not_broken_by_an_abort():
    """Without a data group of its own, gloo fails its collectives itself: a step that
    finished them while a rank died stands."""
    store = torch.distributed.HashStore()
    group = TpGroup(gloo_group(store, 0, 1, "127.0.0.1"), 0, 1, store)
    group.abort("tensor-parallel rank 1 exited with code -9")
    assert group.broken is None
    group.check()


def test_the_embedded_gemma_splits_exactly(two_ranks):
    """Gemma 3 270M, fp32: 4 query heads and 1 KV head over 2 ranks, vocabulary 262,144."""
    prompts = [[2, 818, 5279, 529, 7001, 563] * 6, [2, 2063, 17018, 236769]]
    tp, _ = two_ranks(None)
    split_logits, split_tokens = _run(tp, prompts)
    whole_logits, whole_tokens = _run(_one_rank(None), prompts)
    assert rel_l2(split_logits, whole_logits) < 1e-5
    assert split_tokens == whole_tokens


def test_a_rank_outlives_interrupts_but_its_death_breaks_the_group(llama_folder, two_ranks):
    tp, processes = two_ranks(str(llama_folder))
    runner = GreedyRunner(tp, ContiguousSlots(4, 512, first_slot=16))
    runner.prefill_logits([[5, 6, 7]])
    # Ctrl-C and a service manager's SIGTERM belong to the engine's drain: a rank serves on
    for sig in (signal.SIGINT, signal.SIGTERM):
        os.kill(processes[0].pid, sig)
    runner.prefill_logits([[5, 6, 7]])
    assert processes[0].poll() is None
    os.kill(processes[0].pid, signal.SIGKILL)
    processes[0].wait()
    with pytest.raises(TensorParallelError, match="rank 0"):
        runner.prefill_logits([[5, 6, 7, 8]])
    assert tp.group.broken
    with pytest.raises(TensorParallelError, match="broken"):
        runner.prefill_logits([[9]])


def test_a_rank_that_cannot_start_fails_the_launch():
    settings = _settings(None)
    settings.cores = [[0], [10**6]]  # rank 1 cannot be pinned there: it exits before joining
    with pytest.raises(TensorParallelError, match="rank 1 exited with code 1"):
        launch(settings)


def test_what_cannot_be_split_is_named():
    config = load_config(None)  # Gemma 3 270M: 4 heads, 1 KV head, 2048 MLP features
    check_split(config, 4)
    with pytest.raises(TensorParallelError, match="3 ranks: 4 attention heads"):
        check_split(config, 3)
    # 1 KV head over 4 ranks: each rank keeps a copy of the head its queries read
    assert [split_of(config, r, 4).kv_heads for r in range(4)] == [range(0, 1)] * 4


def test_ranks_are_placed_by_numa_node_where_there_are_enough():
    one_node = [[0, 1, 2, 3]]
    assert core_placement(2, [0, 1, 2, 3], one_node)[:2] == ([[0, 1], [2, 3]], 2)
    assert core_placement(4, [0, 1], [[0, 1]])[:2] == ([[], [], [], []], 1)
    two_nodes = [[0, 1, 4, 5], [2, 3, 6, 7]]  # interleaved numbering, as on many servers
    cores, threads, how = core_placement(2, list(range(8)), two_nodes)
    assert cores == two_nodes and threads == 4 and "NUMA node per rank" in how
    # more nodes than ranks: the first ones, as many cores each as the smallest
    assert core_placement(2, [0, 1, 2], [[0, 1], [2], [3]])[:2] == ([[0], [2]], 1)
