"""What the application knows about the model before any actor starts: the names it is
served under and its generation defaults (read from files, no torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from actors.app.config import ConfigError, EngineConfig

EMBEDDED_MODEL_NAME = "gemma-3-270m"

# generation_config.json keys -> the request field they default (as vLLM maps them)
GENERATION_DEFAULT_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def served_names(cfg: EngineConfig) -> list[str]:
    """The names requests may use; the first one is reported in /v1/models first.

    Default: the model path exactly as given (as vLLM serves it) and the file stem or
    folder name, or `gemma-3-270m` for the embedded model.
    """
    names: list[str] = []
    if cfg.server.model_name:
        names.append(cfg.server.model_name)
    elif cfg.model.path:
        given = cfg.model.path.rstrip("/")
        names.append(given)
        stem = Path(given).stem if given.endswith(".gguf") else Path(given).name
        names.append(stem)
    else:
        names.append(EMBEDDED_MODEL_NAME)
    names += cfg.server.aliases
    return list(dict.fromkeys(n for n in names if n))


def generation_defaults(cfg: EngineConfig) -> dict[str, Any]:
    """Request-field defaults from the model's generation_config.json ({} for none)."""
    choice = cfg.model.generation_config
    if choice in ("none", "vllm", ""):
        return {}
    if choice == "auto":
        if not cfg.model.path:
            return {}
        model = Path(cfg.model.path)
        folder = model.parent if model.suffix == ".gguf" else model
    else:
        folder = Path(choice)
        if not (folder / "generation_config.json").is_file():
            raise ConfigError(f"model.generation_config: no generation_config.json in {folder}")
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"model.generation_config: cannot read {path}: {exc}") from None
    defaults = {}
    for key, field in GENERATION_DEFAULT_KEYS.items():
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            defaults[field] = value
    if data.get("do_sample") is False:
        defaults["temperature"] = 0.0  # HF greedy
    return defaults


def read_chat_template(cfg: EngineConfig) -> str | None:
    """The chat template to use instead of the model's: a file's text, or the text given."""
    value = cfg.server.chat_template
    if not value:
        return None
    path = Path(value)
    if "{" not in value and len(value) < 4096 and path.exists():
        return path.read_text()
    if "{" not in value:
        raise ConfigError(f"server.chat_template: {value!r} is neither a file nor a template")
    return value
