/*
 * lifecycle.pml: a Promela model of actorllm's request protocol, for the SPIN model checker.
 *
 * What it is. The actors of DESIGN.md section 1 as processes over bounded FIFO channels:
 * the API-layer client, the Frontend, the Tokenizer, the Scheduler (two processes: its
 * receive loop and its sender task, as in actorllm/scheduler/actor.py), the Worker and the
 * Detokenizer. SPIN explores every interleaving and checks the invariants of
 * spec/lifecycle.toml: assertions where each must hold, a check once everything is idle
 * (invariant 4), and LTL formulas. spec/README.md ("Model checking") says how to run it;
 * tests/test_spin.py runs it in CI.
 *
 * Scenarios (small on purpose: each check takes seconds):
 *   default    rid 0 = P, a request with n = 2 that only the Frontend knows, and its
 *              children 1 and 2. Each child generates at most MAXTOK = 2 tokens; the KV
 *              pool holds NB = 3 blocks and a child needs 1 block before its first token
 *              and 2 after it, so both cannot decode at once: preemption happens.
 *   -DREUSE_A  rid 3 = A, a request with n = 1 whose client may reuse the rid once the
 *              Frontend has forgotten it: stale aborts and stop strings must not hit it.
 *   -DBOTH     both at once (exhaustive too, but minutes and gigabytes: not for CI).
 *   -DDEATH    with either: the engine's process may die at any moment (EngineDeath):
 *              its actors stop where they are, what was on their edges is lost, and the
 *              Frontend fails every live request at once (Frontend.lose_all, the table's
 *              `lose`); a client is refused from then on.
 * Every mailbox holds CAP = 2 messages, so sends block (backpressure).
 * Two steps may be in flight (overlap scheduling, --async-scheduling): the Scheduler plans
 * ahead while one runs, never preempting then, and the Worker runs plans in order.
 * -DONE_STEP keeps one step in flight, the CPU's default.
 *
 * Nondeterminism stands for what the model does not compute: the client may abort (or
 * disconnect, whose clean-up calls abort) at any moment (ABORTS times); the Tokenizer may
 * reject a prompt; a sampled token may be EOS; a step may fail; a stop string may match.
 * A child that fails (step error or rejection) makes the Frontend abort its siblings.
 * A's reader may fall behind: the Frontend sends PAUSE on the aborts' edge, and later
 * RESUME (the reader caught up) or an abort (--stream-timeout ran out); -DNO_PAUSE
 * turns that off.
 * -DNO_REJECT, -DNO_STOP, -DNO_FAIL, -DNO_REUSE and -DNO_SIBLING_ABORT turn one of them
 * off. To keep the state space small, only child 0 and A may match a stop string and
 * only child 1 and A may be rejected: each behaviour is still reached, against every
 * interleaving.
 *
 * The Frontend here registers every child of P before dispatching the first, and an abort
 * of a child whose request is not sent yet only marks it: the dispatch sends the abort
 * right behind the request. BUG_LAZY_CHILD_REGISTER and BUG_ABORT_BEFORE_DISPATCH are
 * the two ways to get that wrong (spec/README.md tells how the model found them).
 *
 * Modelling choices (each a reason the model is small, none a reason it is wrong):
 * - What an actor does between two awaits is one atomic step. A send that follows a
 *   decision of the same task is atomic with it and waits for room first: trio's send
 *   queues at once when there is room, and wakes senders parked on a full channel in
 *   FIFO order.
 * - Messages carry rid masks; a TokenBatch / OutputBatch is one message, handled at once,
 *   as in the real actors. KV blocks are counted, not named. Text, sampling, chunked
 *   prefill and the token budget are not modelled: a step gives each leaf it plans one
 *   token.
 *
 * Planted bugs (tests/test_spin.py checks that SPIN finds each, and nothing without them):
 *   BUG_FREE_BEFORE_FENCE        a finished leaf's blocks are freed while a step uses them
 *   BUG_FENCE_ONE_STEP           they are freed when the first of two steps that plan the
 *                                leaf returns, while the other still runs
 *   BUG_ABORT_BYPASS             aborts go Frontend -> Scheduler directly, off the FIFO edge
 *   BUG_ABORT_BEFORE_DISPATCH    an abort of a registered child is sent before the child's
 *                                own GenerateRequest was
 *   BUG_LATE_RESULT_COMMIT       a late result's token is committed to a finished leaf
 *   BUG_FORGET_BEFORE_FREE       the Frontend forgets a rid once answered, before the free
 *   BUG_GATHER_EARLY             a n > 1 parent ends when its first child ends
 *   BUG_REGISTER_AFTER_DISPATCH  the Frontend sends GenerateRequest before registering
 *   BUG_LAZY_CHILD_REGISTER      each n > 1 child is registered just before its own
 *                                dispatch, so the parent can gather before its last child
 *                                exists
 *   BUG_SEND_LOST_CHILD          (-DDEATH) a child lost while a sibling waited for room is
 *                                sent anyway, after the Frontend forgot it
 *   BUG_TWO_ENDS                 an abort or StopMatched for a leaf that has ended counts as
 *                                a second end: breaks the LTL formula `invariants` (checked
 *                                with pan -A, which ignores the assertions)
 *   BUG_SPIN_AHEAD               planning ahead that finds nothing is tried again at once,
 *                                forever: breaks the LTL formula `drains` (a busy loop)
 */

