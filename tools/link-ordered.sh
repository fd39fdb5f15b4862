#!/usr/bin/env bash
# The linker tools/build-release.sh gives rustc: `cc` with the start-up order resolved against
# the binary being linked.
#
# tools/startup-order.txt names functions as rustc named them in the build it was recorded from
# (`_ZN10sandbox_dp4main17h3ac2d1b439fbacdcE`). The hash in a name changes whenever the crate's
# dependencies or enabled features do (a feature enabled anywhere in the workspace reaches every
# crate that depends on the same crate), and the list then silently stops matching. So the link
# is done twice: once without the order and with the symbols kept, to read the names the binary
# has; then as rustc asked, with a --symbol-ordering-file of the list's names resolved against
# them: a name the binary has as is; otherwise, without its hash (and without a `.N` suffix
# LLVM adds to local copies), the one function of the binary with that name. Generic functions
# and closures share a name without hash with many others, and are then left where they are.
# Each link appends a line to FILE.log beside the list: the binary, how many of the list's
# functions it has by their full name, how many were found only without hash, how many were
# ambiguous that way, and the first two counts again for the functions of the binary's own crate
# (`sandbox_dp::...` in sandbox_dp-<hash>). Only those tell a stale list: the list holds every
# daemon's functions, and another daemon's instance of a generic function is found here by its
# name without hash whenever this binary has one of that name, fresh list or not; but the
# binary's own functions are found by their full name unless their crate's hash changed.
# tools/build-release.sh has tools/order-report.sh say when the list looks stale.

# The list arrives as rustc's `-Wl,--symbol-ordering-file=FILE` argument; without one, or with
# arguments in a response file (`@FILE`), this is plain `cc`. Needs nm (binutils).
set -euo pipefail

order=
args=()
for a in "$@"; do
    case $a in
    -Wl,--symbol-ordering-file=*) order=${a#-Wl,--symbol-ordering-file=} ;;
    @*) exec cc "$@" ;;
    *) args+=("$a") ;;
    esac
done
[ -n "$order" ] || exec cc "$@"

out=
first=()
next_is_out=
for a in "${args[@]}"; do
    if [ -n "$next_is_out" ]; then
        out=$a
        next_is_out=
        first+=("$a.unordered")
        continue
    fi
    case $a in
    -o)
        next_is_out=1
        first+=("$a")
        ;;
    # Symbols are kept for the first link, whatever the profile strips.
    -s | -Wl,-s | -Wl,--strip-all | -Wl,--strip-debug | -Wl,-S) ;;
    *) first+=("$a") ;;
    esac
done
[ -n "$out" ] || exec cc "$@"

cc "${first[@]}"
resolved="$out.order"
# The binary's own crate as rustc mangles its paths: sandbox_dp-<hash> -> _ZN10sandbox_dp.
crate=$(basename "$out")
crate=${crate%%-*}
prefix="_ZN${#crate}${crate}"
# Each function of the binary (code, weak code, IFUNC) as "without hash<TAB>full name"; the
# list (callgrind's `'N` recursion marks dropped) resolved against them, in its order.
nm -P --defined-only "$out.unordered" | awk '$2 ~ /^[tTWi]$/ { print $1 }' |
    sed -E 's/^(.*)$/\1\t\1/; s/(\.llvm)?\.[0-9]+\t/\t/; s/17h[0-9a-f]+E\t/\t/' >"$out.names"
sed "s/'[0-9]*\$//" "$order" | awk -F '\t' '
    NR == FNR {
        if (!($0 in want)) { want[$0] = 1; entries[n++] = $0 }
        next
    }
    { have[$2] = 1; count[$1]++; only[$1] = $2 }
    END {
        for (i = 0; i < n; i++) {
            e = entries[i]
            own = index(e, prefix) == 1
            if (e in have) {
                if (!(e in placed)) { print e; exact++; own_exact += own }
                placed[e] = 1
                continue
            }
            b = e
            sub(/(\.llvm)?\.[0-9]+$/, "", b)
            sub(/17h[0-9a-f]+E$/, "", b)
            f = only[b]
            if (count[b] == 1 && !(f in placed) && !(f in want)) {
                print f; placed[f] = 1; byname++; own_byname += own
            }
            else if (count[b] > 1) ambiguous++
        }
        # How the list matched this binary, for tools/order-report.sh to judge.
        printf "%d\t%d\t%d\t%d\t%d\n", exact, byname, ambiguous, own_exact, own_byname > stats
    }' stats="$out.stats" prefix="$prefix" - "$out.names" >"$resolved"
# One line per binary beside the list: its name, then the counts above.
printf '%s\t%s\n' "$(basename "$out")" "$(cat "$out.stats")" >>"$order.log"
rm -f "$out.stats"
rm -f "$out.names"
rm -f "$out.unordered"
cc "${args[@]}" "-Wl,--symbol-ordering-file=$resolved" -Wl,--no-warn-symbol-ordering
rm -f "$resolved"
