"""The tokenizer of a model source, as a fast `tokenizers.Tokenizer` plus chat metadata.

For a GGUF the tokenizer is built once from the file's vocabulary with transformers' GGUF
converter (~15 s for Gemma's 262k tokens) and cached next to it as `tokenizer.json` and
`tokenizer_config.json` (chat template, bos/eos tokens); later loads read the JSON (~1 s).
A Hugging Face folder provides those files itself. Gemma 3 GGUFs without an embedded chat
template get Gemma 3's standard template (the one google/gemma-3-*-it ship).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from kernels.gguf_loader import CONVERTER_VERSION, artifact_dir, default_model_path, file_identity

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate '
    'user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


@dataclass(frozen=True)
class TokenizerBundle:
    """A tokenizer with the special ids and chat template a server needs.

    `encode(text)` adds BOS when the model expects it (`add_bos`); a rendered chat already
    starts with the BOS token text, so encode it with `add_special_tokens=False`.
    """

    tokenizer: Tokenizer
    chat_template: str | None
    bos_id: int | None
    eos_ids: list[int]
    pad_id: int | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The chat template applied to `messages` (jinja2 sandbox, like transformers)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return _compiled_template(self.chat_template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


_TEMPLATE_CACHE: dict[str, Any] = {}


def _compiled_template(source: str):
    template = _TEMPLATE_CACHE.get(source)
    if template is None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        template = env.from_string(source)
        _TEMPLATE_CACHE[source] = template
    return template


def load_tokenizer(model_dir_or_gguf: str | Path | None = None) -> TokenizerBundle:
    """Tokenizer for a GGUF file, a folder (HF files or one GGUF), or None (embedded model)."""
    if model_dir_or_gguf is None:
        return _load_gguf_tokenizer(default_model_path())
    path = Path(model_dir_or_gguf).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf_tokenizer(path)
    if path.is_dir() and (path / TOKENIZER_FILE).is_file():
        return _bundle_from_folder(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf_tokenizer(ggufs[0])
    raise FileNotFoundError(f"no tokenizer.json or single .gguf in {path}")


def _load_gguf_tokenizer(gguf_path: Path) -> TokenizerBundle:
    cache = artifact_dir(gguf_path)
    stamp = f"{CONVERTER_VERSION}:{file_identity(gguf_path)}"
    config_file = cache / TOKENIZER_CONFIG_FILE
    valid = False
    if config_file.is_file() and (cache / TOKENIZER_FILE).is_file():
        try:
            valid = json.loads(config_file.read_text()).get("kvactor_stamp") == stamp
        except ValueError:
            valid = False
    if not valid:
        _convert_gguf_tokenizer(gguf_path, cache, stamp)
    return _bundle_from_folder(cache)


def _convert_gguf_tokenizer(gguf_path: Path, out_dir: Path, stamp: str) -> None:
    """Build tokenizer.json + tokenizer_config.json from a GGUF via transformers' converter."""
    from transformers import AutoTokenizer

    from kernels.gguf_loader import load_gguf_config

    print(f"[kvactor] building tokenizer from {gguf_path.name} (one time)", file=sys.stderr)
    hf_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config = load_gguf_config(gguf_path)
    chat_template = hf_tok.chat_template
    if not chat_template and config.arch == "gemma3":
        chat_template = GEMMA3_CHAT_TEMPLATE
    tokenizer_config = {
        "kvactor_stamp": stamp,
        "chat_template": chat_template,
        "bos_token": hf_tok.bos_token,
        "eos_token": hf_tok.eos_token,
        "pad_token": hf_tok.pad_token,
        "add_bos_token": bool(getattr(hf_tok, "add_bos_token", True)),
        "eos_token_ids": list(config.eos_ids),
    }
    _atomic_write(out_dir / TOKENIZER_FILE, hf_tok.backend_tokenizer.to_str())
    # Written last: its stamp marks the pair as complete.
    _atomic_write(out_dir / TOKENIZER_CONFIG_FILE, json.dumps(tokenizer_config, indent=1))


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _bundle_from_folder(folder: Path) -> TokenizerBundle:
    tokenizer = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
    cfg: dict[str, Any] = {}
    if (folder / TOKENIZER_CONFIG_FILE).is_file():
        cfg = json.loads((folder / TOKENIZER_CONFIG_FILE).read_text())
    chat_template = cfg.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        chat_template = (folder / "chat_template.jinja").read_text()
    if isinstance(chat_template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in chat_template}
        chat_template = named.get("default") or next(iter(named.values()), None)
    bos_token = _token_text(cfg.get("bos_token"))
    eos_token = _token_text(cfg.get("eos_token"))
    pad_token = _token_text(cfg.get("pad_token"))
    bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
    pad_id = tokenizer.token_to_id(pad_token) if pad_token else None
    eos_ids = [int(i) for i in cfg.get("eos_token_ids", [])]
    if not eos_ids:
        eos_ids = _folder_eos_ids(folder)
    if eos_token and (eos_id := tokenizer.token_to_id(eos_token)) is not None:
        if eos_id not in eos_ids:
            eos_ids.insert(0, eos_id)
    add_bos = _post_processor_adds_bos(tokenizer, bos_id)  # what encode() really does
    return TokenizerBundle(
        tokenizer=tokenizer,
        chat_template=chat_template,
        bos_id=bos_id,
        eos_ids=eos_ids,
        pad_id=pad_id,
        bos_token=bos_token,
        eos_token=eos_token,
        add_bos=add_bos,
        extra={"source": str(folder)},
    )


def _folder_eos_ids(folder: Path) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = folder / name
        if not file.is_file():
            continue
        value = json.loads(file.read_text()).get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return ids


def _post_processor_adds_bos(tokenizer: Tokenizer, bos_id: int | None) -> bool:
    if bos_id is None:
        return False
    ids = tokenizer.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_id
