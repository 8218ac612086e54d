/*
 * lifecycle.pml: a Promela model of actorllm's request protocol, for the SPIN model checker.
 *
 * What it is. The actors of DESIGN.md section 1 as processes over bounded FIFO channels:
 * two API-layer clients, the Frontend, the Tokenizer, the Scheduler (two processes: its
 * receive loop and its sender task, as in actorllm/scheduler.py), the Worker and the
 * Detokenizer. SPIN explores every interleaving of them and checks the invariants of
 * spec/lifecycle.toml with assertions, a check after drain, and LTL formulas.
 * spec/README.md ("Model checking") says how to run it; tests/test_spin.py runs it in CI.
 *
 * The bounds (small on purpose: an exhaustive check takes seconds):
 *   rid 0 = P, a request with n = 2, known only to the Frontend (its children are 1 and 2);
 *   rid 3 = A, a request with n = 1 whose client may reuse its rid once it is free;
 *   each leaf generates at most MAXTOK = 2 tokens; the KV pool holds NB = 3 blocks and a
 *   leaf needs 1 block before its first token and 2 after it, so three leaves cannot all
 *   decode at once and preemption happens; every mailbox holds CAP = 2 messages, so
 *   backpressure (a blocked send) happens too.
 *
 * Nondeterminism stands for what the model does not compute: the client may abort (or
 * disconnect, which calls abort) at any moment and twice; the Tokenizer may reject a
 * prompt; a sampled token may be EOS; a step may fail; a stop string may match any text.
 *
 * Modelling choices (each one a reason the model is small, none a reason it is wrong):
 * - A message send that follows a decision in the same trio task is atomic with that
 *   decision and waits for room first. That is how trio behaves: send_nowait queues at
 *   once, and senders parked on a full channel are woken in FIFO order.
 * - One TokenBatch of the real Scheduler becomes one message per rid per kind, sent in the
 *   order the Frontend handles them (tokens, finish, freed).
 * - Sampling, text, chunked prefill and the token budget are not modelled; a step gives
 *   every planned leaf one token.
 *
 * Planted bugs (tests/test_spin.py checks that SPIN finds each, and nothing without them):
 *   BUG_FREE_BEFORE_FENCE        a finished leaf's blocks are freed while a step uses them
 *   BUG_ABORT_BYPASS             aborts go Frontend -> Scheduler directly, not on the FIFO edge
 *   BUG_LATE_RESULT_COMMIT       tokens of a late result are committed to a finished leaf
 *   BUG_FORGET_BEFORE_FREE       the Frontend forgets a rid once answered, before the free
 *   BUG_GATHER_EARLY             a n > 1 parent ends when its first child ends
 *   BUG_REGISTER_AFTER_DISPATCH  the Frontend sends TokenizeRequest before registering
 */

#define NR      4      /* rids 0..3 */
#define P       0      /* the n = 2 parent */
#define C0      1      /* its children "P-0" and "P-1" */
#define C1      2
#define A       3      /* a plain request */
#define NB      3      /* KV blocks */
#define MAXTOK  2      /* max_tokens of every leaf */
#define CAP     2      /* mailbox capacity */
#define NOBODY  255

/* Scheduler-side state of a leaf (the Sequence.status of actorllm/scheduler.py). */
#define S_NONE  0      /* no Sequence: never arrived, or freed */
#define S_WAIT  1
#define S_RUN   2
#define S_PRE   3
#define S_FIN   4      /* finished; blocks kept until the step fence */

/* Finish reasons. */
#define R_NONE   0
#define R_STOP   1
#define R_LENGTH 2
#define R_ABORT  3
#define R_ERROR  4

#define ERR      255   /* RESULT's eos field for a failed step */
#define BIT(r)   (1 << (r))
#define WANT(r)  (1 + (out[r] >= 1))   /* blocks a leaf needs for its next step */
#define LEAF(r)  (r == C0 || r == C1 || r == A)

mtype = { TOKENIZE, ABORT, SEQ, STOP, RESULT, TOK, FIN, FREED, FAILED, DELTA, FINISHED };

/* Edges. Aborts share the Frontend -> Tokenizer -> Scheduler edge with the request. */
chan tok_in = [CAP] of { mtype, byte, byte };  /* TOKENIZE(rid, life), ABORT(rid, life) */
chan sch_in = [CAP] of { mtype, byte, byte };  /* SEQ/ABORT (Tokenizer), STOP (Detokenizer):
                                                  (rid, life); RESULT (Worker): (mask, eos) */
