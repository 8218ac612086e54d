#!/usr/bin/env bash
# Run every fuzz harness for SECONDS each (default 60): fuzz/run.sh [SECONDS]
#
# Needs atheris (pip install atheris). New interesting inputs go to a scratch corpus
# ($FUZZ_OUT/<name>/corpus, default under /tmp), so the committed seeds in
# fuzz/corpus/<name>/ stay as they are; a crash is written to $FUZZ_OUT/<name>/ and the
# script exits non-zero. Copy the crash into fuzz/crashes/<name>/ with the fix:
# tests/test_fuzz_regressions.py replays it from then on. $FUZZ_FLAGS adds libFuzzer
# flags (CI passes a fixed -seed, so its short runs explore the same ground each time).
set -u
seconds=${1:-60}
here=$(cd "$(dirname "$0")" && pwd)
out=${FUZZ_OUT:-${TMPDIR:-/tmp}/actorllm-fuzz}
status=0
for harness in "$here"/fuzz_*.py; do
    name=$(basename "$harness" .py)
    name=${name#fuzz_}
    mkdir -p "$out/$name/corpus"
    echo "== $name: ${seconds}s"
    # shellcheck disable=SC2086  # FUZZ_FLAGS is a list of flags
    if ! python "$harness" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 ${FUZZ_FLAGS:-} \
            -artifact_prefix="$out/$name/" "$out/$name/corpus" "$here/corpus/$name" \
            2>"$out/$name/log"; then
        echo "!! $name failed; see $out/$name/log and the crash input in $out/$name/"
        tail -n 30 "$out/$name/log"
        status=1
    else
        grep -E '^Done' "$out/$name/log" || true
    fi
done
exit $status
