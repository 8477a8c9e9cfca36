#!/usr/bin/env bash
# nextest's run wrapper for the tests that need the softverbs device
# (profile `softverbs` in .config/nextest.toml, which scripts/test.sh uses
# when it can run the launcher): one test under softverbs-run, on a fabric
# of its own, so that tests running side by side share no segment, queue
# pair number, multicast group or rdma_cm port.
#
# scripts/test.sh sets SOFTVERBS_TEST_RUN (the launcher) and
# SOFTVERBS_TEST_FABRICS (a directory it removes at the end, with every
# fabric in it).
set -euo pipefail
: "${SOFTVERBS_TEST_RUN:?the softverbs-run launcher (scripts/test.sh sets it)}"
: "${SOFTVERBS_TEST_FABRICS:?a directory for the fabrics (scripts/test.sh sets it)}"
SOFTVERBS_DIR=$(mktemp -d "$SOFTVERBS_TEST_FABRICS/fabric.XXXXXX")
export SOFTVERBS_DIR
exec "$SOFTVERBS_TEST_RUN" "$@"
