#!/usr/bin/env bash
# cqd on the kernel's Soft-RoCE (issue 24): builds on the host, then in one
# VM of scripts/rxe-vm.sh (rxe0 over the guest's loopback, TCG) runs
#   1. the shared suite's rxe third (crates/cqd-verbs/tests/two_backends.rs),
#   2. cqd's rc_pingpong against the unmodified ibv_rc_pingpong, each side
#      in turn, polling and -e, with -c,
#   3. examples/send_lat, and
#   4. the demo in one process, and as serve + load on the VM's loopback,
#   4b'. the hostile client against a serve process (crates/cqd-demo/tests/hostile.rs),
#   4b''. the demo's rdma_cm tests (crates/cqd-demo/tests/rdmacm.rs) on rxe1,
#        an rxe device on a dummy interface (rdma_cm cannot route on lo),
#   4c. the verbs probes (examples/verbs_probe of softverbs),
# then, on the host,
#   6. the same probes on softverbs, compared value by value with rxe's
#      (scripts/verbs-diff.py against the documented differences),
# and fails if any of them fails. Root, no stdin. Where the VM cannot run,
# scripts/rxe-vm.sh says SKIPPED and this exits 0. Every client runs under
# `timeout`, the VM under its own (RXE_VM_TIMEOUT: 1440 s, the build's
# wait included). The demo in two
# VMs, serve in one and load in the other, is scripts/rxe-faults.sh's (its
# `restored` scenario runs it without a fault, with the demo's defaults).
set -euo pipefail
cd "$(dirname "$0")/.."