#define NR      4      /* rids 0..3 */
#define P       0      /* the n = 2 parent */
#define C0      1      /* its children "P-0" and "P-1" */
#define C1      2
#define A       3      /* a plain request */
#define NB      3      /* KV blocks */
#define MAXTOK  2      /* max_tokens of every leaf */
#ifdef ONE_STEP
#define MAXFLIGHT 1    /* steps in flight */
#else
#define MAXFLIGHT 2
#endif
#ifndef CAP
#define CAP     2      /* mailbox capacity */
#endif

/* Scenarios: the default is P alone; -DREUSE_A is A alone; -DBOTH runs them together
   (exhaustive too, but minutes and gigabytes: not for CI). */
#if defined(BOTH)
#define HAVE_P
#define HAVE_A
#define FIRST   C0     /* the leaves are FIRST .. LAST */
#define LAST    A
#define CLIENTS 2
#elif defined(REUSE_A)
#define HAVE_A
#define FIRST   A
#define LAST    A
#define CLIENTS 1
#else
#define HAVE_P
#define FIRST   C0
#define LAST    C1
#define CLIENTS 1
#endif

#ifndef ABORTS
#ifdef REUSE_A
#define ABORTS  2      /* abort calls per client: twice, to show abort is idempotent */
#else
#define ABORTS  1
#endif
#endif

/* Scheduler-side state of a leaf (Sequence.status in actorllm/scheduler/actor.py). */
#define S_NONE  0      /* no Sequence: not arrived yet, rejected, or freed */
#define S_WAIT  1
#define S_RUN   2
#define S_PRE   3
#define S_FIN   4      /* finished; blocks kept until the step fence */
#define S_PAUSE 5      /* its reader is behind: not planned; keeps its blocks until needed */

#define ERR     255    /* RESULT's eos field for a failed step */
#define BIT(r)  (1 << (r))
/* blocks a leaf needs for its next step: its tokens committed and in flight */
#define WANT(r) (1 + (out[r] + in_step[r] >= 1))

mtype = { TOKENIZE, ABORT, SEQ, STOP, RESULT, PAUSE, RESUME };

#ifdef BUG_ABORT_BYPASS
#define ABORT_EDGE sch_in      /* straight to the Scheduler: it may overtake the request */
#else
#define ABORT_EDGE tok_in      /* the request's own edge, behind the request */
#endif

/* Edges. An abort shares the Frontend -> Tokenizer -> Scheduler edge with its request. */
chan tok_in = [CAP] of { mtype, byte, byte };       /* TOKENIZE(rid, life), ABORT(rid, life) */
chan sch_in = [CAP] of { mtype, byte, byte };       /* SEQ, ABORT (Tokenizer), STOP
                                                       (Detokenizer): (rid, life);
                                                       RESULT (Worker): (mask, eos) */
chan wk_in  = [MAXFLIGHT] of { byte };              /* StepPlan: the mask of planned rids */
chan det_in = [CAP] of { byte, byte, byte, byte };  /* TokenBatch: (tokens, finished,
                                                       freed, finished with an error) */
chan fe_in  = [CAP] of { byte, byte, byte, byte, byte };  /* OutputBatch: (deltas,
                                                       finished, freed, 0, errors), or
                                                       RequestFailed: (0, 0, 0, rid mask, 0) */

/* The Frontend's registry (RequestState in actorllm/frontend/actor.py). */
bool reg[NR];          /* the rid is live */
bool resp[NR];         /* the client has its final output (respond) */
bool freed[NR];        /* the Scheduler freed it, or it never reached the Scheduler */
bool abort_sent[NR];
bool dispatched[NR];   /* its GenerateRequest is queued for the Tokenizer */

