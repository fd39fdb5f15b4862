#!/usr/bin/env bash
# Builds the cluster tier's Go programs from the Go module proxy, each from a module of the
# project's in this directory that requires the upstream release and names the commands it
# builds (tools.go):
#   kubernetes-<v>   kube-apiserver, kube-controller-manager, kube-scheduler, kubelet
#   containerd-<v>   containerd, containerd-shim-runc-v2, ctr
#
#   tests/cluster/go/build.sh OUT NAME...     e.g. build.sh target/go kubernetes-v1.36.3
#
# Each NAME is built into OUT/NAME/ with CGO_ENABLED=0 (static binaries), go.sum checked
# (-mod=readonly: a module not in go.sum is an error, nothing is resolved anew), and the
# release's version stamped where its own build stamps it. A stamp file (the hash of the
# module's files, this script and the Go version) makes a second run build nothing. The
# NAMEs are built one after another: each build already uses every core.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
die() { echo "go/build.sh: $*" >&2; exit 1; }
[ $# -ge 2 ] || die "usage: build.sh OUT NAME..."
out="$(mkdir -p "$1" && cd "$1" && pwd)"
shift
command -v go >/dev/null || die "go not found: the cluster tier builds Kubernetes and containerd with Go 1.26 (Debian: install Go from go.dev, or set K8S_ASSETS to official binaries)"

export CGO_ENABLED=0 GOFLAGS=-mod=readonly GOTOOLCHAIN=local
# Go 1.27 turns the jsonv2 experiment on by default; kube-apiserver built with it serves
# OpenAPI that kubectl cannot read. Off, whatever the toolchain (1.25 and later know it).
export GOEXPERIMENT=nojsonv2

for name in "$@"; do
    mod="$here/$name"
    [ -f "$mod/go.mod" ] || die "$mod/go.mod: no such module (one of: $(cd "$here" && ls -d */ | tr -d / | tr '\n' ' '))"
    dest="$out/$name"
    stamp="$(cat "$mod/go.mod" "$mod/go.sum" "$mod/tools.go" "$0" | sha256sum | cut -d' ' -f1) $(go env GOVERSION)"
    if [ "$(cat "$dest/stamp" 2>/dev/null)" = "$stamp" ]; then
        continue
    fi
    upstream=$(sed -n 's#^require \([^ ]*\) \(v[0-9.]*\)$#\1 \2#p' "$mod/go.mod" | head -n 1)
    [ -n "$upstream" ] || die "$mod/go.mod: no 'require MODULE VERSION' line first"
    read -r path version <<<"$upstream"
    pkgs=$(sed -n 's#^\s*_ "\(.*\)"$#\1#p' "$mod/tools.go")
    case "$path" in
    k8s.io/kubernetes)
        minor=$(echo "$version" | cut -d. -f2)
        ldflags="-s -w"
        for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
            ldflags+=" -X $p.gitVersion=$version -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
        done
        tags="selinux,notest"
        ;;
    github.com/containerd/containerd/v2)
        ldflags="-s -w -X $path/version.Version=$version -X $path/version.Package=github.com/containerd/containerd"
        tags="urfave_cli_no_docs,no_btrfs,no_devmapper,no_zfs,no_aufs,no_dynamic_plugins"
        ;;
    *) die "$mod: do not know how to build $path" ;;
    esac
    echo "go/build.sh: building $path $version ($(echo $pkgs | wc -w) commands) into $dest" >&2
    t0=$(date +%s)
    rm -rf "$dest"
    mkdir -p "$dest"
    # shellcheck disable=SC2086 # one word per package
    (cd "$mod" && go build -trimpath -tags "$tags" -ldflags "$ldflags" -o "$dest/" $pkgs) ||
        die "building $path $version failed"
    echo "$stamp" >"$dest/stamp"
    echo "go/build.sh: $path $version built in $(($(date +%s) - t0)) s" >&2
done
