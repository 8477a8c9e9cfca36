#!/usr/bin/env bash
# rxe-vm.sh COMMAND...: runs COMMAND inside a virtual machine whose kernel
# has RDMA, on the kernel's Soft-RoCE (rdma_rxe) device rxe0 over the
# guest's loopback, and exits with COMMAND's status (issue 24).
#
# The guest is Debian's own kernel (linux-image-amd64, which ships
# rdma_rxe.ko) booted by virtme-ng over this machine's live root, read-only
# with a copy-on-write overlay: it sees the checkout and its target/, runs
# what was built on the host, and has no network device but its loopback.
#
# Root, no stdin, idempotent: the packages and virtme-ng (in a virtual
# environment under $RXE_VM_STATE) are installed the first time. Where the
# VM cannot run (not root, no QEMU or no kernel with rdma_rxe, nothing to
# install them with) it prints SKIPPED with the reason and exits 0; that is
# the only case of exit 0 without running COMMAND.
#
# Environment:
#   RXE_VM_TIMEOUT  seconds for the whole VM run, boot included (900)
#   RXE_VM_CPUS     guest CPUs (2); RXE_VM_MEM guest memory (2G)
#   RXE_VM_KERNEL   the kernel image (default: the newest /boot/vmlinuz-*
#                   whose modules have rdma_rxe)
#   RXE_VM_STATE    where the venv and the KVM probe's verdict live
#                   (/var/cache/cqd-rxe)
#   RXE_VM_ENV      names of further variables to pass into the guest
#   RXE_VM_LOGDIR   a host directory the guest may write ($RXE_VM_LOGDIR
#                   inside too; default: none)
#   RXE_VM_NET      two VMs: `listen:PORT:N` or `connect:PORT:N` gives
#                   this VM a virtio NIC joined to the other VM's by QEMU's
#                   socket backend over 127.0.0.1:PORT (the listening VM
#                   first); the guest's NIC gets 10.77.0.N/24 and rxe0 goes
#                   on it instead of lo. Nothing else is reachable.
#
# Inside, COMMAND runs in the current directory with CQD_RXE=rxe0 (the
# device name; the shared suite's rxe backend keys on it), RXE_GID_INDEX=1
# (::ffff:127.0.0.1) and RXE_VM=1.
set -euo pipefail

log() { echo "rxe-vm: $*" >&2; }
skip() {
    echo "SKIPPED: rxe-vm: $* (no Soft-RoCE run)"
    echo "SKIPPED: rxe-vm: $* (no Soft-RoCE run)" >&2
    exit 0
}

