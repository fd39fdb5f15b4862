#!/usr/bin/env bash
# Writes the module that build.sh builds a release from, here in NAME-VERSION/:
#
#   tests/cluster/go/add.sh kubernetes v1.37.2
#   tests/cluster/go/add.sh containerd v2.4.2
#
# go.mod requires the release, with the release's own Go version, and for Kubernetes replaces
# each k8s.io staging module with its published v0.<minor>.<patch> (k8s.io/kubernetes's go.mod
# points them at ./staging, which a module that requires it cannot use); tools.go names the
# commands the cluster tier runs; `go mod tidy` writes the rest of go.mod and go.sum from the
# Go module proxy. Commit the directory; build.sh then only downloads and verifies.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
die() { echo "go/add.sh: $*" >&2; exit 1; }
[ $# -eq 2 ] || die "usage: add.sh kubernetes|containerd VERSION"
kind=$1 version=$2
case "$kind" in
kubernetes)
    path=k8s.io/kubernetes
    cmds=(kube-apiserver kube-controller-manager kube-scheduler kubelet)
    ;;
containerd)
    path=github.com/containerd/containerd/v2
    cmds=(containerd containerd-shim-runc-v2 ctr)
    ;;
*) die "unknown: $kind (kubernetes or containerd)" ;;
esac
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
upstream=$(go mod download -json "$path@$version" | sed -n 's/^\s*"GoMod": "\(.*\)",$/\1/p')
[ -f "$upstream" ] || die "$path@$version: the Go module proxy did not give its go.mod"
dir="$here/$kind-$version"
rm -rf "$dir"
mkdir -p "$dir"
{
    echo "// The cluster tier's $kind $version: tests/cluster/go/build.sh builds its commands."
    echo "module gpu-vm-node.test/cluster/$kind-$version"
    echo
    grep -m1 '^go ' "$upstream"
    echo
    echo "require $path $version"
    if [ "$kind" = kubernetes ]; then
        staging=$(echo "$version" | sed 's/^v1\./v0./')
        echo
        sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/src/k8s.io/.*#\1#p' "$upstream" |
            while read -r m; do echo "replace $m => $m $staging"; done
    fi
} >"$dir/go.mod"
{
    echo "//go:build tools"
    echo
    echo "// The commands build.sh builds: importing them keeps their packages in go.mod and go.sum."
    echo "package tools"
    echo
    echo "import ("
    for c in "${cmds[@]}"; do echo "	_ \"$path/cmd/$c\""; done
    echo ")"
} >"$dir/tools.go"
(cd "$dir" && go mod tidy)
echo "go/add.sh: $dir written; build it with $here/build.sh OUT $kind-$version" >&2
