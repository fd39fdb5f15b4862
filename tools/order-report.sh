#!/usr/bin/env bash
# Reads the log tools/link-ordered.sh writes beside the start-up list (one line per binary
# linked: the binary, how many of the list's functions it has by their full name, how many were
# found only by their name without hash, how many were ambiguous that way) and says, on stderr,
# which binaries the list does not match: more than one in twenty of their functions found only
# without hash (and at least 20), a sign that the list was recorded before a dependency or
# feature change, or from a build of other packages (features are unified over the packages
# built, and the hashes follow them), so that its generic functions are lost.
#
#   tools/order-report.sh target/startup-order-<sum>.txt.log
#
# Always exits 0 (a stale list slows start-up, it does not break the build), but 2 when the log
# cannot be read.
set -euo pipefail
log=${1:?usage: order-report.sh LOG}
[ -r "$log" ] || { echo "order-report.sh: cannot read $log" >&2; exit 2; }
while IFS=$'\t' read -r bin exact byname ambiguous; do
    if [ "$byname" -ge 20 ] && [ $((byname * 20)) -gt "$exact" ]; then
        echo "build-release.sh: tools/startup-order.txt does not match ${bin%-*} as built: $byname of its functions found only by their name without hash, $exact by their full name, $ambiguous generic ones not found. The list is recorded from a build of --workspace --bins (tools/startup-order.sh); after a dependency or feature change, make it anew" >&2
    fi
done <"$log"
