#!/usr/bin/env bash
# Builds kubevirt-check once per KubeVirt version checked:
#   OUTDIR/kubevirt-check-v1.9.0  (go.mod, go.sum)
#   OUTDIR/kubevirt-check-v1.8.2  (go.v1.8.2.mod, go.v1.8.2.sum; build tag kubevirt_v1_8)
# A binary already in OUTDIR and newer than the Go sources and its module files is kept.
#
# Modules come from the Go module proxy and are checked against the committed go.sum files
# (-mod=readonly: a build never changes them). The libvirt Go binding that KubeVirt's hostdevice
# package imports is cgo only; with the tag libvirt_dlopen it needs a C compiler but no libvirt.
# Go 1.26 is required: Go 1.27 turns GOEXPERIMENT=jsonv2 on, which changes the encoding/json
# KubeVirt decodes the DRA metadata with, so it is turned off explicitly.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
die() { echo "kubevirt-check/build.sh: $*" >&2; exit 1; }

[ $# -eq 1 ] || { echo "usage: $0 OUTDIR" >&2; exit 2; }
mkdir -p "$1"
out="$(cd "$1" && pwd)"

command -v go >/dev/null || die "go not found (Go 1.26 is needed)"
command -v "${CC:-gcc}" >/dev/null || die "no C compiler (${CC:-gcc}): the libvirt Go binding is cgo only"
goversion="$(GOTOOLCHAIN=local go env GOVERSION)"
case "$goversion" in
go1.2[6-9]* | go1.[3-9][0-9]*) ;;
*) die "$goversion is too old: KubeVirt 1.9 needs Go 1.26" ;;
esac

export GOTOOLCHAIN=local CGO_ENABLED=1 GOFLAGS=-mod=readonly GOEXPERIMENT=nojsonv2

# build VERSION MODFILE TAGS
build() {
    local version=$1 modfile=$2 tags=$3
    local bin="$out/kubevirt-check-$version"
    local sum="${modfile%.mod}.sum"
    local newer=1 f
    if [ -x "$bin" ]; then
        newer=0
        for f in "$here"/*.go "$here/$modfile" "$here/$sum"; do
            [ "$f" -nt "$bin" ] && newer=1
        done
    fi
    if [ "$newer" = 0 ]; then
        echo "kubevirt-check $version: $bin is up to date"
        return
    fi
    echo "kubevirt-check $version: building $bin ($goversion, -modfile=$modfile, -tags '$tags')"
    local start=$SECONDS
    (cd "$here" && go build -modfile="$modfile" -trimpath -tags "$tags" -o "$bin.tmp" .) ||
        { rm -f "$bin.tmp"; die "building for KubeVirt $version failed"; }
    mv -f "$bin.tmp" "$bin"
    echo "kubevirt-check $version: built in $((SECONDS - start))s"
}

build v1.9.0 go.mod "libvirt_dlopen"
build v1.8.2 go.v1.8.2.mod "libvirt_dlopen kubevirt_v1_8"