/* The Scheduler (actorllm/scheduler/actor.py). */
byte ss[NR];           /* S_* */
byte out[NR];          /* output tokens committed */
byte nblk[NR];         /* blocks in its block table */
byte in_step[NR];      /* steps in flight that plan it (Sequence.in_flight): the fence */
byte nfree = NB;       /* blocks in the free pool */
byte nflight;          /* steps in flight, at most MAXFLIGHT */
bool tried_ahead;      /* planning ahead found nothing; try again after the next message */
bool want_pause[NR];   /* PAUSE received; applied once no step in flight plans the leaf */
byte pmask;            /* the rids of the step being planned */
byte pend_tok, pend_fin, pend_freed, pend_err;    /* decided, not yet sent */

/* The Detokenizer: a stop string matched for this rid; nothing more is shown. */
bool dstop[NR];

/* Ghost state: written to state properties; no actor decides anything on it. */
byte life[NR];         /* registrations of the rid; requests and aborts carry it */
byte slife[NR];        /* the life of the Sequence the Scheduler holds */
byte arrived[NR];      /* the last life that got past the Tokenizer */
byte term[NR];         /* terminal events in the current life (invariant 2) */
byte fm0, fm1;         /* the masks of the steps in flight, oldest first: whose blocks the
                          Worker may still touch (invariant 3) */
bool released[NR];     /* RELEASED: forgotten by the Frontend and freed by the Scheduler */
bool gathered;         /* P ended */
bool drained;          /* the drain check passed (invariant 4) */
byte clients_done;

/* The table of spec/lifecycle.toml, generated: fire(r, E_...) at each event of it. */
#include "lifecycle_table.pml"

#ifdef DEATH
bool dead;             /* the engine's process died: only the Frontend and clients go on */
#define LIVE(c) (!dead && nempty(c))
#define ALIVE   !dead &&
#else
#define LIVE(c) nempty(c)
#define ALIVE
#endif

/* Scratch for loops inside atomic sequences: not part of the state. */
hidden byte i, j, v, stuck;

/* ---------------------------------------------------------------- Frontend, API side */

inline register(r) {
    assert(!reg[r]);            /* rids are unique while live */
    reg[r] = 1; resp[r] = 0; freed[r] = 0; abort_sent[r] = 0; dispatched[r] = 0;
    released[r] = 0;
    life[r]++; term[r] = 0;
    fire(r, E_REGISTER)
}

/* Frontend.submit for one leaf: register before dispatch (invariant 1). The send waits
   for room atomically with the registration (see "Modelling choices"). */
inline submit_leaf(r) {
#ifdef BUG_REGISTER_AFTER_DISPATCH
    atomic { nfull(tok_in) -> tok_in ! TOKENIZE, r, life[r] + 1 };
    atomic { register(r); dispatched[r] = 1; fire(r, E_DISPATCH) }
#else
    atomic { nfull(tok_in) -> register(r); tok_in ! TOKENIZE, r, life[r]; dispatched[r] = 1;
             fire(r, E_DISPATCH) }
#endif
}

/* The GenerateRequest of a child registered earlier; then the abort asked for meanwhile,
   if any, right behind it (an abort must never overtake its request). */
inline dispatch(r) {
    atomic {
#if defined(DEATH) && !defined(BUG_SEND_LOST_CHILD)
        (nfull(tok_in) || !reg[r]) ->
        if
        :: !reg[r] -> skip      /* lost (the engine died) while a sibling waited: not sent */
        :: else ->
#else
        nfull(tok_in) ->
        if
        :: true ->
#endif
            tok_in ! TOKENIZE, r, life[r]; dispatched[r] = 1;
            fire(r, E_DISPATCH);
            if
            :: abort_sent[r] -> ABORT_EDGE ! ABORT, r, life[r]
            :: else -> skip
            fi
        fi
    }
}

/* Frontend.abort for one leaf: idempotent; a no-op once the client is answered. A child
   not dispatched yet is only marked: its dispatch sends the abort after the request. */
inline abort_leaf(r) {
    atomic {
        if
        :: !reg[r] || resp[r] || abort_sent[r] -> skip
#ifndef BUG_ABORT_BEFORE_DISPATCH
        :: reg[r] && !resp[r] && !abort_sent[r] && !dispatched[r] -> abort_sent[r] = 1
        :: reg[r] && !resp[r] && !abort_sent[r] && dispatched[r] && nfull(ABORT_EDGE) ->
#else
        :: reg[r] && !resp[r] && !abort_sent[r] && nfull(ABORT_EDGE) ->
#endif
            abort_sent[r] = 1; ABORT_EDGE ! ABORT, r, life[r]
        fi
    }
}

