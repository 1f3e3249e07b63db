"""The tokenizer actor: prompts in, text out.

Owns the tokenizer, the chat template and one incremental detokenizer per
live request. A `GenerateRequest` call is validated and tokenized here (bad
input is an ErrorReply and changes nothing), then submitted to the scheduler.
Each step's `TokenBatch` from the scheduler becomes one `OutputBatch` per
destination actor. Stop strings are matched here: the text up to the stop is
emitted, and the scheduler is told to end the request.

Invariants (one client never stalls or strands another):
- Nothing is accepted and then lost: the submit to the scheduler is a call, and `Accepted`
  is the reply only once the scheduler has queued the request; a failed hand-off undoes the
  request here (stream, in-flight slot, session turn) and the client gets an error.
- A constraint's grammar is compiled beside the mailbox (`reply_later`): the mailbox keeps
  serving other requests' tokens meanwhile. A compile is bounded in time and in bytes (a
  400 naming the limit), one compile serves every request of the same constraint, and the
  compiled grammars kept here are bounded in bytes. The runner gets each grammar once, by
  key (`LoadGrammar`, acknowledged), before a request naming that key is submitted.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import anyio
import msgspec

from actors.reasoning import reasoning_format, wrap_constraint
from actors.runtime import Actor, RemoteError, UnexpectedReply
from actors.tokenizer.chat_template import ChatTemplateError, render_chat, render_time_limit
from actors.tokenizer.detokenizer import IncrementalDetokenizer
from actors.tokenizer.validation import (
    ERR_INVALID_REQUEST,
    ERR_OVERLOADED,
    ERR_UNAVAILABLE,
    BadRequest,
    ContextTooLong,
    Overloaded,
    Unavailable,
    check_fits_kv_pool,
    check_params,
    check_prompt_ids,
    check_prompt_size,
    check_prompt_source,
    fit_to_context,
    refusal_code,
)
from actors.tool_calls import resolve_tool_format, template_knows_tools, tool_format
from kernels.grammar import ByteLRU
from transport.channel import ChannelClosed
from transport.messages.base import Message
from transport.messages.control import ErrorReply
from transport.messages.engine import (
    AbortGeneration,
    Accepted,
    DetokenizeReply,
    DetokenizeRequest,
    EndRequests,
    FinishReason,
    GenerateRequest,
    GenerationParams,
    NewRequest,
    OutputBatch,
    OutputChunk,
    SubmitRequests,
    TokenBatch,
    TokenizeReply,
    TokenizeRequest,
    TokenizerInfo,
    TokenizerInfoRequest,
    TokenLogprob,
)
from transport.messages.runner import GrammarLoaded, LoadGrammar
from transport.messages.sessions import BeginTurn, BeginTurnReply, EndTurn

OFFLOAD_ENCODE_CHARS = 8192  # longer prompts are tokenized in a worker thread
TEMPLATE_TIMEOUT_S = 5.0  # a chat template that renders longer is refused
# Constrained output (engine.grammar_* in the config): a compile slower or larger than this
# is refused; compiled grammars kept here at most (bytes).
GRAMMAR_COMPILE_TIMEOUT_S = 5.0
GRAMMAR_MAX_BYTES = 16 << 20
GRAMMAR_CACHE_BYTES = 256 << 20
# Grammars compiled at once. A compile cannot be interrupted: one that outlives its request's
# timeout finishes in the background (and is cached), holding its slot until then, so slow
# compiles never pile up threads.
GRAMMAR_COMPILERS = 2
GRAMMAR_REFUSALS_KEPT = 1024  # constraints refused for good (invalid, too large), remembered
HANDOFF_TIMEOUT_S = 20.0  # the scheduler or the runner must take a hand-off within this


@dataclass
class _Stream:
    client_rid: str
    reply_to: str
    detok: IncrementalDetokenizer
    params: GenerationParams
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    stopped: bool = False  # a stop string or id ended the text; later tokens are dropped
    prompt_ids: list[int] | None = None  # kept only when prompt logprobs are asked for
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # not yet sent
    queue_time_s: float = -1.0
    session_id: str = ""  # a session's turn: the sessions actor hears when it ends


@dataclass
class _Pending:
    """A request between its acceptance checks and its submit (its client id is reserved)."""

    aborted: bool = False  # the client left meanwhile: it is not submitted


@dataclass
class _Compile:
    """One grammar compile in flight, shared by every request of that constraint."""

    done: anyio.Event = field(default_factory=anyio.Event)
    data: bytes | None = None  # the serialized grammar, when it compiled within the limits
    error: str = ""  # else why not (a BadRequest message)


class SessionRefused(Exception):
    """The sessions actor refused the turn (unknown session, one already running, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# The prompt's last tokens go back with `Accepted` as text: output parsers (reasoning) need to
# know whether the prompt left a tag open (a template that opens `<think>` for the model).
PROMPT_TAIL_TOKENS = 8
RUNNER_FAILED_TEXT = "the model runner failed while running this request; retry it"


class TokenizerActor(Actor):
    inbox = (
        GenerateRequest
        | AbortGeneration
        | TokenBatch
        | TokenizeRequest
        | DetokenizeRequest
        | TokenizerInfoRequest
    )

    def __init__(
        self,
        context_len: int,
        model: str | None = None,
        scheduler: str = "scheduler",
        sessions: str | None = "sessions",
        chat_template: str | None = None,
        max_in_flight: int = 0,
        template_timeout_s: float = TEMPLATE_TIMEOUT_S,
        runner: str | None = "runner",
        grammar_compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S,
        grammar_max_bytes: int = GRAMMAR_MAX_BYTES,
        grammar_cache_bytes: int = GRAMMAR_CACHE_BYTES,
        tool_call_parser: str = "auto",
        kv_tokens: int = 0,
    ):
        # The KV pool's positions (kv.num_pages x kv.page_size; 0: not known here): a prompt
        # it cannot hold, even alone, is refused at submission (400) instead of waiting and
        # then ending with no token.
        self.kv_tokens = kv_tokens
        self.tool_call_parser = tool_call_parser  # the format tool-call history is written in
        self.template_timeout_s = template_timeout_s
        self.runner_name = runner
        self.grammar_compile_timeout_s = grammar_compile_timeout_s
        self.grammar_max_bytes = grammar_max_bytes
        self._grammar_cache = ByteLRU(grammar_cache_bytes)  # key -> serialized grammar
        self._grammar_refusals: OrderedDict[str, str] = OrderedDict()  # key -> why
        self._compiles: dict[str, _Compile] = {}  # key -> the compile in flight
        self._handoffs: dict[str, anyio.Lock] = {}  # key -> its hand-over to the runner
        self._compile_slots = anyio.CapacityLimiter(GRAMMAR_COMPILERS)
        self._grammar_engine = None  # kernels.grammar.GrammarEngine, built on first use
        self._grammar_engine_lock = anyio.Lock()
        self._pending: dict[str, _Pending] = {}  # client_rid -> a request not yet submitted
        self.model_path = model
        self.context_len = context_len
        # Requests accepted and not finished, at most (0: unbounded). Beyond it a request is
        # refused at once (HTTP 429), instead of queueing for minutes.
        self.max_in_flight = max_in_flight
        self.chat_template_override = chat_template
        self.scheduler_name = scheduler
        self.sessions_name = sessions
        self._turn_ends: list[EndTurn] = []  # sent after the report that ended them
        self.streams: dict[int, _Stream] = {}
        self.by_client: dict[str, int] = {}
        self._rids = itertools.count(1)

    async def on_start(self) -> None:
        from kernels.tokenizer_loader import load_tokenizer

        self.bundle = await anyio.to_thread.run_sync(load_tokenizer, self.model_path)
        self.vocab = self.bundle.vocab_size
        self._eos_ids = frozenset(self.bundle.eos_ids)
        self.chat_template = self.chat_template_override or self.bundle.chat_template
        # The format tool-call history is written in ("auto": the template's own; the serving
        # engine resolves it once, before the actors start, and passes the name).
        self.tool_format = tool_format(
            resolve_tool_format(self.tool_call_parser, self.chat_template)
        )
        # The longest token's text, for refusing oversized prompts before tokenizing them
        # (a token's text is at most its piece; a piece's ▁ prefix stands for one space).
        self.max_token_chars = max(
            (len(piece) for piece in self.bundle.tokenizer.get_vocab()), default=1
        )
        self.scheduler = self.ref(self.scheduler_name)
        self.sessions = self.optional_ref(self.sessions_name)  # None: no sessions here
        self.runner = self.optional_ref(self.runner_name)  # None: no runner to hand grammars

    # ---- requests ------------------------------------------------------------------------
    async def handle(self, msg, sender):
        if isinstance(msg, TokenBatch):
            await self._on_tokens(msg)
            return None
        if isinstance(msg, GenerateRequest):
            try:
                pending = self._admit(msg)
            except (BadRequest, Overloaded) as exc:
                return _refusal(exc)
            if msg.params.constraint is not None:
                # A compile may take seconds: it runs beside the mailbox, which goes on.
                return self.reply_later(self._generate, msg, pending)
            return await self._generate(msg, pending)
        if isinstance(msg, TokenizeRequest):
            try:
                return await self._tokenize(msg)
            except BadRequest as exc:
                return ErrorReply(code=refusal_code(exc), message=str(exc))
        if isinstance(msg, DetokenizeRequest):
            try:
                check_prompt_ids(msg.tokens, self.vocab)
            except BadRequest as exc:
                return ErrorReply(code=ERR_INVALID_REQUEST, message=str(exc))
            return DetokenizeReply(prompt=self.bundle.tokenizer.decode(msg.tokens))
        if isinstance(msg, TokenizerInfoRequest):
            return self._info()
        if isinstance(msg, AbortGeneration):
            for c in msg.client_rids:
                if c in self._pending:
                    self._pending[c].aborted = True  # not submitted yet: it never will be
            rids = [self.by_client[c] for c in msg.client_rids if c in self.by_client]
            if rids:
                await self.scheduler.send(EndRequests(rids=rids, reason="abort"))
            return None
        raise TypeError(f"unexpected message {type(msg).__name__}")

    async def encode_prompt(self, msg: GenerateRequest) -> list[int]:
        check_prompt_source(msg)
        if msg.prompt_ids is not None:
            check_prompt_ids(msg.prompt_ids, self.vocab)
            return list(msg.prompt_ids)
        if msg.prompt is not None:
            check_prompt_size(len(msg.prompt), self.context_len, self.max_token_chars)
            return await self._encode(msg.prompt, True)
        text = await self._render(
            msg.messages,
            msg.add_generation_prompt,
            msg.continue_final_message,
            msg.chat_template_kwargs,
            msg.tools,
        )
        check_prompt_size(len(text), self.context_len, self.max_token_chars)
        return await self._encode(text, False)

    async def _render(
        self,
        messages,
        add_generation_prompt: bool,
        continue_final: bool,
        kwargs: dict,
        tools: list[dict] | None = None,
    ) -> str:
        """The chat template's text for `messages`. With `continue_final`, the last message
        (the assistant's, as vLLM's continue_final_message) is left open for the model."""
        if not self.chat_template:
            raise BadRequest("this model has no chat template; use a plain prompt")
        if continue_final and add_generation_prompt:
            raise BadRequest(
                "continue_final_message: cannot be combined with add_generation_prompt"
            )
        dicts = [_msg_dict(m) for m in messages]
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"}
        if reserved & set(kwargs):
            raise BadRequest(
                f"chat_template_kwargs: {sorted(reserved & set(kwargs))} are set by the engine"
            )
        if tools or any(d["role"] == "tool" or d.get("tool_calls") for d in dicts):
            native = template_knows_tools(self.chat_template)
            dicts, extra = self.tool_format.prompt_messages(dicts, list(tools or []), native)
            kwargs = {**kwargs, **extra}

        def render() -> str:
            # The render stops itself at this limit (in its own thread, which is then free);
            # the wait below is only the outer bound.
            with render_time_limit(self.template_timeout_s):
                return render_chat(
                    self.chat_template,
                    dicts,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bundle.bos_token or "",
                    eos_token=self.bundle.eos_token or "",
                    **kwargs,
                )

        # Off the event loop the gateway and the scheduler share, and bounded in time; any
        # failure of a template (not only jinja's own errors) is the client's bad request.
        try:
            with anyio.fail_after(self.template_timeout_s):
                text = await anyio.to_thread.run_sync(render, abandon_on_cancel=True)
        except ChatTemplateError as exc:
            raise BadRequest(f"messages: {exc}") from None
        except TimeoutError:
            raise BadRequest(
                f"messages: the chat template did not render within {self.template_timeout_s:g} s"
            ) from None
        except Exception as exc:  # ZeroDivisionError, OverflowError, RecursionError, ...
            raise BadRequest(
                f"messages: the chat template failed: {type(exc).__name__}: {exc}"[:1000]
            ) from None
        if continue_final:
            final = dicts[-1].get("content")
            final = (
                final if isinstance(final, str) else "".join(p.get("text", "") for p in final or [])
            )
            at = text.rfind(final) if final else -1
            if at < 0:
                raise BadRequest(
                    "continue_final_message: the template does not show the final message's text"
                )
            text = text[: at + len(final)]
        return text

    async def _tokenize(self, msg: TokenizeRequest) -> TokenizeReply:
        """Bounded as a prompt is (its characters before tokenizing, its tokens after: a 400
        beyond the context); the token strings, when asked for, are made in this same call."""
        if (msg.prompt is None) == (msg.messages is None):
            raise BadRequest("give exactly one of prompt, messages")
        if msg.prompt is not None:
            check_prompt_size(len(msg.prompt), self.context_len, self.max_token_chars)
            ids = await self._encode(msg.prompt, msg.add_special_tokens)
        else:
            text = await self._render(
                msg.messages,
                msg.add_generation_prompt,
                msg.continue_final_message,
                msg.chat_template_kwargs,
                msg.tools,
            )
            check_prompt_size(len(text), self.context_len, self.max_token_chars)
            ids = await self._encode(text, False)
        if len(ids) > self.context_len:
            raise ContextTooLong(
                f"prompt is {len(ids)} tokens; this model's context is {self.context_len} tokens"
            )
        strs: list[str] = []
        if msg.return_token_strs:  # the vocabulary's pieces, as vLLM's convert_ids_to_tokens
            strs = [self.bundle.tokenizer.id_to_token(t) or "" for t in ids]
        return TokenizeReply(tokens=ids, token_strs=strs, max_model_len=self.context_len)

    def _info(self) -> TokenizerInfo:
        b = self.bundle
        added = b.tokenizer.get_added_tokens_decoder()
        pad = b.tokenizer.id_to_token(b.pad_id) if b.pad_id is not None else None
        return TokenizerInfo(
            tokenizer_class="PreTrainedTokenizerFast",  # what transformers loads it as
            model_max_length=self.context_len,
            vocab_size=b.vocab_size,
            bos_token=b.bos_token,
            eos_token=b.eos_token,
            pad_token=pad,
            add_bos_token=b.add_bos,
            chat_template=self.chat_template,
            added_tokens_decoder={
                str(i): {"content": t.content, "special": t.special} for i, t in added.items()
            },
        )

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # Long texts are encoded off the event loop so the scheduler and the gateway,
        # which share it, keep running while a big prompt is tokenized.
        if len(text) < OFFLOAD_ENCODE_CHARS:
            return self.bundle.encode(text, add_special_tokens=add_special_tokens)
        return await anyio.to_thread.run_sync(self.bundle.encode, text, add_special_tokens)

    def _admit(self, msg: GenerateRequest) -> _Pending:
        """The checks that need no waiting; reserves the client id until the request is
        submitted or refused (`_generate` releases it)."""
        if msg.client_rid in self.by_client or msg.client_rid in self._pending:
            raise BadRequest(f"request id {msg.client_rid!r} is already running")
        in_flight = len(self.streams) + len(self._pending)
        if self.max_in_flight and in_flight >= self.max_in_flight:
            raise Overloaded(f"{in_flight} requests are in the engine already; retry later")
        check_params(msg.params, self.vocab)
        pending = self._pending[msg.client_rid] = _Pending()
        return pending

    async def _generate(self, msg: GenerateRequest, pending: _Pending) -> Message:
        """`Accepted` once the scheduler has the request, else the refusal; either way the
        client id's reservation ends here."""
        try:
            grammar_key = ""
            if msg.params.constraint is not None and not msg.params.reasoning_parser:
                grammar_key = await self._grammar_key(msg.params.constraint)
            return await self._on_generate(msg, pending, grammar_key)
        except (BadRequest, Overloaded, Unavailable, SessionRefused) as exc:
            return _refusal(exc)
        finally:
            if self._pending.get(msg.client_rid) is pending:
                del self._pending[msg.client_rid]

    async def _on_generate(self, msg: GenerateRequest, pending: _Pending, grammar_key: str):
        ids = await self.encode_prompt(msg)
        tail = self.bundle.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        if msg.params.constraint is not None and msg.params.reasoning_parser:
            # Compiled once the prompt is known: whether it opened the reasoning decides the
            # grammar (reason first, or answer at once or after a <think> block).
            grammar_key = await self._grammar_key(_after_reasoning(msg.params, tail))
        p = fit_to_context(msg.params, len(ids), self.context_len)
        check_fits_kv_pool(len(ids), self.kv_tokens)
        rid = next(self._rids)
        if msg.session_id:
            p = await self._begin_turn(msg.session_id, rid, len(ids), p)
        st = _Stream(
            msg.client_rid,
            msg.reply_to,
            IncrementalDetokenizer(
                self.bundle.tokenizer,
                prompt_ids=ids,
                skip_special_tokens=p.skip_special_tokens,
                stop=p.stop,
                stop_token_ids=p.stop_token_ids,
                include_stop_str_in_output=p.include_stop_str_in_output,
            ),
            p,
            len(ids),
            prompt_ids=list(ids) if p.prompt_logprobs is not None else None,
            session_id=msg.session_id,
        )
        try:
            if pending.aborted:
                raise Unavailable("the request was aborted before it started")
            # From here the stream (not the reservation) holds the client id and its slot.
            self.streams[rid] = st
            self.by_client[msg.client_rid] = rid
            del self._pending[msg.client_rid]
            eos = [] if p.ignore_eos else list(self.bundle.eos_ids)
            new = NewRequest(
                rid=rid,
                prompt_ids=ids,
                params=p,
                eos_ids=eos,
                session_id=msg.session_id,
                grammar_key=grammar_key,
            )
            await self._submit(new)
        except BaseException:
            # Never queued: nothing of it stays here, and its session turn is over.
            if self.streams.get(rid) is st:
                del self.streams[rid]
                self.by_client.pop(msg.client_rid, None)
            if msg.session_id:
                await self._end_turn_now(msg.session_id, rid)
            raise
        return Accepted(
            client_rid=msg.client_rid, rid=rid, prompt_tokens=len(ids), prompt_tail=tail
        )

    async def _submit(self, new: NewRequest) -> None:
        """Hand the request to the scheduler, acknowledged: `Unavailable` when it did not
        take it (a message it could not decode, a refusal, no answer)."""
        try:
            await self.scheduler.call(SubmitRequests(reqs=[new]), timeout=HANDOFF_TIMEOUT_S)
        except TimeoutError:
            # It may still arrive: make sure it ends at once if it does.
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                await self.scheduler.send(EndRequests(rids=[new.rid], reason=FinishReason.ABORT))
            raise Unavailable("the scheduler did not take the request in time; retry") from None
        except (RemoteError, UnexpectedReply, ChannelClosed) as exc:
            raise Unavailable(f"the scheduler did not take the request: {exc}"[:1000]) from None

    async def _end_turn_now(self, session_id: str, rid: int) -> None:
        if self.sessions is None:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
            await self.sessions.send(
                EndTurn(session_id=session_id, rid=rid, ok=False, total_tokens=0)
            )

    # ---- grammars --------------------------------------------------------------------------
    async def _grammar_key(self, constraint) -> str:
        """The key of the constraint's compiled grammar, once it is compiled (or found) here
        and held by the runner. `BadRequest` names what is wrong or which limit it broke."""
        from kernels.grammar import constraint_key

        key = constraint_key(constraint.kind, constraint.spec, constraint.choices)
        data = await self._compiled(key, constraint)
        await self._hand_to_runner(key, data)
        return key

    async def _compiled(self, key: str, constraint) -> bytes:
        data = self._grammar_cache.get(key)
        if data is not None:
            return data
        if key in self._grammar_refusals:
            raise BadRequest(self._grammar_refusals[key])
        engine = await self._engine()  # its first build (seconds) is not the compile's time
        job = self._compiles.get(key)
        if job is None:
            job = self._compiles[key] = _Compile()
            self.spawn(self._compile, key, constraint, engine, job)
        limit = self.grammar_compile_timeout_s
        with anyio.move_on_after(limit):
            await job.done.wait()
        if not job.done.is_set():
            raise BadRequest(
                f"constraint: the grammar did not compile within {limit:g} s "
                "(the server's engine.grammar_compile_timeout_s)"
            )
        if job.data is None:
            raise BadRequest(job.error)
        return job.data

    async def _compile(self, key: str, constraint, engine, job: _Compile) -> None:
        """Compile in a worker thread, at most GRAMMAR_COMPILERS at once; the result goes to
        every waiter and, within the size limit, to the cache. Never raises (a background
        task's exception would crash the tokenizer)."""
        from kernels.grammar import GrammarError

        keep_refusal = True
        try:
            async with self._compile_slots:
                data = await anyio.to_thread.run_sync(
                    engine.compile_serialized,
                    constraint.kind,
                    constraint.spec,
                    constraint.choices,
                    abandon_on_cancel=True,
                )
            if len(data) > self.grammar_max_bytes:
                job.error = (
                    f"constraint: the compiled grammar is {_mib(len(data))} MiB, over the "
                    f"limit of {_mib(self.grammar_max_bytes)} MiB (the server's "
                    "engine.grammar_max_bytes); simplify it (fewer repetitions or alternatives)"
                )
            else:
                job.data = data
                self._grammar_cache.put(key, data, len(data))
        except GrammarError as exc:
            job.error = f"constraint: {exc}"
        except Exception as exc:
            keep_refusal = False
            job.error = f"constraint: the grammar failed to compile: {type(exc).__name__}: {exc}"
            job.error = job.error[:1000]
        finally:
            del self._compiles[key]
            if job.error and keep_refusal:
                self._grammar_refusals[key] = job.error
                while len(self._grammar_refusals) > GRAMMAR_REFUSALS_KEPT:
                    self._grammar_refusals.popitem(last=False)
            job.done.set()

    async def _engine(self):
        if self._grammar_engine is None:
            from kernels.grammar import GrammarEngine, grammar_available

            if not grammar_available():
                raise BadRequest("constraint: constrained output needs the xgrammar package")
            bundle = self.bundle

            def build():
                return GrammarEngine.shared(
                    str(bundle.extra.get("source", self.model_path)),
                    bundle.tokenizer,
                    bundle.vocab_size,
                    bundle.eos_ids,
                )

            async with self._grammar_engine_lock:
                if self._grammar_engine is None:
                    self._grammar_engine = await anyio.to_thread.run_sync(build)
        return self._grammar_engine

    async def _hand_to_runner(self, key: str, data: bytes) -> None:
        """Make sure the runner holds the grammar: ask by key, send the bytes only when it
        does not (once per key while it keeps it). Acknowledged, or `Unavailable`."""
        if self.runner is None:
            return
        # One hand-over per key at a time: requests of one constraint send it once.
        lock = self._handoffs.setdefault(key, anyio.Lock())
        try:
            async with lock:
                reply = await self.runner.call(
                    LoadGrammar(key=key), expect=GrammarLoaded, timeout=HANDOFF_TIMEOUT_S
                )
                if not reply.present:
                    reply = await self.runner.call(
                        LoadGrammar(key=key, data=data),
                        expect=GrammarLoaded,
                        timeout=HANDOFF_TIMEOUT_S,
                    )
        except (RemoteError, UnexpectedReply, ChannelClosed, TimeoutError) as exc:
            raise Unavailable(f"the model runner did not take the grammar: {exc}"[:1000]) from None
        finally:
            if not lock.locked() and not lock.statistics().tasks_waiting:
                self._handoffs.pop(key, None)
        if not reply.present:
            raise Unavailable("the model runner cannot keep this grammar; retry later")

    async def _begin_turn(
        self, session_id: str, rid: int, prompt_tokens: int, p: GenerationParams
    ) -> GenerationParams:
        """Claim the session for this turn (one at a time), or raise `SessionRefused`; the
        params with max_tokens cut to the session's capacity."""
        if self.sessions is None:
            raise BadRequest("this engine runs without streaming sessions")
        reply = await self.sessions.call(
            BeginTurn(
                session_id=session_id,
                rid=rid,
                prompt_tokens=prompt_tokens,
                max_new_tokens=p.max_tokens,
            ),
            expect=BeginTurnReply,
        )
        if not reply.ok:
            raise SessionRefused(reply.code, reply.message)
        if reply.max_new_tokens < p.max_tokens:
            m = reply.max_new_tokens
            p = msgspec.structs.replace(p, max_tokens=m, min_tokens=min(p.min_tokens, m))
        return p

    # ---- outputs -------------------------------------------------------------------------
    async def _on_tokens(self, batch: TokenBatch) -> None:
        out: dict[str, list[OutputChunk]] = {}
        stop_now: list[int] = []
        self._take_prompt_logprobs(batch)
        pos = 0
        queued = batch.queued_s or [-1.0] * len(batch.rids)
        errors = dict(zip(batch.error_rids, batch.error_texts))
        for rid, n, finish, cached, waited in zip(
            batch.rids, batch.counts, batch.finish, batch.cached, queued
        ):
            toks = batch.tokens[pos : pos + n]
            first = pos
            pos += n
            st = self.streams.get(rid)
            if st is None:
                continue
            if cached >= 0:
                st.cached_tokens = cached
                st.queue_time_s = waited
            if st.stopped:
                if finish:
                    self._close(rid, finish)
                continue
            # The EOS token that ended a request is not text (as vLLM): with special tokens
            # decoded it would otherwise show as `</s>` or `<eos>` at the end of the answer.
            text_ids = toks
            if finish == FinishReason.STOP and toks and toks[-1] in self._eos_ids:
                if not st.params.ignore_eos:
                    text_ids = toks[:-1]
            counted = st.detok.output_count
            delta = st.detok.push(text_ids) if text_ids else None
            text = delta.text if delta else ""
            if delta is not None and delta.finished_by_stop is not None:
                # A speculative step's run may go past the stop: its tokens are not output.
                n = st.detok.output_count - counted
                toks = toks[:n]
            st.completion_tokens += n
            reason = None
            matched = None
            if delta is not None and delta.finished_by_stop is not None:
                reason, matched = FinishReason.STOP, delta.finished_by_stop
                st.stopped = True
                if not finish:
                    stop_now.append(rid)
            elif finish == FinishReason.ERROR:  # what the client is told
                reason, text = finish, errors.get(rid, RUNNER_FAILED_TEXT)
            elif finish:
                tail = st.detok.flush()
                text += tail.text
                reason = finish
                if tail.finished_by_stop is not None:
                    reason, matched = FinishReason.STOP, tail.finished_by_stop
            lps = (
                self._logprobs(batch, first, toks) if st.params.logprobs and batch.logprobs else []
            )
            out.setdefault(st.reply_to, []).append(
                OutputChunk(
                    client_rid=st.client_rid,
                    text=text,
                    token_ids=list(toks),
                    finish_reason=reason,
                    prompt_tokens=st.prompt_tokens,
                    completion_tokens=st.completion_tokens,
                    cached_tokens=st.cached_tokens,
                    logprobs=lps,
                    stop_matched=matched,
                    prompt_logprobs=st.prompt_logprobs,
                    queue_time_s=st.queue_time_s,
                )
            )
            st.prompt_logprobs = []
            st.queue_time_s = -1.0
            if finish:
                self._close(rid, finish)
        if stop_now:
            await self.scheduler.send(EndRequests(rids=stop_now, reason=FinishReason.STOP))
        ends, self._turn_ends = self._turn_ends, []
        for end in ends:
            await self.sessions.send(end)
        for dest, chunks in out.items():
            await self.ref(dest).send(OutputBatch(chunks=chunks))

    def _take_prompt_logprobs(self, batch: TokenBatch) -> None:
        """Prompt logprobs ride with the request's next output chunk."""
        dec = self.bundle.tokenizer.decode
        pos = 0
        for rid, start, n in zip(batch.prompt_rids, batch.prompt_starts, batch.prompt_counts):
            st = self.streams.get(rid)
            if st is not None and st.prompt_ids is not None:
                if start == 1:  # the first prompt token: no logprob, nothing before it
                    first = st.prompt_ids[0]
                    st.prompt_logprobs.append(
                        TokenLogprob(
                            token_id=first,
                            text=dec([first], skip_special_tokens=False),
                            logprob=None,
                        )
                    )
                for j in range(n):
                    tok = st.prompt_ids[start + j]
                    top = [
                        (t, dec([t], skip_special_tokens=False), lp)
                        for t, lp in zip(
                            batch.prompt_top_ids[pos + j], batch.prompt_top_logprobs[pos + j]
                        )
                    ]
                    st.prompt_logprobs.append(
                        TokenLogprob(
                            token_id=tok,
                            text=dec([tok], skip_special_tokens=False),
                            logprob=batch.prompt_token_logprobs[pos + j],
                            top=top,
                            rank=batch.prompt_ranks[pos + j],
                        )
                    )
            pos += n

    def _close(self, rid: int, finish: str) -> None:
        st = self.streams.pop(rid, None)
        if st is None:
            return
        self.by_client.pop(st.client_rid, None)
        if st.session_id:
            # The scheduler released the turn's KV before this report: the slot is settled.
            ok = finish not in (FinishReason.ABORT, FinishReason.ERROR)
            end = EndTurn(
                session_id=st.session_id,
                rid=rid,
                ok=ok,
                total_tokens=st.prompt_tokens + st.completion_tokens,
            )
            self._turn_ends.append(end)

    def _logprobs(self, batch: TokenBatch, first: int, toks: list[int]) -> list[TokenLogprob]:
        dec = self.bundle.tokenizer.decode
        res = []
        for i, tok in enumerate(toks):
            j = first + i
            top = []
            if batch.top_ids:
                top = [
                    (t, dec([t], skip_special_tokens=False), lp)
                    for t, lp in zip(batch.top_ids[j], batch.top_logprobs[j])
                ]
            res.append(
                TokenLogprob(
                    token_id=tok,
                    text=dec([tok], skip_special_tokens=False),
                    logprob=batch.logprobs[j],
                    top=top,
                )
            )
        return res

    def stats(self) -> dict[str, int | float]:
        return {"live_streams": len(self.streams)}


def _refusal(exc: Exception) -> ErrorReply:
    """The ErrorReply a refused request gets (its code picks the HTTP status)."""
    if isinstance(exc, BadRequest):
        return ErrorReply(code=refusal_code(exc), message=str(exc))
    if isinstance(exc, Overloaded):
        return ErrorReply(code=ERR_OVERLOADED, message=str(exc))
    if isinstance(exc, SessionRefused):
        return ErrorReply(code=exc.code, message=exc.message)
    return ErrorReply(code=ERR_UNAVAILABLE, message=str(exc))


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def _msg_dict(m) -> dict:
    d = {"role": m.role, "content": m.content}
    for key in ("name", "tool_calls", "tool_call_id"):
        if getattr(m, key) is not None:
            d[key] = getattr(m, key)
    return d


def _after_reasoning(params: GenerationParams, prompt_tail: str):
    """The request's constraint, applied once its reasoning ends (`actors.reasoning`)."""
    try:
        fmt = reasoning_format(params.reasoning_parser)
    except ValueError as exc:
        raise BadRequest(f"reasoning_parser: {exc}") from None
    try:
        return wrap_constraint(fmt, params.constraint, prompt_tail=prompt_tail)
    except ValueError as exc:
        raise BadRequest(f"constraint: {exc}") from None