chan wk_in  = [1]   of { byte };               /* PLAN: the mask of planned rids */
chan det_in = [CAP] of { mtype, byte, byte };  /* TOK(rid), FIN(rid, reason), FREED(rid) */
chan fe_in  = [CAP] of { mtype, byte, byte };  /* DELTA, FINISHED, FREED (Detokenizer);
                                                  FAILED (Tokenizer) */

/* The Frontend's registry (actorllm/frontend.py, RequestState). */
bool reg[NR];          /* the rid is live in the registry */
bool resp[NR];         /* the client has its final output (respond fired) */
bool freed[NR];        /* the Scheduler has freed it (or it never reached the Scheduler) */
bool abort_sent[NR];
byte clients_done;

/* The Scheduler (actorllm/scheduler.py). */
byte ss[NR];           /* S_* */
byte out[NR];          /* output tokens committed */
byte nblk[NR];         /* blocks in its block table */
bool in_step[NR];      /* the step in flight plans it: the fence */
byte owner[NB] = NOBODY; /* block -> rid, or NOBODY when in the free pool */
byte nfree = NB;
bool in_flight;        /* one step in flight at a time */
byte pmask;            /* the rids of the step in flight */
bool pend_tok[NR];     /* decided but not yet sent to the Detokenizer */
byte pend_fin[NR];
bool pend_freed[NR];

/* The Detokenizer: a stop string matched for this rid; nothing more is shown. */
bool dstop[NR];

/* Ghost state: written only to state properties; no actor reads it. */
byte life[NR];         /* registrations of the rid; messages carry it */
byte slife[NR];        /* life of the Sequence the Scheduler holds */
byte arrived[NR];      /* the last life that got past the Tokenizer */
byte term[NR];         /* terminal events in the current life (invariant 2) */
bool ref[NB];          /* the step in flight references this block (invariant 3) */
bool gathered;         /* P ended */
bool released[NR];     /* RELEASED: forgotten by the Frontend and freed by the Scheduler */
bool drained;          /* the drain check passed (invariant 4) */

/* Scratch for loops inside atomic sections; hidden: not part of the state. */
hidden byte i, j, b, v, stuck;

/* ---------------------------------------------------------------- Frontend, API side */

/* register: a fresh registry entry (the rid is not live: checked by the caller). */
inline register(r) {
    assert(!reg[r]);
    reg[r] = 1; resp[r] = 0; freed[r] = 0; abort_sent[r] = 0; released[r] = 0;
    life[r]++; term[r] = 0
}

/* Frontend.submit for one leaf: register before dispatch (invariant 1). */
inline submit_leaf(r) {
#ifdef BUG_REGISTER_AFTER_DISPATCH
    atomic { nfull(tok_in) -> tok_in ! TOKENIZE, r, life[r] + 1 };
    atomic { register(r) }
#else
    atomic { nfull(tok_in) -> register(r); tok_in ! TOKENIZE, r, life[r] }
#endif
}

/* Frontend.abort for one leaf: idempotent, and a no-op once the client is answered. */
inline abort_leaf(r) {
    atomic {
        if
        :: !reg[r] || resp[r] || abort_sent[r] -> skip
#ifdef BUG_ABORT_BYPASS
        :: reg[r] && !resp[r] && !abort_sent[r] && nfull(sch_in) ->
            abort_sent[r] = 1; sch_in ! ABORT, r, life[r]
#else
        :: reg[r] && !resp[r] && !abort_sent[r] && nfull(tok_in) ->
            abort_sent[r] = 1; tok_in ! ABORT, r, life[r]
#endif
        fi
    }
}

/* The client of P (n = 2): fan-out at the edge, then maybe abort, twice, at any time. */
active proctype ClientP() {
    byte k;
    atomic { register(P) };     /* register and fan_out */
    submit_leaf(C0);
    submit_leaf(C1);
    do
    :: k < 2 -> k++;            /* abort, or disconnect (whose clean-up calls abort) */
        if
        :: reg[P] -> abort_leaf(C0); abort_leaf(C1)   /* aborting the parent aborts every child */
        :: else -> skip
        fi
    :: break
    od;
    clients_done++
}