#ifdef HAVE_P
/* The client of P (n = 2): fan-out at the edge; then maybe abort, at any time. */
active proctype ClientP() {
    byte k;
#ifdef BUG_LAZY_CHILD_REGISTER
    /* Each child registered just before its own dispatch: child 0 can end, and the parent
       gather, before child 1 exists. */
    atomic { register(P); fire(P, E_FAN_OUT) };
    submit_leaf(C0);
    submit_leaf(C1);
#else
    /* register and fan_out: the parent and every child exist before anything is sent */
    atomic { register(P); fire(P, E_FAN_OUT); register(C0); register(C1) };
    dispatch(C0);
    dispatch(C1);
#endif
    do
    :: k < ABORTS -> k++;       /* abort, or disconnect (its clean-up calls abort) */
        if
        :: reg[P] -> atomic { abort_leaf(C0); abort_leaf(C1) }   /* every live child */
        :: else -> skip
        fi
    :: break
    od;
    clients_done++
}
#endif

/* Frontend flow control (FlowControl): the reader of r is behind, or caught up. Sent on
   the aborts' edge, behind the request; dropped once the client is answered. */
inline flow_leaf(r, m) {
    atomic {
        if
        :: reg[r] && !resp[r] && dispatched[r] && nfull(tok_in) -> tok_in ! m, r, life[r]
        :: !(reg[r] && !resp[r] && dispatched[r]) -> skip   /* else it waits for room */
        fi
    }
}

#ifdef HAVE_A
/* The client of A (n = 1): maybe abort; once answered, maybe reuse the rid. */
active proctype ClientA() {
    byte k;
    submit_leaf(A);
#ifndef NO_PAUSE
    if
    :: flow_leaf(A, PAUSE);     /* the reader fell behind; then it catches up, or the
                                   stream timeout aborts it */
        if
        :: flow_leaf(A, RESUME)
        :: abort_leaf(A)
        fi
    :: skip
    fi;
#endif
    do
    :: k < ABORTS -> k++; abort_leaf(A)
    :: break
    od;
#ifndef NO_REUSE
    resp[A];                    /* the client has read the final output */
    atomic {
        if
        :: reg[A] -> skip       /* still live: DuplicateRequestId */
        :: ALIVE !reg[A] && nfull(tok_in) ->   /* (a dead engine refuses at the door) */
            register(A); tok_in ! TOKENIZE, A, life[A]; dispatched[A] = 1;
            fire(A, E_DISPATCH)
        :: skip                 /* or it does not come back */
        fi
    };
    if
    :: abort_leaf(A)            /* the new life may be aborted too */
    :: skip
    fi;
#endif
    clients_done++
}
#endif

/* ---------------------------------------------------------------- Frontend, actor loop */

inline maybe_forget(r) {
#ifdef BUG_FORGET_BEFORE_FREE
    if
    :: resp[r] ->
#else
    if
    :: resp[r] && freed[r] ->
#endif
        reg[r] = 0; fire(r, E_FORGET);
#ifdef DEATH
        released[r] = (ss[r] == S_NONE) || dead;    /* (its blocks died with the engine) */
#else
        released[r] = (ss[r] == S_NONE);
#endif
        if
#ifdef BUG_GATHER_EARLY
        :: (r == C0 || r == C1) && reg[P] && (!reg[C0] || !reg[C1]) ->
#else
        :: (r == C0 || r == C1) && reg[P] && !reg[C0] && !reg[C1] ->
#endif
            /* invariant 6: the parent ends only when every child is RELEASED */
            assert(released[C0] && released[C1]);
            reg[P] = 0; released[P] = 1; gathered = 1; fire(P, E_GATHER)
        :: else -> skip
        fi
    :: else -> skip
    fi
}

