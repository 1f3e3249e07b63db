"""The offline batch API: a list of prompts in, results with ids, text, reasons, timings out."""

from __future__ import annotations

import pytest

from actors.app.serving import generate_offline
from tests.e2e.engine_fixtures import small_config
from transport.messages.engine import GenerationParams


@pytest.mark.model
def test_generate_offline_returns_results_in_prompt_order():
    prompts = ["Count with me: 1, 2, 3, 4, 5,", "The alphabet: A, B, C, D,", [2, 818, 5279]]
    params = [
        GenerationParams(max_tokens=6, temperature=0.0),
        GenerationParams(max_tokens=4, temperature=0.0, stop=[" F"]),
        GenerationParams(max_tokens=3, temperature=0.0),
    ]
    results = generate_offline(prompts, params, config=small_config(kv__num_pages=128))
    assert [r.finish_reason for r in results] == ["length", "stop", "length"]
    assert results[0].text.startswith(" 6, 7") and len(results[0].token_ids) == 6
    assert results[1].text == " E,"
    assert results[2].prompt_tokens == 3 and len(results[2].token_ids) == 3
    for r in results:
        assert 0 < r.ttft_s <= r.total_s


@pytest.mark.model
def test_engines_run_one_after_another_do_not_pile_up_their_weights(monkeypatch):
    """A stopped runner lets go of its weights and KV pool at once: the actor and its cell
    reference each other (as does the LM head with its kernels), so otherwise each engine's
    model and LM head stay until a full collection (which large tensors never trigger) and
    a process making engines in turn grows by a model each time."""
    import gc
    import weakref

    import kernels.models
    from kernels.lm_head import LmHead

    models: list[weakref.ref] = []
    load = kernels.models.load_model

    def recording_load(*args, **kwargs):
        config, model = load(*args, **kwargs)
        models.append(weakref.ref(model))
        return config, model

    monkeypatch.setattr(kernels.models, "load_model", recording_load)
    params = GenerationParams(max_tokens=2, temperature=0.0)
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            results = generate_offline(["1, 2, 3,"], params, config=small_config())
            assert len(results[0].token_ids) == 2
        alive = [ref() is not None for ref in models]
        heads = sum(type(o) is LmHead for o in gc.get_objects())
        # each runner froze the survivors of its load (actors/runtime/gc_freeze.py) and
        # thawed them at its stop: nothing stays out of the collector's reach
        frozen = gc.get_freeze_count()
    finally:
        gc.enable()
    assert frozen == 0, f"{frozen} objects still frozen after every engine stopped"
    assert len(models) == 3
    assert sum(alive) <= 1, f"models still held after their engines stopped: {alive}"
    assert heads <= 1, f"{heads} LM heads (each holding the vocabulary table) still held"
