"""The deterministic simulation harness: the real actors, a scripted Worker, and a transport
whose delivery order the test chooses (DESIGN.md §7).

What runs: the real :class:`~actorllm.frontend.actor.Frontend`,
:class:`~actorllm.tokenizer.actor.Tokenizer`
(with the tiny BPE tokenizer of ``tests/helpers.py``), :class:`~actorllm.scheduler.actor.Scheduler`
and :class:`~actorllm.detokenizer.actor.Detokenizer`; a :class:`~sim.scripted_worker.ScriptedWorker`
in place of the model; one :class:`~sim.controlled_transport.ControlledMailbox` per inbox,
so a message moves only when the test delivers it. Nothing sleeps; the clock is trio's
``MockClock``.

Theory of operation — running trio under a synchronous test driver. Hypothesis rules are
plain functions, and the actors are trio tasks. The :class:`GuestLoop` runs trio in *guest
mode* (``trio.lowlevel.start_guest_run``) on a host loop that is nothing but a deque of
callbacks, drained in this thread. With ``MockClock(autojump_threshold=0)`` trio never
blocks on I/O, so it never starts its I/O thread: every step of every task happens inside
``GuestLoop.run_until``, in this thread, in an order fixed by trio's deterministic
scheduling (importing hypothesis switches it on). :meth:`World.call` runs one action inside
trio, then waits with ``trio.testing.wait_all_tasks_blocked()`` until every task is blocked
(on a mailbox nobody has delivered to, a step the Worker has not answered, a full box), and
only then returns to the rule. Between rules, trio is not running at all.

What is checked (DESIGN.md §3), and where:

1. every message is seen as its sender sends it (``on_send``): a rid the Frontend has never
   registered, or a Frontend message for a rid not in its registry, is a violation;
2. every actor writes its transitions to one :class:`Recorder` (the Ledger's tracer), which
   feeds each rid's merged history, one incarnation of the rid at a time, to the invariant
   checker of actorllm/lifecycle/invariants.py as it grows (the path and the terminal events);
   each client's collector is watched for anything put after its final output; clients'
   outputs never go past a matched stop string; a live rid must be refused
   (``DuplicateRequestId``);
3. the pool's ``free`` is watched: no block referenced by a step still in flight (sent by
   the Scheduler, its result not yet received by it) may be freed; after every rule the
   pool and the sequences' block tables must partition the blocks;
4. at drain (``World.drain``): every registry, ledger, pool, decode state, wire and the
   Worker's state is empty, and every history ends released;
5. a stale or duplicated result, an abort or a stop for a finished sequence, or a
   ``StopMatched`` sent for an earlier request with the same rid must leave the Scheduler
   exactly as it was; an abort (the client's, or the Frontend's own when a child fails)
   reaches every choice not yet answered; nothing ends in ``abort`` that nobody aborted;
6. a ``n > 1`` parent is gathered only after every child is released, and its client sees
   the final output only after every child has ended (an error may come at once; its
   live siblings must then be aborted, which 5 checks);
7. each choice's text equals the decode of the committed token ids (those the Scheduler
   sent to the Detokenizer), cut at the first stop string, with nothing lost or doubled,
   and its finish reason is the one the Scheduler decided.

Violations found inside the trio run are recorded, not raised (an exception there would
look like an actor crash); :meth:`World.check` raises the first one after each rule.

Where the parts live: ``world.py`` (the World and the steps a test takes), ``watch.py``
(its hooks on messages, the Scheduler and collectors), ``checks.py`` (what clients read,
the pool), ``recorder.py`` (the merged histories, judged by actorllm/lifecycle/invariants.py, and
the clients), ``guest.py`` (trio in guest mode), ``common.py`` (sizes, vocabulary, the
text reference), ``bugs.py`` (the planted bugs). This module gathers their names.
"""

from __future__ import annotations

from .common import (
    EDGES,
    PROMPTS,
    SPEC,
    STOP_STRINGS,
    VOCAB_TEXTS,
    InvariantViolation,
    SimConfig,
    TextModel,
    message_rids,
)
from .guest import GuestLoop
from .recorder import Client, Incarnation, Recorder
from .world import World

__all__ = [
    "EDGES",
    "PROMPTS",
    "SPEC",
    "STOP_STRINGS",
    "VOCAB_TEXTS",
    "Client",
    "GuestLoop",
    "Incarnation",
    "InvariantViolation",
    "Recorder",
    "SimConfig",
    "TextModel",
    "World",
    "message_rids",
]