active proctype Frontend() {
    byte deltas, fins, frees, failed, errs;
    bool abort_next;            /* a child of P failed: abort its siblings (Frontend.run) */
end:
    do
    :: d_step {
        fe_in ? deltas, fins, frees, failed, errs;
        /* Deltas for a rid that is not live are dropped (late outputs); the rest shown. */
        for (i : FIRST .. LAST) {
            if
            :: (fins | failed) & BIT(i) && reg[i] && !resp[i] ->
                resp[i] = 1; fire(i, E_RESPOND);    /* the final output */
                freed[i] = freed[i] || (failed & BIT(i));   /* rejected: nothing to free */
                abort_next = abort_next || ((failed | errs) & BIT(i) && (i == C0 || i == C1));
                maybe_forget(i)
            :: else -> skip
            fi
        }
        for (i : FIRST .. LAST) {
            if
            :: frees & BIT(i) && reg[i] -> freed[i] = 1; maybe_forget(i)
            :: else -> skip
            fi
        }
        i = 0; deltas = 0; fins = 0; frees = 0; failed = 0; errs = 0
       };
#ifndef NO_SIBLING_ABORT
        /* The client has the error: the siblings are moot. The run loop itself sends. */
        if
        :: abort_next && reg[P] -> abort_leaf(C0); abort_leaf(C1)
        :: else -> skip
        fi;
#endif
        abort_next = 0
    od
}

/* ---------------------------------------------------------------- Tokenizer */

active proctype Tokenizer() {
    mtype m; byte r, l;
end:
    do
    :: atomic {
        LIVE(tok_in) -> tok_in ? m, r, l;
        if
        :: m == ABORT -> sch_in ! ABORT, r, l    /* forwarded on the request's own edge */
        :: m == PAUSE || m == RESUME -> sch_in ! m, r, l   /* the same edge */
        :: m == TOKENIZE ->
            assert(reg[r] && life[r] == l);     /* invariant 1: registered before dispatch */
            if
            :: sch_in ! SEQ, r, l
#ifndef NO_REJECT
            :: r != C0 -> arrived[r] = l; term[r]++; fire(r, E_REJECT);
                fe_in ! 0, 0, 0, BIT(r), 0      /* reject */
#endif
            fi
        fi;
        m = 0; r = 0; l = 0
       }
    od
}

/* ---------------------------------------------------------------- Scheduler */

/* Give r blocks up to WANT(r) (blocks are counted, not named: which block a leaf gets
   changes nothing the model checks, and naming them multiplies the states). */
inline alloc(r) {
    if
    :: WANT(r) > nblk[r] ->
        assert(nfree >= WANT(r) - nblk[r]);
        nfree = nfree - (WANT(r) - nblk[r]);
        nblk[r] = WANT(r)
    :: else -> skip             /* reserved by a plan ahead that was given up */
    fi
}

/* r's blocks back to the pool: exactly once, never while a step uses them (invariant 3). */
inline release(r) {
    assert(((fm0 | fm1) & BIT(r)) == 0);
    nfree = nfree + nblk[r];
    assert(nfree <= NB);        /* nothing returns twice */
    nblk[r] = 0
}

inline free_seq(r) {
    release(r);
    ss[r] = S_NONE; pend_freed = pend_freed | BIT(r);
    fire(r, E_FREE)
}

/* The one terminal transition (finish, abort or fail): blocks now, or after the fence. */
inline finish(r, e) {
    ss[r] = S_FIN; fire(r, e);
    want_pause[r] = 0;          /* a pause asked for dies with the request */
    term[r]++;
    assert(term[r] == 1);       /* invariant 2: exactly one terminal event */
    pend_fin = pend_fin | BIT(r);
#ifdef BUG_FREE_BEFORE_FENCE
    free_seq(r)
#else
    if
    :: in_step[r] == 0 -> free_seq(r)
    :: else -> skip             /* fenced: freed when the last step that plans it returns */
    fi
#endif
}

/* Abort or stop string: idempotent; stops future work, never undoes launched work. */
inline finish_early(r, l, e) {
    if
    :: ss[r] == S_WAIT || ss[r] == S_RUN || ss[r] == S_PRE || ss[r] == S_PAUSE ->
        assert(slife[r] == l);  /* a stale abort or stop never hits a reused rid */
        finish(r, e)
#ifdef BUG_TWO_ENDS
    :: ss[r] == S_FIN || ss[r] == S_NONE -> term[r]++  /* the bug: a late one ends it again */
#endif
    :: else -> skip             /* already finished or freed, or rejected */
    fi
}

inline commit(r) {
    assert(term[r] == 0);       /* invariant 2: no output after the terminal event */
    out[r]++; pend_tok = pend_tok | BIT(r)
}

