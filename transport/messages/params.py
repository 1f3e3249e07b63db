"""`GenerationParams`: the one parameter type of a generation, and its one validator.

Clients send it (the HTTP gateway builds it from OpenAI fields, ZeroMQ clients send it
as is), the tokenizer validates it once with `validate_params` (bad input becomes a clear
error naming the field and changes nothing), the scheduler reads its limits and the model
runner derives its sampler state from it. Nothing downstream re-validates: the limits
below are the only ones.
"""

from __future__ import annotations

import math
from typing import Final

import msgspec

MAX_TEMPERATURE: Final = 2.0
MAX_REPETITION_PENALTY: Final = 2.0
MAX_ABS_PENALTY: Final = 2.0  # frequency_penalty and presence_penalty in [-2, 2]
SEED_LIMIT: Final = 2**63  # seeds are in [0, 2^63): a signed 64-bit integer, as OpenAI's
MAX_TOP_LOGPROBS: Final = 20
MAX_STOP_STRINGS: Final = 16
MAX_STOP_STRING_CHARS: Final = 256
MAX_LOGIT_BIAS_ENTRIES: Final = 1024
MAX_ABS_LOGIT_BIAS: Final = 100.0
MAX_CONSTRAINT_CHARS: Final = 256 * 1024  # a schema, regex or grammar's text
MAX_CHOICES: Final = 1024
MAX_CACHE_SALT_CHARS: Final = 256
CONSTRAINT_KINDS: Final = (
    "json_object",
    "json_schema",
    "regex",
    "choice",
    "grammar",
    "structural_tag",
)