[[ $# -gt 0 ]] || { echo "usage: $0 COMMAND [ARGS...]" >&2; exit 2; }

STATE=${RXE_VM_STATE:-/var/cache/cqd-rxe}
VENV=$STATE/venv
TIMEOUT=${RXE_VM_TIMEOUT:-900}
CPUS=${RXE_VM_CPUS:-2}
MEM=${RXE_VM_MEM:-2G}

# 1. What the VM needs, installed when we can.
need_pkgs=()
pkg_for() { # command package
    command -v "$1" >/dev/null 2>&1 || need_pkgs+=("$2")
}
pkg_for qemu-system-x86_64 qemu-system-x86
pkg_for busybox busybox-static
pkg_for rdma iproute2
pkg_for ibv_rc_pingpong ibverbs-utils
pkg_for ib_send_lat perftest
pkg_for rping rdmacm-utils
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need_pkgs+=(python3-venv)
kernel_with_rxe() { # newest /boot/vmlinuz-* whose modules include rdma_rxe
    local k v best=
    for k in /boot/vmlinuz-*; do
        [[ -e $k ]] || continue
        v=${k#/boot/vmlinuz-}
        if find "/lib/modules/$v" -name 'rdma_rxe.ko*' 2>/dev/null | grep -q .; then best=$k; fi
    done
    echo "$best"
}
KERNEL=${RXE_VM_KERNEL:-$(kernel_with_rxe)}
[[ -n $KERNEL ]] || need_pkgs+=(linux-image-amd64)

if [[ ${#need_pkgs[@]} -gt 0 ]]; then
    [[ $(id -u) -eq 0 ]] || skip "not root, cannot install ${need_pkgs[*]}"
    command -v apt-get >/dev/null 2>&1 || skip "no apt-get to install ${need_pkgs[*]}"
    log "installing ${need_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    timeout 600 apt-get update -qq </dev/null || skip "apt-get update failed"
    timeout 900 apt-get install -y -qq "${need_pkgs[@]}" </dev/null >/dev/null ||
        skip "apt-get install ${need_pkgs[*]} failed"
    KERNEL=${RXE_VM_KERNEL:-$(kernel_with_rxe)}
fi
[[ $(id -u) -eq 0 ]] || skip "not root (the guest boots over the live root as root)"
command -v qemu-system-x86_64 >/dev/null 2>&1 || skip "no qemu-system-x86_64"
[[ -n $KERNEL && -r $KERNEL ]] || skip "no kernel image with rdma_rxe under /boot"

if [[ ! -x $VENV/bin/vng ]]; then
    log "installing virtme-ng into $VENV"
    mkdir -p "$STATE"
    python3 -m venv "$VENV" </dev/null >/dev/null || skip "python3 -m venv failed"
    timeout 600 "$VENV/bin/pip" install -q virtme-ng </dev/null >/dev/null ||
        skip "pip install virtme-ng failed"
fi
export PATH=$VENV/bin:$PATH # vng runs virtme-run from its own venv

# 2. KVM or TCG. Nested KVM fails on this project's machines (QEMU: failed
#    to set MSR 0x10a; with that feature masked the guest hangs at boot), so
#    a probe boot with KVM decides, once per kernel and QEMU, and its verdict
#    is kept.
qemu_ver=$(qemu-system-x86_64 --version | head -1 | tr -c 'A-Za-z0-9.\n' _)
probe=$STATE/kvm.$(basename "$KERNEL").$qemu_ver
accel=tcg
if [[ -w /dev/kvm ]]; then
    if [[ ! -f $probe ]]; then
        log "probing KVM (30 s at most)"
        mkdir -p "$STATE"
        if timeout 30 vng --run "$KERNEL" --cpus 1 --memory 512M --exec 'echo rxe-vm-kvm-ok' \
            </dev/null 2>&1 | grep -q rxe-vm-kvm-ok; then
            echo kvm >"$probe"
        else
            echo tcg >"$probe"
        fi
    fi
    accel=$(cat "$probe")
fi
accel_opts=()
[[ $accel == kvm ]] || accel_opts=(--disable-kvm)

net_opts=() rxe_netdev=lo guest_ip=
if [[ -n ${RXE_VM_NET:-} ]]; then
    IFS=: read -r net_role net_port net_n <<<"$RXE_VM_NET"
    [[ $net_role == listen || $net_role == connect ]] && [[ $net_port =~ ^[0-9]+$ && $net_n =~ ^[0-9]+$ ]] ||
        { echo "rxe-vm: RXE_VM_NET is listen:PORT:N or connect:PORT:N, not $RXE_VM_NET" >&2; exit 2; }
    mac=$(printf '52:54:00:77:00:%02x' "$net_n")
    # The PCI machine (virtme-ng's default microvm has no PCI bus).
    # (--qemu-opts=...: as a separate word vng's parser takes it for a flag.)
    net_opts=(--disable-microvm
        "--qemu-opts=-netdev socket,id=n0,$net_role=127.0.0.1:$net_port -device virtio-net-pci,netdev=n0,mac=$mac")
    rxe_netdev=auto guest_ip=10.77.0.$net_n/24
fi

# 3. The guest's script: rxe up on lo, then COMMAND, its status returned.
#    The run directory goes in as a --rwdir (virtme-ng's overlay hides
#    /var/cache from the guest, and the kernel's command line is too short
#    for the script).
run=$(mktemp -d "$STATE/run.XXXXXX")
trap 'rm -rf "$run"' EXIT
{
    echo 'set -eu'
    echo 'exec 2>&1 # the console carries stdout only'
    echo "export PATH=$(printf '%q' "$PATH")"
    echo 'export CQD_RXE=rxe0 RXE_GID_INDEX=1 RXE_VM=1'
    for v in HOME CARGO_TARGET_DIR RUST_BACKTRACE CQD_SUITE_TIMES RXE_VM_LOGDIR ${RXE_VM_ENV:-}; do
        if [[ -n ${!v+x} ]]; then echo "export $v=$(printf '%q' "${!v}")"; fi
    done
    printf 'rxe_netdev=%q guest_ip=%q\n' "$rxe_netdev" "$guest_ip"
    cat <<'EOF'
ip link set lo up
if [ "$rxe_netdev" = auto ]; then
    # The one NIC besides lo (virtio: eth0 or enp0sN).
    rxe_netdev=$(ls /sys/class/net | grep -v '^lo$' | head -1)
    [ -n "$rxe_netdev" ] || { echo "rxe-vm: no NIC in the guest" >&2; exit 97; }
    ip addr add "$guest_ip" dev "$rxe_netdev"
    ip link set "$rxe_netdev" up
    export RXE_VM_ADDR=${guest_ip%/*}
fi
modprobe rdma_rxe
rdma link add rxe0 type rxe netdev "$rxe_netdev"
i=0
until grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null; do
    i=$((i + 1)); [ $i -lt 100 ] || { echo "rxe-vm: rxe0 never became ACTIVE" >&2; exit 97; }
    sleep 0.1
done
i=0
until [ "$(cat /sys/class/infiniband/rxe0/ports/1/gids/1)" != 0000:0000:0000:0000:0000:0000:0000:0000 ]; do
    i=$((i + 1)); [ $i -lt 100 ] || { echo "rxe-vm: rxe0 has no GID 1" >&2; exit 97; }
    sleep 0.1
done
echo "rxe-vm: rxe0 up on $rxe_netdev ($(uname -r), GID 1 $(cat /sys/class/infiniband/rxe0/ports/1/gids/1))" >&2
EOF
    printf 'cd %q\n' "$PWD"
    printf 'exec </dev/null\n'
    printf 'exec'
    printf ' %q' "$@"
    echo
} >"$run/guest.sh"

rw=(--rwdir "$run")
[[ -z ${RXE_VM_LOGDIR:-} ]] || { mkdir -p "$RXE_VM_LOGDIR"; rw+=(--rwdir "$RXE_VM_LOGDIR"); }

log "booting $(basename "$KERNEL") ($accel, $CPUS CPUs, $MEM, timeout ${TIMEOUT}s): $*"
t0=$(date +%s)
rc=0
timeout --kill-after=10 "$TIMEOUT" vng --run "$KERNEL" "${accel_opts[@]}" --cpus "$CPUS" --memory "$MEM" \
    "${net_opts[@]}" "${rw[@]}" --exec "sh $run/guest.sh" </dev/null || rc=$?
log "VM done in $(( $(date +%s) - t0 )) s, status $rc"
[[ $rc -ne 124 ]] || log "the VM run hit its ${TIMEOUT} s timeout"
exit "$rc"