# The guest half: run by scripts/rxe-vm.sh inside the VM, with SUITE, PP,
# LAT, DEMO (the binaries built on the host) and RXE_VM_LOGDIR set.
if [[ ${1:-} == --guest ]]; then
    LOGS=$RXE_VM_LOGDIR
    # The host builds while the VM boots: wait for its word (the paths of
    # the test binaries it built, or why it could not build them).
    t_wait=$(date +%s)
    while [[ ! -e $LOGS/built ]] && (($(date +%s) - t_wait < 600)); do
        sleep 0.5
    done
    [[ -e $LOGS/built ]] || { echo "FAIL rxe: the host built nothing in 10 minutes"; exit 1; }
    echo "rxe guest: the host's build came $(($(date +%s) - t_wait)) s after the boot"
    # shellcheck disable=SC1091 # written by the host half below
    source "$LOGS/built"
    [[ -n ${SUITE:-} ]] || { echo "FAIL rxe: the host's build failed"; exit 1; }
    fail=0 passed=0
    dev=${CQD_RXE:-rxe0} gid=${RXE_GID_INDEX:-1}
    t0=$(date +%s)

    # 1. The suite: only its rxe third, one test at a time (two vCPUs under
    #    TCG; the suite's limits are scaled by RXE_VM, support::slow()).
    s=$LOGS/suite.log rc=0
    CQD_SUITE_TIMES=1 timeout 600 "$SUITE" ::rxe:: --test-threads=1 >"$s" 2>&1 || rc=$?
    result=$(grep -E '^test result:' "$s" | tail -1 || true)
    # The harness prints "test NAME ... " before the test's own TIME,
    # SKIPPED or NOTE line: they start mid-line.
    ran=$(grep -o 'TIME [^ ]*::rxe::' "$s" | wc -l)
    skipped=$(grep -o 'SKIPPED: [^ ]*::rxe::' "$s" | wc -l)
    echo "rxe suite (rc=$rc, $(( $(date +%s) - t0 )) s): ${result:-no result line}"
    echo "rxe suite: $ran ran on $dev, $skipped SKIPPED on rxe:"
    grep -o 'SKIPPED: .*' "$s" | sed 's/::rxe::[a-z]* / /' | sort | uniq -c | sed 's/^/    /' || true
    grep -o 'NOTE: .*' "$s" | sed 's/^/    /' || true
    if [[ $rc -ne 0 || -z $result ]]; then
        echo "FAIL rxe suite"; grep -E '^(test .* FAILED|---- |thread .* panicked)' -A3 "$s" | head -80
        fail=$((fail + 1))
    else
        passed=$((passed + 1))
    fi

    wait_listen() { # port
        local i
        for i in $(seq 1 200); do
            if ss -ltnH "sport = :$1" | grep -q .; then return 0; fi
            sleep 0.05
        done
        return 1
    }
    # duo NAME PORT CHECK SIDES SERVER CLIENT ARGS...: the server `SERVER
    # ARGS -p PORT`, the client `CLIENT ARGS -p PORT 127.0.0.1`; both exit
    # 0 and the client's log (SIDES=client) or both (both) match CHECK.
    duo() {
        local name=$1 port=$2 check=$3 sides=$4 server=$5 client=$6; shift 6
        local s=$LOGS/$name.server.log c=$LOGS/$name.client.log
        timeout 60 "$server" "$@" -p "$port" >"$s" 2>&1 &
        local spid=$! crc=0 src=0 logs=("$c") ok=1 l line=""
        if ! wait_listen "$port"; then
            echo "FAIL $name: the server did not listen on $port"; cat "$s"
            kill "$spid" 2>/dev/null || true; wait "$spid" || true
            fail=$((fail + 1)); return
        fi
        timeout 60 "$client" "$@" -p "$port" 127.0.0.1 >"$c" 2>&1 || crc=$?
        wait "$spid" || src=$?
        [[ $sides == both ]] && logs=("$s" "$c")
        [[ $crc -eq 0 && $src -eq 0 ]] || ok=0
        for l in "${logs[@]}"; do grep -Eq "$check" "$l" || ok=0; done
        grep -q 'invalid data' "$s" "$c" && ok=0
        if [[ $ok -eq 0 ]]; then
            echo "FAIL $name (client rc=$crc, server rc=$src)"
            echo "--- server"; cat "$s"; echo "--- client"; cat "$c"
            fail=$((fail + 1))
        else
            passed=$((passed + 1))
            for l in "${logs[@]}"; do line+=" $(basename "$l" .log | sed "s/^$name.//"): $(grep -E "$check" "$l" | tail -1 | tr -s ' \t' ' ')"; done
            echo "ok   $name:$line"
        fi
    }
    pp=(-d "$dev" -g "$gid" -c -n 200)
    # 2. rdma-core's own pair first (the device works), then cqd's
    #    rc_pingpong on either side of the unmodified tool.
    duo rc_pingpong 18515 'iters in' both ibv_rc_pingpong ibv_rc_pingpong "${pp[@]}"
    duo cqd_server_rc_pingpong 18516 'iters in' both "$PP" ibv_rc_pingpong "${pp[@]}"
    duo cqd_client_rc_pingpong 18517 'iters in' both ibv_rc_pingpong "$PP" "${pp[@]}"
    duo cqd_server_rc_pingpong_events 18518 'iters in' both "$PP" ibv_rc_pingpong -e "${pp[@]}"
    duo cqd_client_rc_pingpong_events 18519 'iters in' both ibv_rc_pingpong "$PP" -e "${pp[@]}"

    # 3. send_lat beside ib_send_lat. The example opens the first device
    #    (rxe0 is the only one here) and connects without a GID, which RoCE
    #    refuses (ibv_modify_qp to RTR: EINVAL): it runs once its usage
    #    line offers -g.
    duo ib_send_lat 18520 '^ *2 ' client ib_send_lat ib_send_lat -d "$dev" -x "$gid" -n 500
    if { "$LAT" --usage 2>&1 || true; } | grep -q -- '\[-g '; then
        duo send_lat 18521 't_typical_us=' client "$LAT" "$LAT" --mode busy --no-pin -g "$gid" -n 500
        duo send_lat_event 18522 't_typical_us=' client "$LAT" "$LAT" --mode event --no-pin -g "$gid" -n 500
    else
        echo "SKIPPED: send_lat on rxe: examples/send_lat.rs has no GID option and RoCE needs a GRH (without one, ibv_modify_qp to RTR fails with EINVAL)"
    fi

    # demo_one NAME LINE [ARGS...]: the demo in one process on the device
    # (its --quick run: 2 s of load), both verdicts passed and a line
    # matching LINE in its report.
    demo_one() {
        local name=$1 want=$2 l=$LOGS/$1.log rc=0
        shift 2
        timeout 180 "$DEMO" --backend verbs --device "$dev" --gid-index "$gid" --quick "$@" >"$l" 2>&1 || rc=$?
        if [[ $rc -eq 0 ]] && grep -q 'verdict data:     PASSED' "$l" && grep -q 'verdict accounts: PASSED' "$l" \
            && grep -Eq "$want" "$l"; then
            passed=$((passed + 1))
            echo "ok   $name:"; grep -E '^(load +[0-9]|exposure|latency|churn|verdict)' "$l" | sed 's/^/       /'
        else
            echo "FAIL $name (rc=$rc)"; tail -40 "$l"; fail=$((fail + 1))
        fi
    }
    # 4. The demo in one process on rxe0. rxe has type-2 windows: the load
    #    exposes each buffer through one.
    demo_one demo_one_process '^exposure  each request.s buffer through a memory window'
    # 4a. The same with connections that come and go (10 a second): the
    #     server's QPs on its SRQ, closed while the others run.
    demo_one demo_churn '^churn +[1-9][0-9]* connections closed and reopened, .* 0 failed' --churn 10

    # 4b. The demo as two processes, serve and load, over the TCP exchange
    #     on this VM's loopback.
    sl=$LOGS/demo_serve.log ll=$LOGS/demo_load.log src=0 lrc=0
    timeout 180 "$DEMO" serve --device "$dev" --gid-index "$gid" --quick \
        --listen 127.0.0.1:18525 --accept-timeout 120s >"$sl" 2>&1 &
    spid=$!
    if wait_listen 18525; then
        timeout 120 "$DEMO" load --device "$dev" --gid-index "$gid" --quick --server 127.0.0.1:18525 >"$ll" 2>&1 || lrc=$?
    else
        lrc=99
    fi
    wait "$spid" || src=$?
    if [[ $src -eq 0 && $lrc -eq 0 ]] && grep -q 'verdict data:     PASSED' "$ll" \
        && grep -q 'verdict accounts: PASSED' "$ll" && grep -q 'verdict accounts: PASSED' "$sl" \
        && grep -q 'verdict session:  PASSED' "$sl"; then
        passed=$((passed + 1))
        echo "ok   demo_serve_load:"
        grep -E '^(load +[0-9]|verdict)' "$ll" | sed 's/^/       load: /'
        grep -E '^verdict' "$sl" | sed 's/^/       serve: /'
    else
        echo "FAIL demo_serve_load (serve rc=$src, load rc=$lrc)"
        echo "--- serve"; tail -30 "$sl"; echo "--- load"; tail -30 "$ll"
        fail=$((fail + 1))
    fi

    # 4b'. The hostile client (crates/cqd-demo/tests/hostile.rs) against a
    #      serve process on rxe0: a wrong secret, RDMA to the server with
    #      guessed keys, a replayed request, a completed request's window,
    #      another connection's window; each ends in the device's error,
    #      the server names the connection and stays up. Then a peer's
    #      forged refusal, printed escaped by the load and by the server.
    l=$LOGS/hostile.log rc=0
    timeout 300 "$HOSTILE" --nocapture --test-threads 1 >"$l" 2>&1 || rc=$?
    if [[ $rc -eq 0 ]] && grep -q '^test result: ok. 4 passed' "$l"; then
        passed=$((passed + 1))
        echo "ok   hostile_client:"; grep -E 'broke|verdict' "$l" | sed 's/^/       /'
    else
        echo "FAIL hostile_client (rc=$rc)"; tail -60 "$l"; fail=$((fail + 1))
    fi

    # 4b''. The demo's rdma_cm tests (crates/cqd-demo/tests/rdmacm.rs): two
    #       servers and a load with data verified, a --cm mismatch, a
    #       server killed mid-run, a stranger's rdma_cm requests rejected.
    #       rdma_resolve_route fails with ENODEV on rxe0, which is on lo
    #       (rping too), so they run on rxe1 over a dummy interface of their
    #       own, removed after: rxe delivers a packet for its own address
    #       through its loopback path (rxe_net.c, RXE_LOOPBACK_MASK), never
    #       through the dummy device, which drops what it is given.
    l=$LOGS/rdmacm.log rc=0 t_cm=$(date +%s)
    cm_dev=rxe1 cm_ip=10.77.9.1
    if modprobe dummy && ip link add cqdcm0 type dummy && ip addr add "$cm_ip/24" dev cqdcm0 \
        && ip link set cqdcm0 up && rdma link add "$cm_dev" type rxe netdev cqdcm0; then
        i=0
        until grep -q ACTIVE "/sys/class/infiniband/$cm_dev/ports/1/state" 2>/dev/null; do
            i=$((i + 1)); [[ $i -lt 100 ]] || break
            sleep 0.1
        done
        # Two at a time: each waits mostly on its processes (measured in
        # the VM: 48 s one at a time, 36 s four at a time).
        CQD_RXE_CM=$cm_dev CQD_RXE_CM_ADDR=$cm_ip timeout 300 "$RDMACM" --test-threads 2 >"$l" 2>&1 || rc=$?
    else
        echo "rxe: $cm_dev on a dummy interface could not be made" >"$l"; rc=98
    fi
    rdma link delete "$cm_dev" 2>/dev/null || true
    ip link delete cqdcm0 2>/dev/null || true
    if [[ $rc -eq 0 ]] && grep -q '^test result: ok. 4 passed' "$l" && ! grep -q 'SKIPPED' "$l"; then
        passed=$((passed + 1))
        echo "ok   rdmacm ($cm_dev on a dummy interface, $(( $(date +%s) - t_cm )) s):"
        grep -E '^test .* ok$' "$l" | sed 's/^/       /'
    else
        echo "FAIL rdmacm (rc=$rc)"; tail -60 "$l"; fail=$((fail + 1))
    fi

    # 4c. The verbs probes (crates/softverbs/examples/verbs_probe.rs): what
    #     rxe reports, compared on the host with what softverbs reports.
    l=$LOGS/verbs_probe.rxe.txt rc=0
    timeout 240 "$PROBE" --device "$dev" --gid-index "$gid" >"$l" 2>"$LOGS/verbs_probe.rxe.err" || rc=$?
    if [[ $rc -eq 0 ]]; then
        passed=$((passed + 1))
        echo "ok   verbs_probe: $(grep -c ' = ' "$l") values from $dev (compared on the host)"
    else
        echo "FAIL verbs_probe (rc=$rc)"; cat "$LOGS/verbs_probe.rxe.err"; fail=$((fail + 1))
    fi

    echo "rxe guest: $passed passed, $fail failed in $(( $(date +%s) - t0 )) s"
    [[ $fail -eq 0 ]]
    exit
