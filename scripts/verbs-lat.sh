#!/usr/bin/env bash
# SEND/RECV ping-pong latency on the softverbs device, in one run:
# perftest's ib_send_lat (polling) and ib_send_lat -e (completion events)
# against cqd's examples/send_lat in busy and in event mode.
#
#   scripts/verbs-lat.sh [RUNS] [ITERS]      # defaults: 5 runs, 10000 iterations
#   PIN=0 scripts/verbs-lat.sh               # nothing pinned: the scheduler decides
#
# Every contender is a server/client pair of processes over 127.0.0.1, the
# server pinned to CPU 0 and the client to CPU 1 (taskset for both; cqd's
# poller thread also pins itself, with core_affinity, to the first CPU its
# process may use). The contenders take turns within each run, so a change
# in the machine's load reaches all of them. Each figure is the client's
# t_typical (median one-way latency = half the round trip, 2-byte
# messages). cqd runs its poller thread (PollerBuilder, send_lat's default
# --loop thread); the row "cqd event, step" is send_lat's own loop on
# CqPoller's step API (--loop step), "cqd event, tokio" the CQ driven by
# cqd's tokio driver on a current-thread runtime (--loop tokio). The table gives the median over the runs with min–max,
# the ratios of the medians, and the same ratios taken run by run.
#
# Needs root (softverbs-run makes a private mount namespace) and perftest.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=${1:-5}
iters=${2:-10000}
pin=${PIN:-1}
if [[ $pin == 0 ]]; then
  on0=() on1=() nopin=(--no-pin) placement="nothing pinned"
else
  on0=(taskset -c 0) on1=(taskset -c 1) nopin=() placement="server on CPU 0, client on CPU 1"
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "SKIPPED: needs softverbs-run, which needs root"
  exit 0
fi
if ! command -v ib_send_lat >/dev/null 2>&1; then
  echo "scripts/verbs-lat.sh: installing perftest (ib_send_lat)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq perftest >/dev/null
fi

target=${CARGO_TARGET_DIR:-target}
cargo build -q -p softverbs --release
cp "$target/release/libsoftverbs.so" "$target/release/libsoftverbs-rdmav34.so"
cargo build -q --release --features verbs --example send_lat
run="$target/release/softverbs-run"
send_lat="$target/release/examples/send_lat"

# A fabric directory of our own, removed at the end.
export SOFTVERBS_DIR=/dev/shm/softverbs-lat-$$
trap 'rm -rf "$SOFTVERBS_DIR"' EXIT

port=$((20000 + $$ % 10000))
out=$(mktemp)
trap 'rm -rf "$SOFTVERBS_DIR" "$out" "$out.srv"' EXIT

# pair NAME CMD...: runs CMD as server (on CPU 0) and CMD 127.0.0.1 as
# client (on CPU 1); prints the client's t_typical in µs.
pair() {
  local name=$1
  shift
  port=$((port + 1))
  "${on0[@]}" timeout 120 "$run" "$@" -p "$port" >"$out.srv" 2>&1 &
  local srv=$!
  sleep 0.5
  if ! "${on1[@]}" timeout 120 "$run" "$@" -p "$port" 127.0.0.1 >"$out" 2>&1; then
    wait "$srv" || true
    echo "scripts/verbs-lat.sh: $name failed:" >&2
    cat "$out" "$out.srv" >&2
    exit 1
  fi
  wait "$srv"
  case $name in
    perftest*) awk '/t_typical/ { getline; print $5; exit }' "$out" ;;
    *) sed -n 's/^t_typical_us=//p' "$out" ;;
  esac
}

names=("ib_send_lat" "cqd busy" "ib_send_lat -e" "cqd event" "cqd event, step" "cqd event, tokio")
declare -A got
for ((r = 1; r <= runs; r++)); do
  got["ib_send_lat"]+=" $(pair perftest ib_send_lat -n "$iters")"
  got["cqd busy"]+=" $(pair cqd "$send_lat" --mode busy "${nopin[@]}" -n "$iters")"
  got["ib_send_lat -e"]+=" $(pair perftest-e ib_send_lat -e -n "$iters")"
  got["cqd event"]+=" $(pair cqd "$send_lat" --mode event "${nopin[@]}" -n "$iters")"
  got["cqd event, step"]+=" $(pair cqd "$send_lat" --mode event --loop step "${nopin[@]}" -n "$iters")"
  got["cqd event, tokio"]+=" $(pair cqd "$send_lat" --mode event --loop tokio "${nopin[@]}" -n "$iters")"
  echo "run $r/$runs:$(for n in "${names[@]}"; do printf ' %s=%s' "${n// /_}" "${got[$n]##* }"; done)" >&2
done

# stats V...: "median min max"
stats() {
  printf '%s\n' "$@" | sort -g | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)], a[1], a[NR] }'
}

echo
echo "SEND/RECV ping-pong on softverbs, 2-byte messages, $iters iterations, $runs runs, $placement ($(date -u +%F))"
echo "t_typical (median one-way latency = RTT/2) in µs of the client: median (min–max) over the runs"
printf '%-18s %-26s %s\n' "contender" "t_typical µs" "ratio (medians)"
declare -A med
for n in "${names[@]}"; do
  # shellcheck disable=SC2086
  read -r m lo hi <<<"$(stats ${got[$n]})"
  med[$n]=$m
  ratio=""
  case $n in
    "cqd busy") ratio=$(awk -v a="$m" -v b="${med[ib_send_lat]}" 'BEGIN { printf "%.2fx ib_send_lat", a / b }') ;;
    "cqd event"*) ratio=$(awk -v a="$m" -v b="${med[ib_send_lat -e]}" 'BEGIN { printf "%.2fx ib_send_lat -e", a / b }') ;;
  esac
  printf '%-18s %-26s %s\n' "$n" "$m ($lo–$hi)" "$ratio"
done
# The same ratios run by run (each run's contenders ran back to back).
paired() {
  local -a a b r
  read -r -a a <<<"${got[$1]}"
  read -r -a b <<<"${got[$2]}"
  for i in "${!a[@]}"; do r+=("$(awk -v x="${a[$i]}" -v y="${b[$i]}" 'BEGIN { printf "%.3f", x / y }')"); done
  read -r m lo hi <<<"$(stats "${r[@]}")"
  printf '%.2f (%.2f–%.2f)' "$m" "$lo" "$hi"
}
echo "run by run: cqd busy / ib_send_lat $(paired "cqd busy" ib_send_lat); cqd event / ib_send_lat -e $(paired "cqd event" "ib_send_lat -e"); step loop $(paired "cqd event, step" "ib_send_lat -e"); tokio driver / cqd event $(paired "cqd event, tokio" "cqd event")"
verdict() { awk -v a="$1" -v b="$2" 'BEGIN { r = a / b; printf "%.2f (goal <= 1.15): %s", r, (r <= 1.15 ? "met" : "not met") }'; }
echo "cqd busy / ib_send_lat     = $(verdict "${med[cqd busy]}" "${med[ib_send_lat]}")"
echo "cqd event / ib_send_lat -e = $(verdict "${med[cqd event]}" "${med[ib_send_lat -e]}")"
echo "tokio driver / cqd event   = $(awk -v a="${med[cqd event, tokio]}" -v b="${med[cqd event]}" 'BEGIN { r = a / b; printf "%.2f (goal <= 1.2): %s", r, (r <= 1.2 ? "met" : "not met") }')"
