#!/usr/bin/env bash
# The test command (README): the doctests, then every test of the workspace
# with nextest, whose summary counts a test passed only when it ran.
#
# Some tests need a device that is not always here (.config/nextest.toml
# names them):
# - the softverbs tests need the userspace RDMA device, which only the
#   launcher softverbs-run provides, as root. When it can run here (root,
#   libibverbs, a mount namespace), this builds it and nextest runs each of
#   those tests under it (profile `softverbs`, scripts/softverbs-wrap.sh),
#   each on a fabric of its own under a directory removed at the end. When
#   it cannot, nextest leaves them out and counts them skipped, and this
#   says why, before the run and after the summary.
#   CQD_TEST_NO_LAUNCHER=1 does the same on purpose (a run as a user
#   without root would).
# - the rxe tests (two_backends' rxe cells) need the kernel's Soft-RoCE:
#   they are always counted skipped here; .ci/rxe.sh runs them in a VM.
#
# softverbs builds against the system's libibverbs through rdma-sys, which
# needs rdma-core's headers and libclang. When they are missing and we are
# root with apt-get (as on the project's machines), they are installed;
# otherwise this says what to install and stops.
#
# Arguments go to `cargo nextest run` (not --profile: this picks it).
set -euo pipefail
cd "$(dirname "$0")/.."

need=(pkg-config libibverbs-dev librdmacm-dev libclang-dev)
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "scripts/test.sh: installing ${missing[*]} (needed to build rdma-sys)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "scripts/test.sh: missing system packages: ${missing[*]}" >&2
    echo "install them first: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
fi

# The packages named with -p / --package (scripts/check.sh names them),
# else the whole workspace: their doctests, then their tests.
doc=()
for ((i = 1; i <= $#; i++)); do
  case ${!i} in
    -p | --package) j=$((i + 1)); doc+=(-p "${!j}") ;;
    --package=*) doc+=(-p "${!i#--package=}") ;;
  esac
done
sel=()
((${#doc[@]})) || sel=(--workspace)
cargo test "${sel[@]}" "${doc[@]}" --doc

# Can the softverbs tests run here? `why` says why not.
why=
if [[ ${CQD_TEST_NO_LAUNCHER:-} == 1 ]]; then
  why="CQD_TEST_NO_LAUNCHER=1 is set"
elif [[ $(id -u) -ne 0 ]]; then
  why="not root (uid $(id -u)): softverbs-run needs root to make a private mount namespace"
else
  # The launcher and the provider it stages, release builds
  # (target/release/{softverbs-run,libsoftverbs.so}): the device the tests
  # run on is built as a user (and .ci/softverbs.sh) runs it, and as fast
  # (a debug provider takes twice as long to wake a waiting send). The
  # provider's unit tests run in the debug build with the rest. SOFTVERBS_LIB names this build's
  # provider, so that a copy left next to the launcher
  # (libsoftverbs-rdmav34.so) is not taken instead.
  cargo build -p softverbs --release
  target=$(cargo metadata --format-version 1 --no-deps |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
  export SOFTVERBS_TEST_RUN=$target/release/softverbs-run
  export SOFTVERBS_LIB=$target/release/libsoftverbs.so
  # The launcher's own checks (root, libibverbs and its private ABI, the
  # provider, the mount namespace), on a command that does nothing.
  if ! out=$("$SOFTVERBS_TEST_RUN" true 2>&1); then
    why="softverbs-run cannot run here: ${out:-no message}"
  fi
fi

say() { printf 'scripts/test.sh: %s\n' "$@"; }
rule='------------------------------------------------------------------------'
if [[ -z $why ]]; then
  SOFTVERBS_TEST_FABRICS=$(mktemp -d /dev/shm/softverbs-test.XXXXXX)
  export SOFTVERBS_TEST_FABRICS
  trap 'rm -rf "$SOFTVERBS_TEST_FABRICS"' EXIT
  say "the softverbs tests run, each under $SOFTVERBS_TEST_RUN" \
    "the rxe tests are skipped: they need the kernel's Soft-RoCE (.ci/rxe.sh runs them in a VM)"
  cargo nextest run "${sel[@]}" --no-fail-fast --profile softverbs "$@"
else
  say "$rule" \
    "SKIPPING THE SOFTVERBS TESTS: $why." \
    "They need the userspace RDMA device, which only softverbs-run provides," \
    "as root; nextest counts them skipped, not passed (.config/nextest.toml)." \
    "The rxe tests are skipped too: they need the kernel's Soft-RoCE (.ci/rxe.sh)." \
    "$rule"
  rc=0
  cargo nextest run "${sel[@]}" --no-fail-fast "$@" || rc=$?
  say "the skipped tests include the softverbs tests: $why"
  exit "$rc"
fi