/* The client of A (n = 1): maybe abort; once answered, maybe reuse the rid. */
active proctype ClientA() {
    byte k;
    submit_leaf(A);
    do
    :: k < 2 -> k++; abort_leaf(A)
    :: break
    od;
    resp[A];                    /* the client has read its final output */
    atomic {
        if
        :: reg[A] -> skip       /* still live: DuplicateRequestId, the client gives up */
        :: !reg[A] && nfull(tok_in) -> register(A); tok_in ! TOKENIZE, A, life[A]
        :: skip                 /* or the client does not come back */
        fi
    };
    clients_done++
}

/* ---------------------------------------------------------------- Frontend, its actor loop */

inline maybe_forget(r) {
#ifdef BUG_FORGET_BEFORE_FREE
    if
    :: resp[r] ->
#else
    if
    :: resp[r] && freed[r] ->
#endif
        reg[r] = 0;             /* forget */
        released[r] = (ss[r] == S_NONE);
        if
#ifdef BUG_GATHER_EARLY
        :: (r == C0 || r == C1) && reg[P] && (!reg[C0] || !reg[C1]) ->
#else
        :: (r == C0 || r == C1) && reg[P] && !reg[C0] && !reg[C1] ->
#endif
            /* invariant 6: the parent ends only after every child is RELEASED */
            assert(!reg[C0] && !reg[C1] && ss[C0] == S_NONE && ss[C1] == S_NONE);
            reg[P] = 0; gathered = 1; released[P] = 1
        :: else -> skip
        fi
    :: else -> skip
    fi
}

active proctype Frontend() {
    mtype m; byte r, x;
end:
    do
    :: fe_in ? m, r, x ->
        atomic {
            if
            :: m == DELTA ->
                /* output for a rid that is not live is dropped (late output), else shown */
                skip
            :: m == FINISHED || m == FAILED ->
                if
                :: reg[r] && !resp[r] ->
                    resp[r] = 1;                        /* respond: the client's final output */
                    freed[r] = freed[r] || m == FAILED; /* rejected: nothing to free */
                    maybe_forget(r)
                :: else -> skip
                fi
            :: m == FREED ->
                if
                :: reg[r] -> freed[r] = 1; maybe_forget(r)
                :: else -> skip
                fi
            fi;
            m = 0; r = 0; x = 0
        }
    od
}

/* ---------------------------------------------------------------- Tokenizer */

active proctype Tokenizer() {
    mtype m; byte r, l;
end:
    do
    :: tok_in ? m, r, l ->
        if
        :: m == ABORT -> sch_in ! ABORT, r, l    /* forwarded on the request's own edge */
        :: m == TOKENIZE ->
            assert(reg[r] && life[r] == l);     /* invariant 1: registered before dispatch */
            if
            :: sch_in ! SEQ, r, l
            :: atomic { arrived[r] = l; term[r]++; fe_in ! FAILED, r, R_ERROR }   /* reject */
            fi
        fi;
        m = 0; r = 0; l = 0
    od
}

/* ---------------------------------------------------------------- Scheduler */

/* Give r blocks up to WANT(r). */
inline alloc(r) {
    for (b : 0 .. NB - 1) {
        if
        :: owner[b] == NOBODY && nblk[r] < WANT(r) -> owner[b] = r; nblk[r]++; nfree--
        :: else -> skip
        fi
    }
}

/* r's blocks back to the pool: each exactly once, never while a step uses it (invariant 3). */
inline release(r) {
    for (b : 0 .. NB - 1) {
        if
        :: owner[b] == r -> assert(!ref[b]); owner[b] = NOBODY; nfree++
        :: else -> skip
        fi
    }
    nblk[r] = 0
}

inline free_seq(r) {
    release(r);
    ss[r] = S_NONE; pend_freed[r] = 1
}

/* The one terminal transition (finish, abort or fail): blocks now, or after the fence. */
inline finish(r, reason) {
    ss[r] = S_FIN;
    term[r]++;
    assert(term[r] == 1);       /* invariant 2: exactly one terminal event */
    pend_fin[r] = reason;
#ifdef BUG_FREE_BEFORE_FENCE
    free_seq(r)
#else
    if
    :: !in_step[r] -> free_seq(r)
    :: else -> skip             /* fenced: freed when the step in flight returns */
    fi
#endif
}

/* Abort or stop string: idempotent; stops future work, never undoes launched work. */
inline finish_early(r, l, reason) {
    if
    :: ss[r] == S_WAIT || ss[r] == S_RUN || ss[r] == S_PRE ->
        assert(slife[r] == l);  /* a stale abort or stop never hits a reused rid */
        finish(r, reason)
    :: else -> skip             /* already finished, freed, or rejected */
    fi
}

