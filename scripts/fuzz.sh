#!/usr/bin/env bash
# Runs every cargo-fuzz target under fuzz/ for SECONDS each (default 20)
# and prints each one's execution count; any crash fails the script (its
# input is kept under fuzz/artifacts/TARGET/). Inputs that once failed are
# kept in fuzz/regressions/TARGET/ and read at every run's start. docs/reliability.md records
# longer runs made with this script.
#
#   bash scripts/fuzz.sh            # 20 s per target (what .ci/run runs)
#   bash scripts/fuzz.sh 600        # 10 minutes per target
#   bash scripts/fuzz.sh 60 sim_verbs poller_stream
#   bash scripts/fuzz.sh --build-only     # build every target, run none
#
# Needs the nightly toolchain and cargo-fuzz (.ci/run installs both). The
# build directory is kept between runs (CQD_FUZZ_TARGET, by default under
# /var/tmp) so that a later run rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
build_only=0
if [[ ${1:-} == --build-only ]]; then build_only=1; shift; fi
secs=${1:-20}
shift || true
targets=("$@")
if [ $# -eq 0 ]; then
  mapfile -t targets < <(cargo +nightly fuzz list)
fi
export CARGO_TARGET_DIR=${CQD_FUZZ_TARGET:-/var/tmp/cqd-fuzz-target}
# The topology parser starts from the shipped configurations.
mkdir -p corpus/topology
cp -f ../examples/*.toml corpus/topology/

if [ $# -eq 0 ]; then
  cargo +nightly fuzz build 2>&1 | tail -n 1
else
  for t in "${targets[@]}"; do cargo +nightly fuzz build "$t" 2>&1 | tail -n 1; done
fi
[[ $build_only -eq 0 ]] || exit 0
status=0
for t in "${targets[@]}"; do
  log=$(mktemp /tmp/cqd-fuzz-"$t".XXXXXX)
  # Inputs that once failed (fuzz/regressions/TARGET) run first, each time.
  mkdir -p corpus/"$t"
  dirs=(corpus/"$t")
  [[ -d regressions/$t ]] && dirs+=(regressions/"$t")
  if cargo +nightly fuzz run "$t" "${dirs[@]}" -- -max_total_time="$secs" -timeout=10 \
      -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
    runs=$(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}')
    cov=$(grep -E '^#[0-9]+.*(DONE|cov:)' "$log" | tail -n 1 | grep -oE 'cov: [0-9]+' || true)
    echo "fuzz $t: ${runs:-?} executions in ${secs} s, no crash, no hang (${cov:-cov: ?})"
    rm -f "$log"
  else
    echo "FAIL fuzz $t: see $log and fuzz/artifacts/$t/"
    grep -E 'panicked|ERROR|SUMMARY' "$log" | head -n 5 || true
    status=1
  fi
done
exit $status
