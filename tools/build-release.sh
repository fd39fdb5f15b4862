#!/usr/bin/env bash
# Builds the binaries as they ship: the release profile with glibc linked in (a static PIE), so
# that they need no shared library at run time, run on any glibc-based or other Linux of the same
# architecture, and start without the dynamic loader's work; ASLR is kept (position-independent).
#
#   tools/build-release.sh --workspace --bins   # as the image, the bare-metal install and the bench
#   tools/build-release.sh -p sandbox-dp        # one package: its start-up order matches only in part
#
# Arguments go to `cargo build`. The binaries land in target/<host triple>/release/ (the explicit
# --target keeps build scripts and proc macros, which run inside the compiler, dynamically
# linked), and target/shipped links to that directory.
#
# Host names are resolved by glibc's built-in `files` and `dns` sources (/etc/hosts,
# /etc/resolv.conf). Other NSS modules a host's /etc/nsswitch.conf may name (`resolve`, `mdns`,
# `sss`) would be loaded from the host, which glibc supports only for the glibc version linked
# in. In a cluster the API server is reached by the address in KUBERNETES_SERVICE_HOST; only a
# kubeconfig naming its server by host name is resolved at all.
#
# On x86_64 Linux, where rustc links with lld, two start-up costs are cut further:
# - the relative relocations (about 19,000 per binary, applied at every start) are packed
#   (-z pack-relative-relocs, DT_RELR): a table of a few KiB instead of 450 KiB to read, and a
#   shorter loop; glibc applies them from 2.36 on, so only a build host with glibc 2.36 or later
#   packs them (the glibc linked in is the build host's);
# - the functions listed in tools/startup-order.txt (what the daemons run to start and answer a
#   command; tools/startup-order.sh regenerates it) are placed side by side at the start of the
#   code, so that a command faults in a few pages of code rather than pages all over it.
#   tools/link-ordered.sh (the linker given to rustc) resolves the list in each binary, also a
#   function whose symbol hash changed since the list was made (a dependency or feature change
#   anywhere in the workspace does that). Names the build does not have are skipped. When many
#   of the functions of a binary's own crate were found only that way, the list does not match
#   the build (its generic functions are lost): tools/order-report.sh says so. The list is recorded from a build of
#   --workspace --bins; a build of fewer packages unifies other features, gets other hashes,
#   and matches it only in part (the four daemons alone: 564-603 functions by full name against
#   1,610 for sandbox-dp in a workspace build).
set -euo pipefail
cd "$(dirname "$0")/.."
triple=$(rustc -vV | sed -n 's/^host: //p')
target_dir=${CARGO_TARGET_DIR:-target}
mkdir -p "$target_dir"
flags="-C target-feature=+crt-static"
glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | sed -n 's/^glibc 2\.\([0-9]*\).*/\1/p')
if [ "$triple" = x86_64-unknown-linux-gnu ] && [ "${glibc:-0}" -ge 36 ]; then
    flags="$flags -C link-arg=-Wl,-z,pack-relative-relocs"
fi
if [ "$triple" = x86_64-unknown-linux-gnu ] && [ -s tools/startup-order.txt ] && ! command -v nm >/dev/null; then
    echo "build-release.sh: no nm (binutils) to resolve tools/startup-order.txt with; built without the start-up order" >&2
elif [ "$triple" = x86_64-unknown-linux-gnu ] && [ -s tools/startup-order.txt ]; then
    # A copy named by its content and the linker script's: the flags, and so the build, change
    # when either does.
    sum=$(cat tools/startup-order.txt tools/link-ordered.sh | sha256sum | cut -c1-16)
    order=$(cd "$target_dir" && pwd -P)/startup-order-$sum.txt
    cp tools/startup-order.txt "$order"
    case $order$PWD in
    *[[:space:]]*) echo "build-release.sh: $order or $PWD has a space in its path; built without the start-up order" >&2 ;;
    # tools/link-ordered.sh resolves the list against each binary (two links) for lld.
    *) flags="$flags -C linker=$PWD/tools/link-ordered.sh -C link-arg=-Wl,--symbol-ordering-file=$order" ;;
    esac
fi
[ -z "${order:-}" ] || rm -f "$order.log"
RUSTFLAGS="${RUSTFLAGS:-} $flags" \
    cargo build --release --locked --target "$triple" "$@"
# A list that does not match the build (recorded before a dependency or feature change, or from
# a build of other packages: features are unified over the packages built, and the hashes follow
# them) matches by full name less, and its generic functions not at all: say so.
if [ -n "${order:-}" ] && [ -s "$order.log" ]; then
    tools/order-report.sh "$order.log"
fi
ln -sfn "$triple/release" "$target_dir/shipped"
echo "built into $target_dir/shipped/ ($target_dir/$triple/release)"
