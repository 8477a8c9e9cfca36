#!/usr/bin/env bash
# loaded-runs.sh [RUNS] [BUSY]: runs the test command (scripts/test.sh)
# RUNS times in a row (default 20) beside BUSY busy loops (default 2, one
# per core here), to find the tests that fail by chance before they fail a
# CI run. Each run's log is kept; the end prints one line per run (status,
# time, nextest's summary) and every test that failed, with how often.
#
#   bash scripts/loaded-runs.sh            # 20 runs, 2 busy loops
#   bash scripts/loaded-runs.sh 5 0        # 5 runs on an idle machine
#
# nextest's retries stay off (.config/nextest.toml): a test that passes only
# on a retry is a test that fails by chance. Build first (one run of the
# test command) so that every run measures the tests, not the build.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-20}
busy=${2:-2}
logs=$(mktemp -d /tmp/cqd-loaded-runs.XXXXXX)
echo "loaded-runs: $runs runs of scripts/test.sh beside $busy busy loop(s); logs in $logs"

pids=()
stop_busy() { ((${#pids[@]} == 0)) || kill "${pids[@]}" 2>/dev/null || true; }
trap stop_busy EXIT
for ((i = 0; i < busy; i++)); do
  # A shell loop at normal priority, as another tenant's work would be.
  bash -c 'while :; do :; done' &
  pids+=($!)
done

failed_runs=0
for ((r = 1; r <= runs; r++)); do
  log=$logs/run$r.log
  t0=$(date +%s)
  rc=0
  bash scripts/test.sh </dev/null >"$log" 2>&1 || rc=$?
  summary=$(grep -E '^ *Summary \[' "$log" | tail -n 1 | sed 's/^ *//')
  printf 'run %2d: status %d in %4d s  %s\n' "$r" "$rc" "$(($(date +%s) - t0))" "${summary:-no nextest summary}"
  if ((rc != 0)); then
    failed_runs=$((failed_runs + 1))
    grep -E '^ *(FAIL|SIGSEGV|SIGABRT|TIMEOUT|LEAK) \[' "$log" | sort -u | sed 's/^/        /' || true
  fi
done

echo "loaded-runs: $((runs - failed_runs)) of $runs runs passed"
if ((failed_runs)); then
  echo "tests that failed, with the number of runs they failed in:"
  for log in "$logs"/run*.log; do
    # nextest names a failure twice (as it ends, and in the summary).
    grep -E '^ *(FAIL|SIGSEGV|SIGABRT|TIMEOUT) \[' "$log" | awk '{ print $(NF - 1), $NF }' | sort -u
  done | sort | uniq -c | sort -rn
  exit 1
fi