inline commit(r) {
    assert(term[r] == 0);       /* invariant 2: no output after the terminal event */
    out[r]++; pend_tok[r] = 1
}

inline on_result(mask, eos) {
    in_flight = 0;
    for (b : 0 .. NB - 1) { ref[b] = 0 }
    /* The fence has passed: leaves that finished meanwhile give their blocks back. */
    for (i : 1 .. NR - 1) {
        if
        :: in_step[i] -> in_step[i] = 0;
            if
            :: ss[i] == S_FIN -> free_seq(i)
            :: else -> skip
            fi
        :: else -> skip
        fi
    }
    for (i : 1 .. NR - 1) {
        if
        :: mask & BIT(i) ->
            if
            :: ss[i] == S_RUN && eos == ERR -> finish(i, R_ERROR)
            :: ss[i] == S_RUN && eos != ERR ->
                commit(i);
                if
                :: eos & BIT(i) -> finish(i, R_STOP)
                :: !(eos & BIT(i)) && out[i] >= MAXTOK -> finish(i, R_LENGTH)
                :: else -> skip
                fi
#ifdef BUG_LATE_RESULT_COMMIT
            :: ss[i] != S_RUN && eos != ERR -> commit(i)
#endif
            :: else -> skip     /* a late result: the leaf finished while the step ran */
            fi
        :: else -> skip
        fi
    }
}

/* The receive loop: handling a message never blocks (Scheduler.handle). */
active proctype SchedRecv() {
    mtype m; byte a, x;
end:
    do
    :: sch_in ? m, a, x ->
        atomic {
            if
            :: m == SEQ ->
                assert(ss[a] == S_NONE);        /* a rid is unique while live */
                ss[a] = S_WAIT; out[a] = 0; slife[a] = x; arrived[a] = x
            :: m == ABORT ->
                assert(arrived[a] >= x);        /* the abort never overtakes its request */
                finish_early(a, x, R_ABORT)
            :: m == STOP -> finish_early(a, x, R_STOP)
            :: m == RESULT -> on_result(a, x)
            fi;
            m = 0; a = 0; x = 0
        }
    od
}

/* Preempt by recompute: blocks back now (no step is in flight, so no fence applies). */
inline preempt(r) {
    assert(!in_step[r] && !in_flight);
    release(r);
    ss[r] = S_PRE
}

/* Scheduler.schedule: running leaves first (preempting the newest when the pool is
   exhausted), then admissions, preempted ones first, stopping at the first that does not fit. */
inline plan() {
    pmask = 0;
    for (i : 1 .. NR - 1) {
        if
        :: ss[i] == S_RUN ->
            do
            :: WANT(i) <= nblk[i] + nfree -> alloc(i); pmask = pmask | BIT(i); break
            :: else ->
                v = i;
                for (j : 1 .. NR - 1) {
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
    stuck = 0;
    for (j : 0 .. 1) {          /* j = 0: preempted leaves; j = 1: waiting ones */
        for (i : 1 .. NR - 1) {
            if
            :: !stuck && ((j == 0 && ss[i] == S_PRE) || (j == 1 && ss[i] == S_WAIT)) ->
                if
                :: WANT(i) <= nfree -> alloc(i); ss[i] = S_RUN; pmask = pmask | BIT(i)
                :: else -> stuck = 1
                fi
            :: else -> skip
            fi
        }
    }
    assert(pmask != 0);         /* the pool holds one leaf's needs: something always fits */
    in_flight = 1;
    for (i : 1 .. NR - 1) {
        if
        :: pmask & BIT(i) -> in_step[i] = 1
        :: else -> skip
        fi
    }
    for (b : 0 .. NB - 1) {
        if
        :: owner[b] != NOBODY && (pmask & BIT(owner[b])) -> ref[b] = 1
        :: else -> ref[b] = 0
        fi
    }
    i = 0; j = 0; b = 0; v = 0; stuck = 0
}

#define PENDING (pend_tok[1] || pend_tok[2] || pend_tok[3] || pend_fin[1] || pend_fin[2] \
                 || pend_fin[3] || pend_freed[1] || pend_freed[2] || pend_freed[3])
#define RUNNABLE (ss[1] == S_RUN || ss[2] == S_RUN || ss[3] == S_RUN || ss[1] == S_WAIT \
                  || ss[2] == S_WAIT || ss[3] == S_WAIT || ss[1] == S_PRE || ss[2] == S_PRE \
                  || ss[3] == S_PRE)

