"""A real harness as the acceptance test: lm-eval's `local-completions` against the live
server and lm-eval's own `hf` backend on the same GGUF (fp32) score the same, on a
loglikelihood task (multiple choice, via echo + logprobs) and a generate-until task, both
from small task files written here (no hub access)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.server_fixtures import MODEL_NAME

pytestmark = [pytest.mark.model, pytest.mark.slow]

MC_DOCS = [
    {
        "question": "The capital of France is",
        "choices": [" Paris", " Rome", " Berlin"],
        "answer": 0,
    },
    {"question": "Two plus two equals", "choices": [" four", " seven", " nine"], "answer": 0},
    {"question": "The sun rises in the", "choices": [" west", " east", " north"], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": [" Celsius", " Kelvin"], "answer": 0},
    {"question": "A baby cat is called a", "choices": [" puppy", " kitten", " calf"], "answer": 1},
    {"question": "The opposite of hot is", "choices": [" cold", " loud", " tall"], "answer": 0},
]
GEN_DOCS = [
    {"question": "Count: 1, 2, 3, 4,", "answer": " 5, 6"},
    {"question": "Monday, Tuesday,", "answer": " Wednesday,"},
    {"question": "A, B, C, D,", "answer": " E, F"},
    {"question": "The capital of Italy is", "answer": " Rome"},
]


def write_tasks(root: Path) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "kvactor_mc.yaml").write_text(f"""task: kvactor_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (tasks / "kvactor_gen.yaml").write_text(f"""task: kvactor_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return tasks


def run(model: str, model_args: dict, tasks: Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["kvactor_mc", "kvactor_gen"],
        task_manager=TaskManager(include_path=str(tasks)),
        batch_size=1,
        log_samples=True,
    )
    return out


def test_local_completions_scores_equal_hf(server, tmp_path, monkeypatch):
    from kernels.gguf_loader import artifact_dir, default_model_path

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", server.api_key)
    tasks = write_tasks(tmp_path)
    gguf = default_model_path()
    ours = run(
        "local-completions",
        {
            "base_url": f"{server.base_url}/v1/completions",
            "model": MODEL_NAME,
            "tokenizer_backend": "huggingface",
            "tokenizer": str(artifact_dir(gguf)),  # the same tokenizer.json the server uses
            "add_bos_token": True,
            "max_retries": 1,
            "num_concurrent": 1,
        },
        tasks,
    )
    hf = run(
        "hf",
        {
            "pretrained": str(gguf.parent),
            "gguf_file": gguf.name,
            "device": "cpu",
            "dtype": "float32",
            "tokenizer": str(artifact_dir(gguf)),
        },
        tasks,
    )
    for task, metric in (("kvactor_mc", "acc,none"), ("kvactor_gen", "exact_match,none")):
        assert ours["results"][task][metric] == pytest.approx(hf["results"][task][metric]), (
            task,
            ours["results"][task],
            hf["results"][task],
        )
    # Per document, the loglikelihood of every choice agrees within rounding.
    for a, b in zip(ours["samples"]["kvactor_mc"], hf["samples"]["kvactor_mc"]):
        ll_ours = [r[0][0] for r in a["resps"]]
        ll_hf = [r[0][0] for r in b["resps"]]
        assert ll_ours == pytest.approx(ll_hf, abs=1e-3)
    for a, b in zip(ours["samples"]["kvactor_gen"], hf["samples"]["kvactor_gen"]):
        assert a["filtered_resps"] == b["filtered_resps"]
    assert ours["results"]["kvactor_mc"]["acc,none"] > 0.4  # it reads the questions