inline on_result(mask, eos) {
    assert(nflight > 0 && mask == fm0);     /* results come back in plan order */
    nflight--; fm0 = fm1; fm1 = 0;
    for (i : FIRST .. LAST) {
        if
        :: mask & BIT(i) -> in_step[i]--
        :: else -> skip
        fi
    }
    /* The fence has passed: leaves that finished meanwhile give their blocks back, once no
       step in flight plans them any more. */
    for (i : FIRST .. LAST) {
        if
#ifdef BUG_FENCE_ONE_STEP
        :: mask & BIT(i) && ss[i] == S_FIN -> free_seq(i)     /* the other step is forgotten */
#else
        :: mask & BIT(i) && ss[i] == S_FIN && in_step[i] == 0 -> free_seq(i)
#endif
        :: else -> skip
        fi
    }
    for (i : FIRST .. LAST) {
        if
        :: mask & BIT(i) && ss[i] == S_RUN && eos == ERR ->
            pend_err = pend_err | BIT(i); finish(i, E_FAIL)
        :: mask & BIT(i) && ss[i] == S_RUN && eos != ERR ->
            commit(i);
            if
            :: eos & BIT(i) || out[i] >= MAXTOK -> finish(i, E_FINISH)  /* EOS, or length */
            :: else -> skip
            fi
#ifdef BUG_LATE_RESULT_COMMIT
        :: mask & BIT(i) && ss[i] != S_RUN && eos != ERR -> commit(i)
#endif
        :: else -> skip         /* not in the step, or a late result: dropped */
        fi
    }
}

/* The receive loop: handling a message never blocks (Scheduler.handle). */
active proctype SchedRecv() {
    mtype m; byte a, x;
end:
    do
    :: d_step {
        LIVE(sch_in) -> sch_in ? m, a, x;
        if
        :: m == SEQ ->
            assert(ss[a] == S_NONE);            /* a rid is unique while live */
            ss[a] = S_WAIT; out[a] = 0; slife[a] = x; arrived[a] = x; fire(a, E_ENQUEUE)
        :: m == ABORT ->
            assert(arrived[a] >= x);            /* an abort never overtakes its request */
            finish_early(a, x, E_ABORT)
        :: m == STOP -> finish_early(a, x, E_FINISH)
        :: m == PAUSE ->
            assert(arrived[a] >= x);            /* never overtakes its request */
            if
            :: (ss[a] == S_WAIT || ss[a] == S_RUN || ss[a] == S_PRE) && slife[a] == x ->
                want_pause[a] = 1
            :: else -> skip                     /* finished, freed or reused: dropped */
            fi
        :: m == RESUME ->
            want_pause[a] = 0;
            if
            :: ss[a] == S_PAUSE && slife[a] == x -> ss[a] = S_PRE; fire(a, E_RESUME)
            :: else -> skip
            fi
        :: m == RESULT -> on_result(a, x)
        fi;
        tried_ahead = 0;                        /* news: planning ahead may find work now */
        i = 0; m = 0; a = 0; x = 0
       }
    od
}

/* Preempt by recompute: blocks back now (no step is in flight, so no fence applies). */
inline preempt(r) {
    assert(in_step[r] == 0 && nflight == 0);
    release(r);
    ss[r] = S_PRE; fire(r, E_PREEMPT)
}

#define PAUSED_BLOCKS ((ss[1] == S_PAUSE && nblk[1] > 0) || (ss[2] == S_PAUSE && nblk[2] > 0) \
                       || (ss[3] == S_PAUSE && nblk[3] > 0))

/* KV is needed: the first paused leaf holding blocks gives them up (recompute on resume). */
inline evict_paused() {
    if
    :: ss[1] == S_PAUSE && nblk[1] > 0 -> release(1); fire(1, E_PREEMPT)
    :: else -> if
        :: ss[2] == S_PAUSE && nblk[2] > 0 -> release(2); fire(2, E_PREEMPT)
        :: else -> release(3); fire(3, E_PREEMPT)
        fi
    fi
}

/* Scheduler.schedule, first: the pauses asked for take effect, each once no step in flight
   plans its leaf (until then the leaf is not planned ahead). */
inline apply_pauses() {
    for (i : FIRST .. LAST) {
        if
        :: (want_pause[i] && in_step[i] == 0
            && (ss[i] == S_WAIT || ss[i] == S_RUN || ss[i] == S_PRE)) ->
            want_pause[i] = 0; ss[i] = S_PAUSE; fire(i, E_PAUSE)
        :: else -> skip
        fi
    }
    i = 0
}

