#!/usr/bin/env bash
# Run every fuzz harness for RUNS inputs each (default 100000): fuzz/run.sh [RUNS]
#
# Needs atheris (pip install atheris). A budget of runs, not seconds, with a fixed -seed
# (CI passes one in $FUZZ_FLAGS) makes a run cover the same ground on a fast machine and
# on a loaded one. $FUZZ_GUARD_SECONDS (default 3600) only stops a harness that hangs; a
# harness that reaches it before its runs are done fails, saying so, rather than
# passing on less ground.
#
# New interesting inputs go to a scratch corpus ($FUZZ_OUT/<name>/corpus, default under
# /tmp), so the committed seeds in fuzz/corpus/<name>/ stay as they are; a crash is
# written to $FUZZ_OUT/<name>/ and the script exits non-zero. Copy the crash into
# fuzz/crashes/<name>/ with the fix: tests/test_fuzz_regressions.py replays it from then
# on. $FUZZ_FLAGS adds libFuzzer flags.
set -u
runs=${1:-100000}
guard=${FUZZ_GUARD_SECONDS:-3600}
here=$(cd "$(dirname "$0")" && pwd)
out=${FUZZ_OUT:-${TMPDIR:-/tmp}/actorllm-fuzz}
status=0
for harness in "$here"/fuzz_*.py; do
    name=$(basename "$harness" .py)
    name=${name#fuzz_}
    mkdir -p "$out/$name/corpus"
    echo "== $name: $runs runs"
    # shellcheck disable=SC2086  # FUZZ_FLAGS is a list of flags
    if ! python "$harness" -runs="$runs" -max_total_time="$guard" -timeout=30 \
            -rss_limit_mb=4096 ${FUZZ_FLAGS:-} \
            -artifact_prefix="$out/$name/" "$out/$name/corpus" "$here/corpus/$name" \
            2>"$out/$name/log"; then
        echo "!! $name failed; see $out/$name/log and the crash input in $out/$name/"
        tail -n 30 "$out/$name/log"
        status=1
        continue
    fi
    done_line=$(grep -E '^Done [0-9]+ runs' "$out/$name/log" | tail -n 1)
    echo "${done_line:-no 'Done' line in $out/$name/log}"
    # libFuzzer counts the corpus it replays first as runs too, so at least RUNS is done
    # unless the guard cut it short.
    done_runs=$(sed -E 's/^Done ([0-9]+) runs.*/\1/' <<<"$done_line")
    if [ -z "$done_runs" ] || [ "$done_runs" -lt "$runs" ]; then
        echo "!! $name stopped at ${done_runs:-?} of $runs runs (the ${guard}s guard)"
        status=1
    fi
done
exit $status
