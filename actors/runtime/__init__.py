"""The actor microkernel: actors, refs, mailboxes, supervision, processes, logging.

| module | job |
|---|---|
| `actor` | the `Actor` base class and its inbox decoder |
| `refs` | `ActorRef` (call / send to an actor by name) and `RefBook` (a cache of refs) |
| `cell` | `ActorCell`: one actor instance on its mailbox, the mailbox loop and failure rules |
| `spec` | `ActorSpec`: how to build and supervise one actor |
| `host` | `ActorHost`: the actors of one process and their crash policies |
| `child` | the entry point of a child process |
| `system` | `ActorSystem`: a running set of actors over one transport |
| `errors` | the runtime's exceptions |
| `logging` | structlog configuration shared by every process |

Nothing here knows any engine actor: the serving engine is assembled in `actors.app`.
"""

from actors.runtime.actor import Actor, inbox_codec
from actors.runtime.cell import (
    DEFAULT_START_TIMEOUT_S,
    DEFAULT_STOP_TIMEOUT_S,
    ActorCell,
    CrashReport,
    bind_mailbox,
)
from actors.runtime.errors import HandledError, RemoteError, UnexpectedReply, root_exception
from actors.runtime.host import ActorHost, HostTimeouts
from actors.runtime.refs import DEFAULT_CALL_TIMEOUT_S, DEFAULT_SEND_TIMEOUT_S, ActorRef, RefBook
from actors.runtime.spec import ActorSpec, CrashPolicy, build_actor, resolve_factory
from actors.runtime.system import ActorHealth, ActorSystem, SystemStartError

__all__ = [
    "DEFAULT_CALL_TIMEOUT_S",
    "DEFAULT_SEND_TIMEOUT_S",
    "DEFAULT_START_TIMEOUT_S",
    "DEFAULT_STOP_TIMEOUT_S",
    "Actor",
    "ActorCell",
    "ActorHealth",
    "ActorHost",
    "ActorRef",
    "ActorSpec",
    "ActorSystem",
    "CrashPolicy",
    "CrashReport",
    "HandledError",
    "HostTimeouts",
    "RefBook",
    "RemoteError",
    "SystemStartError",
    "UnexpectedReply",
    "bind_mailbox",
    "build_actor",
    "inbox_codec",
    "resolve_factory",
    "root_exception",
]