class OutputConstraint(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What the output must match, enforced token by token (constrained decoding).

    kind: `json_object` (a JSON object), `json_schema` (spec: the schema as JSON text),
    `regex` (spec), `choice` (exactly one of `choices`), `grammar` (spec: EBNF with a
    `root` rule), `structural_tag` (spec: an xgrammar structural tag as JSON text; tool
    calls use it). Whether the spec compiles is checked where requests enter the engine
    (the tokenizer actor), with the grammar engine itself."""

    kind: str
    spec: str = ""
    choices: list[str] = []


class GenerationParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = {}  # token id -> added to its logit before sampling
    # logprobs of every prompt token after the first, with this many top alternatives
    # (None: off); such a request does not use the prefix cache (its logits are needed)
    prompt_logprobs: int | None = None
    constraint: OutputConstraint | None = None
    # Prefix-cache isolation (vLLM's `cache_salt`): requests share cached KV pages only
    # with requests of the same salt ("" is the shared default namespace).
    cache_salt: str = ""
    # An explicit max_tokens beyond the room the prompt leaves in the context is refused
    # (OpenAI's and vLLM's HTTP APIs); otherwise it is capped at that room.
    max_tokens_strict: bool = False
    # A reasoning parser's name ("": none): the constraint applies once the reasoning ends.
    # The tokenizer wraps it knowing whether the rendered prompt opened the reasoning.
    reasoning_parser: str = ""
    # False: this request never drafts, whatever `[speculative]` says (its output is the
    # same either way; the switch is for measuring and for latency-sensitive callers).
    speculate: bool = True


class InvalidParams(ValueError):
    """A parameter out of range or of the wrong type; the message starts with `field: `."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


def validate_params(p: GenerationParams, vocab_size: int | None = None) -> None:
    """Raise `InvalidParams` for the first field that is mistyped or out of range.

    Types are checked too: a struct built in Python (not decoded from a wire) may hold
    anything. `vocab_size`, when given, bounds `stop_token_ids`.
    """
    try:
        msgspec.convert(msgspec.to_builtins(p), GenerationParams)
    except msgspec.ValidationError as exc:
        text = str(exc)
        what, _, where = text.rpartition(" - at `$.")
        field = where.rstrip("`").split(".")[0].split("[")[0] if where else "params"
        raise InvalidParams(field, what or text) from None

    def check(ok: bool, field: str, why: str) -> None:
        if not ok:
            raise InvalidParams(field, why)

    check(p.max_tokens >= 1, "max_tokens", f"must be >= 1, got {p.max_tokens}")
    check(
        0 <= p.min_tokens <= p.max_tokens,
        "min_tokens",
        f"must be in [0, max_tokens], got {p.min_tokens}",
    )
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
    ):
        check(math.isfinite(getattr(p, name)), name, "must be a finite number")
    check(
        0.0 <= p.temperature <= MAX_TEMPERATURE,
        "temperature",
        f"must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {p.temperature}",
    )
    check(0.0 < p.top_p <= 1.0, "top_p", f"must be in (0, 1], got {p.top_p}")
    check(p.top_k >= -1, "top_k", f"must be -1 or 0 (off) or >= 1, got {p.top_k}")
    check(0.0 <= p.min_p <= 1.0, "min_p", f"must be in [0, 1], got {p.min_p}")
    check(
        0.0 < p.repetition_penalty <= MAX_REPETITION_PENALTY,
        "repetition_penalty",
        f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {p.repetition_penalty}",
    )
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(p, name)
        check(
            -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY,
            name,
            f"must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], got {value}",
        )
    check(p.seed is None or 0 <= p.seed < SEED_LIMIT, "seed", f"must be in [0, 2^63), got {p.seed}")
    check(
        0 <= p.top_logprobs <= MAX_TOP_LOGPROBS,
        "top_logprobs",
        f"must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}",
    )
    check(p.top_logprobs == 0 or p.logprobs, "top_logprobs", "top_logprobs > 0 requires logprobs")
    check(len(p.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
    for s in p.stop:
        check(
            0 < len(s) <= MAX_STOP_STRING_CHARS,
            "stop",
            f"stop strings must have 1..{MAX_STOP_STRING_CHARS} characters",
        )
    check(
        len(p.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES,
        "logit_bias",
        f"at most {MAX_LOGIT_BIAS_ENTRIES} entries",
    )
    for t, bias in p.logit_bias.items():
        check(
            math.isfinite(bias) and -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS,
            "logit_bias",
            f"biases must be in [-100, 100], got {bias} for token {t}",
        )
    check(
        p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= MAX_TOP_LOGPROBS,
        "prompt_logprobs",
        f"must be in [0, {MAX_TOP_LOGPROBS}], got {p.prompt_logprobs}",
    )
    check(
        len(p.cache_salt) <= MAX_CACHE_SALT_CHARS,
        "cache_salt",
        f"at most {MAX_CACHE_SALT_CHARS} characters, got {len(p.cache_salt)}",
    )
    if p.constraint is not None:
        _check_constraint(p.constraint, p.ignore_eos, check)
    if vocab_size is not None:
        for t in p.stop_token_ids:
            check(
                0 <= t < vocab_size,
                "stop_token_ids",
                f"token id {t} outside the vocabulary [0, {vocab_size})",
            )
        for t in p.logit_bias:
            check(
                0 <= t < vocab_size,
                "logit_bias",
                f"token id {t} outside the vocabulary [0, {vocab_size})",
            )


def _check_constraint(c: OutputConstraint, ignore_eos: bool, check) -> None:
    check(
        c.kind in CONSTRAINT_KINDS,
        "constraint",
        f"kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {c.kind!r}",
    )
    check(
        len(c.spec) <= MAX_CONSTRAINT_CHARS,
        "constraint",
        f"spec is {len(c.spec)} characters; at most {MAX_CONSTRAINT_CHARS}",
    )
    needs_spec = c.kind in ("json_schema", "regex", "grammar", "structural_tag")
    check(bool(c.spec) or not needs_spec, "constraint", f"{c.kind} needs a spec")
    if c.kind == "choice":
        check(
            0 < len(c.choices) <= MAX_CHOICES,
            "constraint",
            f"choice needs 1..{MAX_CHOICES} strings, got {len(c.choices)}",
        )
        check(all(c.choices), "constraint", "choice strings must not be empty")
    else:
        check(not c.choices, "constraint", f"choices are only for kind choice, not {c.kind}")
    # The grammar ends on an end-of-sequence token; ignore_eos would leave nothing to emit.
    check(not ignore_eos, "ignore_eos", "cannot be combined with a constrained output")