fi

start=$(date +%s)
if [[ $(id -u) -ne 0 ]]; then
    echo "SKIPPED: rxe: not root (the VM of scripts/rxe-vm.sh boots over the live root as root)"
    exit 0
fi
# The host half: everything the guest runs is built here (the guest has
# two slow vCPUs), while the VM boots (about 40 s under TCG, mostly one
# core); the guest waits for the build's word in the log directory.
REL=${CARGO_TARGET_DIR:-$PWD/target}/release
export PP=$REL/examples/rc_pingpong LAT=$REL/examples/send_lat DEMO=$REL/cqd-demo
export PROBE=$REL/examples/verbs_probe
export RXE_VM_LOGDIR
RXE_VM_LOGDIR=$(mktemp -d /tmp/cqd-rxe.XXXXXX)
echo "rxe: logs in $RXE_VM_LOGDIR"
# The VM's timeout covers the guest's checks (840 s) and its wait for the
# build (at most 600 s).
RXE_VM_TIMEOUT=${RXE_VM_TIMEOUT:-1440} RXE_VM_ENV="PP LAT DEMO PROBE" \
    bash scripts/rxe-vm.sh bash .ci/rxe.sh --guest >"$RXE_VM_LOGDIR/vm.log" 2>&1 &
vm=$!
build() { # (called under ||, where set -e does not stop it: each step says)
    nice -n 15 cargo build --release --features verbs --example rc_pingpong --example send_lat || return
    nice -n 15 cargo build --release -p cqd-demo --features verbs || return
    # The verbs probes, and the softverbs provider and launcher they run
    # under on the host (6. below).
    nice -n 15 cargo build --release -p softverbs --bins --lib --example verbs_probe || return
    # The suite is built with cqd-demo selected too (none of its targets
    # built), so that cargo resolves features as for the demo above and
    # reuses its cqd-core, cqd-sim and cqd-verbs; alone, cqd-verbs' tests
    # resolve `log` and `tracing-core` with fewer features and rebuild all
    # three while the VM waits (docs/ci.md).
    SUITE=$(nice -n 15 cargo test --release -p cqd-verbs -p cqd-demo --features cqd-demo/verbs \
        --test two_backends --no-run --message-format=json |
        sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
    [[ -x $SUITE ]] || { echo "rxe: no two_backends test binary"; return 1; }
    # The hostile client's and the rdma_cm tests; they run the serve
    # process their build made (CARGO_BIN_EXE_cqd-demo: the release binary
    # built above).
    local demo_tests
    demo_tests=$(nice -n 15 cargo test -p cqd-demo --release --features verbs --test hostile --test rdmacm \
        --no-run --message-format=json)
    HOSTILE=$(grep '"kind":\["test"\],[^}]*"name":"hostile"' <<<"$demo_tests" |
        sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
    [[ -x $HOSTILE ]] || { echo "rxe: no hostile test binary"; return 1; }
    RDMACM=$(grep '"kind":\["test"\],[^}]*"name":"rdmacm"' <<<"$demo_tests" |
        sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
    [[ -x $RDMACM ]] || { echo "rxe: no rdmacm test binary"; return 1; }
    printf 'SUITE=%q HOSTILE=%q RDMACM=%q\n' "$SUITE" "$HOSTILE" "$RDMACM" >"$RXE_VM_LOGDIR/built.tmp"
    mv "$RXE_VM_LOGDIR/built.tmp" "$RXE_VM_LOGDIR/built"
}
build_rc=0
build || build_rc=$?
[[ $build_rc -eq 0 ]] || : >"$RXE_VM_LOGDIR/built" # the guest stops at once
echo "rxe: built in $(( $(date +%s) - start )) s (status $build_rc)"
set +e
wait "$vm"
rc=$?
set -e
cat "$RXE_VM_LOGDIR/vm.log"
[[ $build_rc -eq 0 ]] || exit 1
if grep -q '^SKIPPED: rxe-vm' "$RXE_VM_LOGDIR/vm.log"; then exit 0; fi

# 6. Differential conformance: the same probes on softverbs (here, under
#    the launcher), every value compared with rxe's; a difference must be
#    one crates/softverbs/tests/rxe_differences.txt documents, with the
#    values seen (scripts/verbs-diff.py).
diff_rc=0
if [[ -s $RXE_VM_LOGDIR/verbs_probe.rxe.txt ]]; then
    sv=$RXE_VM_LOGDIR/verbs_probe.softverbs.txt
    if timeout 240 "$REL/softverbs-run" "$PROBE" >"$sv" 2>"$sv.err"; then
        python3 scripts/verbs-diff.py "$sv" "$RXE_VM_LOGDIR/verbs_probe.rxe.txt" || diff_rc=$?
    else
        echo "FAIL verbs_probe on softverbs"; cat "$sv.err"; diff_rc=1
    fi
else
    echo "FAIL verbs-diff: rxe's probe output is missing"; diff_rc=1
fi

echo "rxe: done in $(( $(date +%s) - start )) s, status $rc (the VM), verbs-diff $diff_rc"
[[ $rc -eq 0 && $diff_rc -eq 0 ]]