/* Scheduler.schedule: running leaves first, preempting the newest running one that is not
   yet planned when the pool is exhausted; then admissions, preempted leaves first, up to
   the first that does not fit. With a step in flight it plans *ahead*: a running leaf
   whose tokens in flight reach MAXTOK, or whose pause waits, is left out; where the plain
   path would preempt it plans nothing (stuck = 2), and the plain path decides once the
   pipeline has drained. */
inline plan() {
    pmask = 0;
    stuck = 0;
    for (i : FIRST .. LAST) {
        if
        :: (ss[i] == S_RUN && !stuck
            && (nflight == 0 || (out[i] + in_step[i] < MAXTOK && !want_pause[i]))) ->
            do
            :: WANT(i) <= nblk[i] + nfree -> alloc(i); pmask = pmask | BIT(i); break
            :: WANT(i) > nblk[i] + nfree && PAUSED_BLOCKS ->
                evict_paused()          /* paused leaves give their blocks up first */
            :: WANT(i) > nblk[i] + nfree && !PAUSED_BLOCKS && nflight > 0 ->
                stuck = 2; break        /* no preemption while a step runs */
            :: WANT(i) > nblk[i] + nfree && !PAUSED_BLOCKS && nflight == 0 ->
                v = i;
                for (j : FIRST .. LAST) {
                    if
                    :: j != i && ss[j] == S_RUN && !(pmask & BIT(j)) -> v = j
                    :: else -> skip
                    fi
                }
                preempt(v);
                if
                :: v == i -> break
                :: else -> skip
                fi
            od
        :: else -> skip
        fi
    }
    for (j : 0 .. 1) {          /* j = 0: preempted leaves, then j = 1: waiting ones */
        for (i : FIRST .. LAST) {
            if
            :: !stuck && ((j == 0 && ss[i] == S_PRE) || (j == 1 && ss[i] == S_WAIT)) ->
                if
                :: WANT(i) <= nblk[i] + nfree -> alloc(i); ss[i] = S_RUN;
                    pmask = pmask | BIT(i); fire(i, E_SCHEDULE)
                :: WANT(i) > nblk[i] + nfree && PAUSED_BLOCKS ->
                    evict_paused(); i--     /* and try this leaf again */
                :: WANT(i) > nblk[i] + nfree && !PAUSED_BLOCKS -> stuck = 1
                fi
            :: else -> skip
            fi
        }
    }
    if
    :: stuck == 2 -> assert(nflight > 0); pmask = 0
    :: else -> skip
    fi;
    if
    :: pmask != 0 ->
        nflight++;
        if
        :: nflight == 1 -> fm0 = pmask
        :: else -> fm1 = pmask
        fi;
        for (i : FIRST .. LAST) {
            if
            :: pmask & BIT(i) -> in_step[i]++
            :: else -> skip
            fi
        }
    :: else ->
        assert(nflight > 0);    /* the pool holds one leaf's needs: with no step in flight
                                   something always fits */
#ifndef BUG_SPIN_AHEAD
        tried_ahead = 1
#else
        skip                    /* the bug: it will try again at once, and again */
#endif
    fi;
    i = 0; j = 0; v = 0; stuck = 0
}

#define RUNNABLE (ss[1] == S_WAIT || ss[1] == S_RUN || ss[1] == S_PRE \
                  || ss[2] == S_WAIT || ss[2] == S_RUN || ss[2] == S_PRE \
                  || ss[3] == S_WAIT || ss[3] == S_RUN || ss[3] == S_PRE)

/* The sender task: flush decisions to the Detokenizer; plan while fewer than MAXFLIGHT
   steps are in flight. */
active proctype SchedSend() {
    byte toks, fins, frees, errs;
end:
    do
    :: atomic {
        ALIVE (pend_tok | pend_fin | pend_freed) != 0 ->
        toks = pend_tok; fins = pend_fin; frees = pend_freed; errs = pend_err;
        pend_tok = 0; pend_fin = 0; pend_freed = 0; pend_err = 0;
        det_in ! toks, fins, frees, errs;
        toks = 0; fins = 0; frees = 0; errs = 0
       }
    :: atomic { ALIVE (nflight == 0 || (nflight < MAXFLIGHT && !tried_ahead)) && RUNNABLE ->
                apply_pauses();
                if
                :: RUNNABLE -> plan();
                    if
                    :: pmask != 0 -> wk_in ! pmask
                    :: else -> skip /* nothing to plan ahead */
                    fi
                :: else -> skip     /* everything left is paused */
                fi;
                pmask = 0 }
    od
}

/* ---------------------------------------------------------------- Worker */

