#!/usr/bin/env bash
# Regenerates tools/startup-order.txt: the functions the daemons run in gpu-vm-bench's plain-tree
# figures (start-up, `status`, `list`, `assert`, `plan`, registration, the first ListAndWatch,
# health reactions), then in its vgpu-device-manager section (`apply`, `assert`, the daemon's
# label switches through the API server), then in its sandbox-dra section (registration,
# prepare and unprepare, vGPU claims, slice publication), one symbol per line; a function first
# seen in a later profile comes after every one seen before. tools/build-release.sh links through
# tools/link-ordered.sh, which finds those functions in each binary and hands them to lld
# (--symbol-ordering-file): they are placed side by side at the start of .text, and a command
# faults in a few windows of code instead of dozens over 8 MiB.
#
# Run it again after a toolchain or dependency update, and after a change to the code a start
# or a read of the node runs: a name that no longer exists is skipped (it costs nothing), but a
# function added or renamed there is not in the list and stays among the cold code, where each
# such function a command runs maps another window of pages (4df6715's per-GPU type reads added
# 0.5 MiB to a registered sandbox-dp that way). tools/order-report.sh cannot see that: it
# counts how the listed functions were found, not the ones that ran and were never listed. A
# feature or dependency change elsewhere in the workspace changes every symbol's hash;
# tools/link-ordered.sh still finds each function whose name without hash is its own, but not
# the generic functions and closures, so regenerate it then too.
#
# Usage: tools/startup-order.sh
# Needs: valgrind (callgrind), root and /dev/fuse (node-sim, as the bench does). It builds the
# release binaries with their symbols into ${CARGO_TARGET_DIR:-target}/startup-order, runs
# `gpu-vm-bench --only plain --only vgpu --runs 1 --plain-runs 1`, then `gpu-vm-bench --only
# dra --runs 1 --claims 2`, with every daemon under callgrind (figures discarded), and keeps the
# names of the functions that ran, the first run's profiles before the second's, each in the
# order callgrind lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=tools/startup-order.txt

command -v valgrind >/dev/null || {
    echo "tools/startup-order.sh: valgrind is needed (apt-get install valgrind)" >&2
    exit 2
}

target=${CARGO_TARGET_DIR:-target}/startup-order
# The release profile as shipped (a profile setting changes every symbol's hash), its symbols
# kept by a later -C strip: RUSTFLAGS do not enter the hashes.
CARGO_TARGET_DIR=$target RUSTFLAGS="${RUSTFLAGS:-} -C strip=none" \
    tools/build-release.sh --workspace --bins
built=$(cd "$target/shipped" && pwd -P)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/bin" "$work/path" "$work/profiles" "$work/profiles/1" "$work/profiles/2"
# The bench finds the daemons and its own programs (the no-op, the bare plugin) beside itself
# (its own path, links resolved): a copy of it and of its programs, with each daemon behind a
# callgrind wrapper beside them.
for b in gpu-vm-bench gpu-vm-noop gpu-vm-bare-plugin; do
    if [ -e "$built/$b" ]; then cp "$built/$b" "$work/bin/$b"; fi
done
for b in vfio-manager vgpu-device-manager sandbox-dp sandbox-dra; do
    cat >"$work/bin/$b" <<EOF
#!/bin/sh
exec valgrind -q --tool=callgrind --callgrind-out-file=$work/profiles/\$(cat $work/phase)/$b.%p \\
    --dump-instr=no --compress-strings=no --compress-pos=no --demangle=no \\
    "$built/$b" "\$@"
EOF
    chmod +x "$work/bin/$b"
done
# No limits: strace around valgrind would record valgrind, and the figures are not kept.
printf '#!/bin/sh\nexit 1\n' >"$work/path/strace"
chmod +x "$work/path/strace"

# Each bench run's profiles in a directory of its own (the wrapper reads which from $work/phase),
# so that the list keeps the runs' order.
bench() {
    local phase=$1
    shift
    echo "$phase" >"$work/phase"
    echo "running gpu-vm-bench $* under callgrind (several minutes)" >&2
    PATH="$work/path:$PATH" "$work/bin/gpu-vm-bench" "$@" >"$work/bench-$phase.md" || {
        echo "tools/startup-order.sh: gpu-vm-bench $* failed; its report:" >&2
        cat "$work/bench-$phase.md" >&2
        exit 1
    }
}
bench 1 --only plain --only vgpu --runs 1 --plain-runs 1
bench 2 --only dra --runs 1 --claims 2

profiles=("$work"/profiles/1/* "$work"/profiles/2/*)
for p in "${profiles[@]}"; do
    [ -e "$p" ] || {
        echo "tools/startup-order.sh: callgrind wrote no profile in one of the runs" >&2
        exit 1
    }
done
# `fn=<symbol>` lines name each function that ran; bare addresses (code without a symbol) are
# of no use to the linker. First occurrence wins, across every profile.
sed -n 's/^fn=//p' "${profiles[@]}" | grep -v '^0x' | awk '!seen[$0]++' >"$work/order"
cp "$work/order" "$repo/$out"
echo "wrote $out: $(wc -l <"$out") functions from ${#profiles[@]} profiles" >&2