/* One TokenBatch in transit (taken from the pending outputs, then sent). */
bool b_tok[NR];
byte b_fin[NR];
bool b_freed[NR];

/* The sender task: flush outputs to the Detokenizer; plan when no step is in flight. */
active proctype SchedSend() {
    byte r;
end:
    do
    :: atomic {
        PENDING ->
        for (i : 1 .. NR - 1) {
            b_tok[i] = pend_tok[i]; b_fin[i] = pend_fin[i]; b_freed[i] = pend_freed[i];
            pend_tok[i] = 0; pend_fin[i] = 0; pend_freed[i] = 0
        }
        i = 0; r = 1
       };
        do
        :: r < NR ->
            if
            :: b_tok[r] -> det_in ! TOK, r, 0; b_tok[r] = 0
            :: else -> skip
            fi;
            if
            :: b_fin[r] != R_NONE -> det_in ! FIN, r, b_fin[r]; b_fin[r] = R_NONE
            :: else -> skip
            fi;
            r++
        :: else -> break
        od;
        r = 1;
        do
        :: r < NR ->
            if
            :: b_freed[r] -> det_in ! FREED, r, 0; b_freed[r] = 0
            :: else -> skip
            fi;
            r++
        :: else -> r = 0; break
        od
    :: atomic { !in_flight && RUNNABLE -> plan() };
        wk_in ! pmask
    od
}

/* ---------------------------------------------------------------- Worker */

active proctype Worker() {
    byte mask, eos;
end:
    do
    :: wk_in ? mask ->
        atomic {
            /* the KV this step writes is still allocated to the leaves it plans */
            for (b : 0 .. NB - 1) {
                assert(!ref[b] || (owner[b] != NOBODY && (mask & BIT(owner[b]))))
            }
            b = 0;
            if
            :: eos = ERR        /* the step failed */
            :: eos = 0;
                for (i : 1 .. NR - 1) {
                    if
                    :: mask & BIT(i) -> eos = eos | BIT(i)    /* sampled EOS */
                    :: true -> skip
                    fi
                }
                i = 0
            fi
        };
        sch_in ! RESULT, mask, eos;
        mask = 0; eos = 0
    od
}

/* ---------------------------------------------------------------- Detokenizer */

active proctype Detokenizer() {
    mtype m; byte r, x;
end:
    do
    :: det_in ? m, r, x ->
        if
        :: m == TOK && dstop[r] -> skip         /* after a stop string nothing is shown */
        :: m == TOK && !dstop[r] ->
            if
            :: dstop[r] = 1; sch_in ! STOP, r, life[r]    /* a stop string matched */
            :: skip
            fi;
            fe_in ! DELTA, r, 0
        :: m == FIN ->
            if
            :: dstop[r] && x != R_ABORT && x != R_ERROR -> x = R_STOP
            :: else -> skip
            fi;
            dstop[r] = 0;
            fe_in ! FINISHED, r, x
        :: m == FREED -> fe_in ! FREED, r, 0
        fi;
        m = 0; r = 0; x = 0
    od
}

/* ---------------------------------------------------------------- after drain (invariant 4) */

active proctype Drain() {
    (clients_done == 2 && !reg[P] && !reg[C0] && !reg[C1] && !reg[A] && !in_flight
     && len(tok_in) == 0 && len(sch_in) == 0 && len(wk_in) == 0 && len(det_in) == 0
     && len(fe_in) == 0 && !PENDING);
    atomic {
        for (b : 0 .. NB - 1) { assert(owner[b] == NOBODY) }    /* every block free */
        assert(nfree == NB);
        for (i : 1 .. NR - 1) {
            assert(ss[i] == S_NONE && !dstop[i]);   /* every registry empty */
            assert(term[i] == 1);                   /* every leaf ended exactly once */
            assert(released[i])
        }
        assert(gathered);       /* invariant 6: the parent ended with its children */
        drained = 1
    }
}

/* The invariants as temporal properties (checked one at a time: ./pan -a -N name). */
ltl one_terminal { [] (term[C0] <= 1 && term[C1] <= 1 && term[A] <= 1) }
ltl gather_after_children { [] (gathered -> (released[C0] && released[C1])) }
ltl drains { <> drained }
