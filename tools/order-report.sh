#!/usr/bin/env bash
# Reads the log tools/link-ordered.sh writes beside the start-up list (one line per binary
# linked: the binary; how many of the list's functions it has by their full name, how many were
# found only by their name without hash, how many were ambiguous that way; then the first two
# counts for the functions of the binary's own crate) and says, on stderr, which binaries the
# list does not match: more than one in twenty of their own crate's listed functions (and at
# least 3) found only without hash. That happens when the crate's hash changed since the list was
# recorded: a dependency or feature change, or a build of other packages (features are unified
# over the packages built, and the hashes follow them); the list's generic functions are then
# lost as well. (Functions of other crates found by name are no sign: the list holds every
# daemon's functions, and another daemon's instance of a generic function is found by name in
# any binary that has one of that name.)
#
#   tools/order-report.sh target/startup-order-<sum>.txt.log
#
# Exits 0 whatever it finds (a stale list slows start-up, it does not break the build); 2 when
# the log cannot be read.
set -euo pipefail
log=${1:?usage: order-report.sh LOG}
[ -r "$log" ] || { echo "order-report.sh: cannot read $log" >&2; exit 2; }
while IFS=$'\t' read -r bin exact byname ambiguous own_exact own_byname; do
    own_exact=${own_exact:-0} own_byname=${own_byname:-0}
    if [ "$own_byname" -ge 3 ] && [ $((own_byname * 20)) -gt $((own_exact + own_byname)) ]; then
        echo "build-release.sh: tools/startup-order.txt does not match ${bin%%-*} as built: $own_byname of its own crate's listed functions found only by their name without hash, $own_exact by their full name (all crates: $exact by full name, $byname by name, $ambiguous generic ones not found). The list is recorded from a build of --workspace --bins (tools/startup-order.sh); after a dependency or feature change, make it anew" >&2
    fi
done <"$log"
