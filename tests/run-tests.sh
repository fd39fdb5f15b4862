#!/usr/bin/env bash
# The test command: every tier that this machine can run.
#   1. unit tests and node-sim end-to-end tests (cargo test --workspace);
#   2. the VM tier (a real kernel under QEMU), after preparing its cached kernel assets.
# Tests that need root, /dev/fuse or QEMU print "skipped: ..." when those are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

tests/setup.sh
if [ -x tests/vm/prepare.sh ] && [ "${SKIP_VM_TIER:-}" != 1 ]; then
    tests/vm/prepare.sh || {
        echo "VM tier: preparing kernel assets failed; its tests will report it" >&2
    }
fi
cargo test --workspace --all-targets "$@"
