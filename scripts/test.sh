#!/usr/bin/env bash
# The test command (README): the doctests, then every test of the workspace
# (nextest's summary is the last line).
#
# softverbs builds against the system's libibverbs through rdma-sys, which
# needs rdma-core's headers and libclang. When they are missing and we are
# root with apt-get (as on the project's machines), they are installed;
# otherwise this says what to install and stops.
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

cargo test --workspace --doc
cargo nextest run --workspace --no-fail-fast "$@"
