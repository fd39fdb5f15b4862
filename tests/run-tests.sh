#!/usr/bin/env bash
# The test command: every tier that this machine can run.
#   1. unit tests and node-sim end-to-end tests (cargo test --workspace);
#   2. the VM tier (a real kernel under QEMU), after preparing its cached kernel assets;
#   3. the cluster tier (real Kubernetes components, the image built here and installed by the
#      Helm chart), after preparing its assets (tests/cluster/prepare.sh: the release build).
# Tests that need root, /dev/fuse, QEMU or the Kubernetes binaries print "skipped: ..." when those
# are missing (CLUSTER_TIER=required, VM_TIER=required, NODE_SIM=required: a failure instead).
set -euo pipefail
cd "$(dirname "$0")/.."

tests/setup.sh
if [ -x tests/vm/prepare.sh ] && [ "${SKIP_VM_TIER:-}" != 1 ]; then
    tests/vm/prepare.sh || {
        echo "VM tier: preparing kernel assets failed; its tests will report it" >&2
    }
fi
if [ "${SKIP_CLUSTER_TIER:-}" != 1 ]; then
    tests/cluster/prepare.sh
fi
cargo test --workspace --all-targets "$@"
