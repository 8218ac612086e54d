/* Generated from spec/lifecycle.toml by `python -m actorllm.lifecycle.table
   --promela > spec/lifecycle_table.pml`: edit the table, not this file.
   tests/test_spin.py checks that the two agree. */

#define L_NONE 0
#define L_CREATED 1
#define L_TOKENIZING 2
#define L_WAITING 3
#define L_RUNNING 4
#define L_PREEMPTED 5
#define L_PAUSED 6
#define L_FINISHED 7
#define L_FREED 8
#define L_RESPONDED 9
#define L_RELEASED 10
#define L_GATHERING 11
#define E_REGISTER 1
#define E_DISPATCH 2
#define E_FAN_OUT 3
#define E_GATHER 4
#define E_REJECT 5
#define E_ENQUEUE 6
#define E_SCHEDULE 7
#define E_PREEMPT 8
#define E_PAUSE 9
#define E_RESUME 10
#define E_FINISH 11
#define E_ABORT 12
#define E_FAIL 13
#define E_LOSE 14
#define E_FREE 15
#define E_RESPOND 16
#define E_FORGET 17

#ifdef CHECK_TABLE
byte ls[NR];           /* each rid's state in the table (L_*) */

inline fire(r, e) {
    if
    :: e == E_REGISTER && (ls[r] == L_NONE || ls[r] == L_RELEASED) -> ls[r] = L_CREATED
    :: e == E_DISPATCH && (ls[r] == L_CREATED) -> ls[r] = L_TOKENIZING
    :: e == E_FAN_OUT && (ls[r] == L_CREATED) -> ls[r] = L_GATHERING
    :: e == E_GATHER && (ls[r] == L_GATHERING) -> ls[r] = L_RELEASED
    :: e == E_REJECT && (ls[r] == L_TOKENIZING) -> ls[r] = L_FREED
    :: e == E_ENQUEUE && (ls[r] == L_TOKENIZING) -> ls[r] = L_WAITING
    :: e == E_SCHEDULE && (ls[r] == L_WAITING || ls[r] == L_PREEMPTED) -> ls[r] = L_RUNNING
    :: e == E_PREEMPT && (ls[r] == L_RUNNING) -> ls[r] = L_PREEMPTED
    :: e == E_PREEMPT && (ls[r] == L_PAUSED) -> ls[r] = L_PAUSED
    :: e == E_PAUSE && (ls[r] == L_WAITING || ls[r] == L_RUNNING || ls[r] == L_PREEMPTED) -> ls[r] = L_PAUSED
    :: e == E_RESUME && (ls[r] == L_PAUSED) -> ls[r] = L_PREEMPTED
    :: e == E_FINISH && (ls[r] == L_RUNNING || ls[r] == L_PREEMPTED || ls[r] == L_PAUSED) -> ls[r] = L_FINISHED
    :: e == E_ABORT && (ls[r] == L_WAITING || ls[r] == L_RUNNING || ls[r] == L_PREEMPTED || ls[r] == L_PAUSED) -> ls[r] = L_FINISHED
    :: e == E_FAIL && (ls[r] == L_WAITING || ls[r] == L_RUNNING || ls[r] == L_PREEMPTED || ls[r] == L_PAUSED) -> ls[r] = L_FINISHED
    :: e == E_LOSE && (ls[r] == L_CREATED || ls[r] == L_TOKENIZING || ls[r] == L_WAITING || ls[r] == L_RUNNING || ls[r] == L_PREEMPTED || ls[r] == L_PAUSED || ls[r] == L_FINISHED) -> ls[r] = L_FREED
    :: e == E_LOSE && (ls[r] == L_FREED) -> ls[r] = L_FREED
    :: e == E_LOSE && (ls[r] == L_RESPONDED || ls[r] == L_RELEASED) -> ls[r] = L_RELEASED
    :: e == E_FREE && (ls[r] == L_FINISHED) -> ls[r] = L_FREED
    :: e == E_FREE && (ls[r] == L_RESPONDED) -> ls[r] = L_RELEASED
    :: e == E_RESPOND && (ls[r] == L_FINISHED) -> ls[r] = L_RESPONDED
    :: e == E_RESPOND && (ls[r] == L_FREED) -> ls[r] = L_RELEASED
    :: e == E_FORGET && (ls[r] == L_RELEASED) -> ls[r] = L_RELEASED
    :: else -> assert(false)  /* the table has no row for this move */
    fi
}
#else
inline fire(r, e) { skip }  /* without the check the model is unchanged */
#endif