active proctype Worker() {
    byte mask, eos;
end:
    do
    :: atomic {
        LIVE(wk_in) -> wk_in ? mask;
        /* the KV this step writes is still allocated to the leaves it plans */
        for (i : FIRST .. LAST) { assert(!(mask & BIT(i)) || nblk[i] > 0) }
        if
#ifndef NO_FAIL
        :: eos = ERR            /* the step failed */
#endif
        :: eos = 0;
            for (i : FIRST .. LAST) {
                if
                :: mask & BIT(i) -> eos = eos | BIT(i)   /* sampled EOS */
                :: true -> skip
                fi
            }
            i = 0
        fi;
        sch_in ! RESULT, mask, eos;
        mask = 0; eos = 0
       }
    od
}

/* ---------------------------------------------------------------- Detokenizer */

active proctype Detokenizer() {
    byte toks, fins, frees, errs, shown, r;
end:
    do
    :: atomic {
        LIVE(det_in) -> det_in ? toks, fins, frees, errs;
        for (r : FIRST .. LAST) {
            if
            :: toks & BIT(r) && !dstop[r] ->
                shown = shown | BIT(r);
#ifndef NO_STOP
                if
                :: !(fins & BIT(r)) && r != C1 ->           /* a stop string matched: */
                    dstop[r] = 1; sch_in ! STOP, r, life[r]  /* StopMatched goes first */
                :: true -> skip
                fi
#endif
            :: else -> skip     /* after a stop string nothing more is shown */
            fi
        }
        for (r : FIRST .. LAST) {
            if
            :: fins & BIT(r) -> dstop[r] = 0
            :: else -> skip
            fi
        }
        fe_in ! shown, fins, frees, 0, errs;
        toks = 0; fins = 0; frees = 0; errs = 0; shown = 0; r = 0
       }
    od
}

#ifdef DEATH
/* ---------------------------------------------------------------- the engine dies */

/* AsyncEngine.mark_dead -> Frontend.lose_all, in one step of the Frontend's process: every
   live leaf is lost (`lose`, unless the Scheduler had freed it), answered with the error if
   it was not answered yet, and forgotten; the parent is gathered with its last child. */
active proctype EngineDeath() {
end:                            /* (or it never dies) */
    atomic {
        reg[FIRST] || reg[LAST] ->              /* something is live */
        dead = 1;
        for (i : FIRST .. LAST) {
            if
            :: reg[i] && !freed[i] -> fire(i, E_LOSE); freed[i] = 1;
                if
                :: !resp[i] -> resp[i] = 1; fire(i, E_RESPOND)    /* engine_dead */
                :: else -> skip
                fi;
                maybe_forget(i)
            :: reg[i] && freed[i] -> resp[i] = 1; fire(i, E_RESPOND); maybe_forget(i)
            :: else -> skip
            fi
        }
        i = 0
    }
}
#endif

/* ---------------------------------------------------------------- after drain (invariant 4) */

active proctype Drain() {
    timeout ->                  /* nothing can move: the engine is idle */
    d_step {
        assert(clients_done == CLIENTS);
#ifdef DEATH
        if
        :: dead ->              /* the engine's state died with it: the Frontend holds none */
            for (i : FIRST .. LAST) { assert(!reg[i] && released[i] && term[i] <= 1) };
#ifdef HAVE_P
            assert(!reg[P] && gathered);
#endif
            i = 0; drained = 1; goto done
        :: else -> skip
        fi;
#endif
        assert(len(tok_in) == 0 && len(sch_in) == 0 && len(wk_in) == 0 && len(det_in) == 0
               && len(fe_in) == 0);             /* every mailbox empty */
        assert(nflight == 0 && nfree == NB);    /* every block free */
#ifdef HAVE_P
        assert(!reg[P] && gathered);            /* invariant 6: P ended with its children */
#endif
        for (i : FIRST .. LAST) {
            assert(!reg[i] && released[i]);     /* every registry empty */
            assert(ss[i] == S_NONE && nblk[i] == 0 && !dstop[i]);
            assert(term[i] == 1)                /* every leaf ended exactly once */
        }
        i = 0;
        drained = 1;
done:   skip
    }
}

/* The invariants as temporal properties, checked one at a time: ./pan -a -N name.
   invariants: always at most one terminal event per life (2), and the parent ends only
   after its children are RELEASED (6); drains: every run ends drained (4, as liveness). */
ltl invariants { [] (term[C0] <= 1 && term[C1] <= 1 && term[A] <= 1
                     && (gathered -> (released[C0] && released[C1]))) }
ltl drains { <> drained }
