#!/usr/bin/env python3
"""The project's own rules for what it ships, which no Kubernetes tool knows; run by
tests/check-manifests.sh. Whether the objects are valid Kubernetes (every field, the CEL of the
admission policies and DeviceClasses) is the real API server's to say: the cluster tier's
manifests test (tests/cluster/tests/manifests.rs) applies every value set with --dry-run=server.

  check.py rules FILE...        the objects of each rendered value set (the plain manifests
                                under deploy/, `helm template` outputs): DaemonSets selected by
                                the workload label and kept off where the GPU Operator says so,
                                host mounts, host namespaces and privileges, RBAC the daemons
                                need and no more, metrics ports with probes and Services, the
                                vGPU ConfigMap, the optional ServiceMonitor and OpenShift SCC
  check.py examples FILE...     the examples under deploy/examples refer to what exists: a
                                claim template to a DeviceClass the manifests FILE... ship, a
                                VMI's GPU to a claim and a request of its template
  check.py containerfile        every COPY source exists and is not excluded by .dockerignore,
                                every file the cargo build reads is in the build context, the
                                image is laid out by tools/build-image.sh and configured as its
                                OCI archive is
  check.py cli BINDIR FILE...   the commands the DaemonSets of FILE... and the systemd units run
                                parse with the built binaries in BINDIR (`<command> --help`)
  check.py image ROOTFS FILE... the image's files (tools/build-image.sh --rootfs) hold every
                                program the DaemonSets of FILE... run, and each daemon starts in
                                them alone
  check.py docs BINDIR          every command and flag of the binaries' --help is described in
                                docs/configuration.md

Every check prints what it checked; any failure prints `FAIL: ...` and exits 1.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib

import yaml

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLES = os.path.join(REPO, "deploy", "examples")
# The GPU Operator's operand service accounts, which deploy/operator/events-rbac.yaml grants
# Events (the chart's gpuOperator.events): not the chart's, in the operator's namespace.
GPU_OPERATOR_ACCOUNTS = {"nvidia-vfio-manager", "nvidia-vgpu-device-manager", "nvidia-sandbox-device-plugin"}

failures: list[str] = []


def fail(msg: str) -> None:
    failures.append(msg)
    print(f"FAIL: {msg}")


def ok(msg: str) -> None:
    print(f"ok: {msg}")


def rel(path: str) -> str:
    """path in the repository, or as it is when outside (a scratch render)."""
    r = os.path.relpath(path, REPO)
    return path if r.startswith("..") else r


def load_objects(path: str) -> list[dict]:
    with open(path) as f:
        return [o for o in yaml.safe_load_all(f) if o is not None]


def pod_spec(o: dict) -> dict | None:
    if o.get("kind") == "DaemonSet":
        return o.get("spec", {}).get("template", {}).get("spec")
    return None


def pod_containers(o: dict) -> list[dict]:
    spec = pod_spec(o)
    if not spec:
        return []
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def daemonsets(files: list[str]) -> list[tuple[str, dict]]:
    """(file, DaemonSet) of every DaemonSet in files."""
    return [(rel(os.path.abspath(f)), o) for f in files for o in load_objects(f) if o.get("kind") == "DaemonSet"]


# --- project rules -------------------------------------------------------------------------------

WORKLOAD_LABEL = "nvidia.com/gpu.workload.config"
EXPECTED_WORKLOADS = {
    "vfio-manager": {"vm-passthrough"},
    "vgpu-device-manager": {"vm-vgpu"},
    "sandbox-dp": {"vm-passthrough", "vm-vgpu"},
    "sandbox-dra": {"vm-dra"},
    "sandbox-dp-on-demand": {"vm-vgpu-on-demand"},
}
# The binary a DaemonSet runs, where it is not the DaemonSet's name.
BINARY = {"sandbox-dp-on-demand": "sandbox-dp"}
# What each daemon may mount from the host, and whether writable. Everything lives under
# HOST_ROOT=/host at its host path; kubelet's directories are named at their default root
# (the chart's kubeletDir moves them).
ALLOWED_HOST_MOUNTS = {
    "vfio-manager": {
        "/sys": True,
        "/var/lib/kubelet/plugins": False,
        "/dev": False,
        "/proc": False,
        "/lib/modules": False,
        "/run/nvidia/validations": True,
        "/run/vfio-manager": True,
        "/var/lib/kubelet/device-plugins": False,
        "/var/lib/kubelet/pod-resources": False,
        "/etc/cdi": False,
        "/var/run/cdi": False,
    },
    "vgpu-device-manager": {
        "/sys": True,
        "/var/lib/kubelet/plugins": False,
        "/dev": False,
        "/proc": False,
        "/run/nvidia/validations": True,
        "/var/lib/kubelet/device-plugins": False,
        "/var/lib/kubelet/pod-resources": False,
        "/etc/cdi": False,
        "/var/run/cdi": False,
        "/run/gpu-vm-node": True,
    },
    "sandbox-dp": {
        "/sys": False,
        "/dev": False,
        "/var/lib/kubelet/device-plugins": True,
        "/run/nvidia/validations": False,
        "/run/gpu-vm-node": False,
    },
    "sandbox-dra": {
        "/sys": True,
        "/dev": False,
        "/proc": False,
        "/lib/modules": False,
        "/var/lib/kubelet/plugins": True,
        "/var/lib/kubelet/plugins_registry": True,
        "/var/run/cdi": True,
        "/var/lib/kubelet/device-plugins": False,
        "/var/lib/kubelet/pod-resources": False,
        "/etc/cdi": False,
        "/run/gpu-vm-node": True,
        "/run/vfio-manager": True,
    },
    "sandbox-dp-on-demand": {
        "/sys": True,
        "/var/lib/kubelet/plugins": False,
        "/dev": False,
        "/proc": False,
        "/var/lib/kubelet/device-plugins": True,
        "/var/lib/kubelet/pod-resources": False,
        "/etc/cdi": False,
        "/var/run/cdi": False,
        "/run/gpu-vm-node": True,
    },
}
# Every daemon records Events about its Node, so every one has a token.
NEEDS_API = set(EXPECTED_WORKLOADS) | GPU_OPERATOR_ACCOUNTS
NEEDS_PRIVILEGED = {"vfio-manager", "vgpu-device-manager", "sandbox-dra", "sandbox-dp-on-demand"}
NEEDS_HOSTPID = {"vfio-manager", "vgpu-device-manager", "sandbox-dra", "sandbox-dp-on-demand"}
# What each service account may do: (apiGroups, resources, verbs) a rule must stay within.
EVENTS_RULE = ({"events.k8s.io", ""}, {"events"}, {"create", "patch"})
ALLOWED_RULES = {
    "vfio-manager": [EVENTS_RULE],
    # get on nodes: its init container reads its Node's workload label.
    # get on pods (on-demand): whether a pod kubelet no longer lists still runs on the node.
    "sandbox-dp": [({""}, {"nodes", "pods"}, {"get"}), EVENTS_RULE],
    "vgpu-device-manager": [({""}, {"nodes"}, {"get", "list", "watch", "patch"}), EVENTS_RULE],
    "sandbox-dra": [
        EVENTS_RULE,
        ({"resource.k8s.io"}, {"resourceslices"},
         {"get", "list", "watch", "create", "update", "patch", "delete"}),
        # deviceclasses: which extended resource names the cluster's classes claim.
        ({"resource.k8s.io"}, {"resourceclaims", "deviceclasses"}, {"get"}),
        ({""}, {"nodes"}, {"get"}),
    ],
    **{sa: [EVENTS_RULE] for sa in GPU_OPERATOR_ACCOUNTS},
}
# Each daemon's metrics port (--metrics-addr; /metrics, /healthz, /readyz): not 9400, which is
# dcgm-exporter's.
METRICS_PORTS = {"vfio-manager": 9481, "vgpu-device-manager": 9482, "sandbox-dp": 9483, "sandbox-dra": 9484,
                 "sandbox-dp-on-demand": 9483}
# The GPU Operator's operand names: nvidia.com/gpu.deploy.<operand> "false" or a pause value keeps
# the DaemonSet off a node.
OPERANDS = {"vfio-manager": "vfio-manager", "vgpu-device-manager": "vgpu-device-manager",
            "sandbox-dp": "sandbox-device-plugin", "sandbox-dp-on-demand": "sandbox-device-plugin"}
DEPLOY_OFF_VALUES = {"false", "paused-for-vgpu-change", "paused-for-driver-upgrade"}
# Where the readiness files are, as the containers see the host.
READY_DIR = "/host/run/nvidia/validations"



def env_of(c: dict) -> dict:
    return {e["name"]: e for e in c.get("env") or []}


def check_rules(objs: list[dict], where: str) -> None:
    by_kind: dict[str, dict[str, dict]] = {}
    for o in objs:
        key = (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
        if any(
            (x["kind"], x["metadata"].get("namespace"), x["metadata"]["name"]) == key
            for x in objs
            if x is not o
        ):
            fail(f"{where}: {key} is defined twice")
        by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o

    dss = by_kind.get("DaemonSet", {})
    if not set(dss) <= set(EXPECTED_WORKLOADS):
        fail(f"{where}: DaemonSets {sorted(set(dss) - set(EXPECTED_WORKLOADS))} are not the project's")
    for name, ds in dss.items():
        spec = pod_spec(ds) or {}
        tag = f"{where}: DaemonSet/{name}"
        # Selection by the workload label.
        terms = (
            spec.get("affinity", {})
            .get("nodeAffinity", {})
            .get("requiredDuringSchedulingIgnoredDuringExecution", {})
            .get("nodeSelectorTerms", [])
        )
        values = set()
        if len(terms) != 1:
            fail(f"{tag}: {len(terms)} nodeSelectorTerms (ORed): expected one")
        exprs = [e for t in terms for e in t.get("matchExpressions") or []]
        for e in exprs:
            if e.get("key") == WORKLOAD_LABEL and e.get("operator") == "In":
                values |= set(e.get("values") or [])
        if values != EXPECTED_WORKLOADS.get(name, set()):
            fail(f"{tag}: scheduled on {WORKLOAD_LABEL} in {sorted(values)}, "
                 f"expected {sorted(EXPECTED_WORKLOADS.get(name, set()))}")
        else:
            ok(f"{tag}: scheduled on {WORKLOAD_LABEL} in {sorted(values)}")
        if name in OPERANDS:
            key = f"nvidia.com/gpu.deploy.{OPERANDS[name]}"
            off = [e for e in exprs if e.get("key") == key and e.get("operator") == "NotIn"
                   and set(e.get("values") or []) == DEPLOY_OFF_VALUES]
            if not off:
                fail(f"{tag}: not kept off nodes where {key} is one of {sorted(DEPLOY_OFF_VALUES)}")
            else:
                ok(f"{tag}: kept off nodes where {key} is one of {sorted(DEPLOY_OFF_VALUES)}")
        sel = ds["spec"]["selector"].get("matchLabels", {})
        labels = ds["spec"]["template"]["metadata"].get("labels", {})
        if not sel or any(labels.get(k) != v for k, v in sel.items()):
            fail(f"{tag}: selector {sel} does not match the template labels {labels}")
        # Service account and API access.
        sa_name = spec.get("serviceAccountName")
        sa = by_kind.get("ServiceAccount", {}).get(sa_name)
        if sa is None:
            fail(f"{tag}: ServiceAccount {sa_name!r} is not defined")
        automount = spec.get("automountServiceAccountToken", (sa or {}).get(
            "automountServiceAccountToken", True))
        if (name in NEEDS_API) != bool(automount):
            fail(f"{tag}: API token mounted = {automount}, expected {name in NEEDS_API}")
        # Host namespaces and privileges.
        # Uevents reach the pod's own network namespace (owned by the initial user namespace):
        # no hostNetwork for anyone, and no user namespace of the pod's own.
        if spec.get("hostNetwork"):
            fail(f"{tag}: hostNetwork = true, not needed (uevents reach the pod's network namespace)")
        if spec.get("hostUsers") is False:
            fail(f"{tag}: hostUsers = false: its network namespace would receive no uevents")
        if bool(spec.get("hostPID")) != (name in NEEDS_HOSTPID):
            fail(f"{tag}: hostPID = {bool(spec.get('hostPID'))}, expected {name in NEEDS_HOSTPID}")
        for c in pod_containers(ds):
            priv = bool((c.get("securityContext") or {}).get("privileged"))
            expect = name in NEEDS_PRIVILEGED and c in (spec.get("containers") or [])
            if priv != expect:
                fail(f"{tag}: container {c['name']} privileged = {priv}, expected {expect}")
        # Host paths: only the allowed ones, each at /host<path>, writable only where needed.
        # kubelet's root (the chart's kubeletDir) is where its device-plugins directory is.
        vols = {v["name"]: v for v in spec.get("volumes") or []}
        allowed = ALLOWED_HOST_MOUNTS.get(name, {})
        kubelet = os.path.dirname(((vols.get("device-plugins") or {}).get("hostPath") or {}).get("path")
                                  or "/var/lib/kubelet/device-plugins")
        for c in pod_containers(ds):
            for m in c.get("volumeMounts") or []:
                v = vols.get(m["name"])
                if v is None:
                    fail(f"{tag}: {c['name']} mounts undefined volume {m['name']}")
                    continue
                if "subPath" in m or "subPathExpr" in m:
                    fail(f"{tag}: {c['name']} mounts {m['name']} with subPath (no live updates)")
                hp = (v.get("hostPath") or {}).get("path")
                if hp is None:
                    continue
                if hp.startswith(kubelet + "/"):
                    hp = "/var/lib/kubelet" + hp[len(kubelet):]
                if hp not in allowed:
                    fail(f"{tag}: mounts host {hp}, not in its allowed set {sorted(allowed)}")
                    continue
                want = "/host" + v["hostPath"]["path"]
                if m["mountPath"] != want:
                    fail(f"{tag}: host {hp} mounted at {m['mountPath']}, expected {want}")
                writable = not m.get("readOnly", False)
                if writable and not allowed[hp]:
                    fail(f"{tag}: host {hp} is mounted writable but only needs reading")
        used_vols = {m["name"] for c in pod_containers(ds) for m in c.get("volumeMounts") or []}
        for vn in set(vols) - used_vols:
            fail(f"{tag}: volume {vn} is never mounted")
        for c in spec.get("containers") or []:
            env = env_of(c)
            if env.get("HOST_ROOT", {}).get("value") != "/host":
                fail(f"{tag}: {c['name']} lacks HOST_ROOT=/host")
            nn = env.get("NODE_NAME", {}).get("valueFrom", {}).get("fieldRef", {})
            if nn.get("fieldPath") != "spec.nodeName":
                fail(f"{tag}: {c['name']} lacks NODE_NAME from spec.nodeName")
            # The kubelet directory the daemon reads is the one mounted.
            mounted = {m["mountPath"] for m in c.get("volumeMounts") or []}
            kdir = f"/host{kubelet}/device-plugins"
            if kdir in mounted and env.get("KUBELET_DIR", {}).get("value") != kdir:
                fail(f"{tag}: {c['name']} mounts {kdir} but does not set KUBELET_DIR={kdir}")
            cmd = c.get("command") or []
            binary = BINARY.get(name, name)
            if cmd != [f"/usr/local/bin/{binary}"]:
                fail(f"{tag}: {c['name']} runs {cmd}, expected [/usr/local/bin/{binary}]")
            check_metrics(c, name, tag, by_kind.get("Service", {}))
        ok(f"{tag}: service account, host namespaces, privileges and host mounts as required")
    # An init container of sandbox-dp waits for the readiness file of the node's workload
    # (`sandbox-dp wait-ready`: vfio-pci-ready or vgpu-devices-ready, by the workload label),
    # with the validations directory mounted.
    sdp = dss.get("sandbox-dp")
    if sdp:
        waits = [
            c for c in (pod_spec(sdp) or {}).get("initContainers") or []
            if (c.get("command") or []) + (c.get("args") or []) == ["/usr/local/bin/sandbox-dp", "wait-ready"]
        ]
        if not waits:
            fail(f"{where}: sandbox-dp has no init container running `sandbox-dp wait-ready`")
        else:
            mounts = {m.get("mountPath") for m in waits[0].get("volumeMounts") or []}
            if not any(READY_DIR.startswith(m or "\0") for m in mounts):
                fail(f"{where}: sandbox-dp's wait-ready init container does not mount {READY_DIR}")
            ok(f"{where}: sandbox-dp waits for its workload's readiness file in {READY_DIR}")
    # RBAC: only the daemons that need the API, each only what ALLOWED_RULES gives it.
    bound_sas = set()
    role_sas: dict[tuple[str, str], set[str]] = {}
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        for bn, b in by_kind.get(kind, {}).items():
            if b["roleRef"]["name"] not in by_kind.get(b["roleRef"]["kind"], {}):
                fail(f"{where}: {kind}/{bn} refers to missing {b['roleRef']['kind']}/{b['roleRef']['name']}")
            for s in b.get("subjects") or []:
                if s.get("kind") == "ServiceAccount":
                    bound_sas.add(s["name"])
                    role_sas.setdefault((b["roleRef"]["kind"], b["roleRef"]["name"]), set()).add(s["name"])
                    sa = by_kind.get("ServiceAccount", {}).get(s["name"])
                    if s["name"] in GPU_OPERATOR_ACCOUNTS:
                        continue
                    if sa is None or sa["metadata"].get("namespace") != s.get("namespace"):
                        fail(f"{where}: {kind}/{bn} binds ServiceAccount {s.get('namespace')}/{s['name']}, not defined")
    if bound_sas - NEEDS_API:
        fail(f"{where}: API access granted to {sorted(bound_sas - NEEDS_API)}")
    for kind in ("ClusterRole", "Role"):
        for rn, r in by_kind.get(kind, {}).items():
            sas = role_sas.get((kind, rn), set())
            for rule in r.get("rules") or []:
                groups, res = set(rule.get("apiGroups") or []), set(rule.get("resources") or [])
                verbs = set(rule.get("verbs") or [])
                for sa in sas or {None}:
                    fits = any(groups <= g and res <= rs and verbs <= v
                               for g, rs, v in ALLOWED_RULES.get(sa, []))
                    if not fits:
                        fail(f"{where}: {kind}/{rn} grants {sa or 'nobody'} more than it needs: {rule}")
    ok(f"{where}: RBAC grants {sorted(bound_sas)} only what each needs")
    # The vGPU ConfigMap: present, referenced, and a well-formed vgpu-configs file.
    # (vgpuDeviceManager.config.create=false: one the cluster has, not rendered.)
    cms = by_kind.get("ConfigMap", {})
    for name, ds in dss.items():
        for v in (pod_spec(ds) or {}).get("volumes") or []:
            ref = (v.get("configMap") or {}).get("name")
            if ref and ref not in cms:
                ok(f"{where}: DaemonSet/{name} mounts ConfigMap {ref}, not rendered: the cluster's own")
            elif ref:
                check_vgpu_config(ref, cms[ref].get("data", {}).get("config.yaml", ""), where)
    check_optional_crds(by_kind, dss, where)


def check_metrics(c: dict, name: str, tag: str, services: dict[str, dict]) -> None:
    """The daemon serves its metrics port; probes and a Service use it."""
    port = METRICS_PORTS[name]
    if f"--metrics-addr=0.0.0.0:{port}" not in (c.get("args") or []):
        fail(f"{tag}: {c['name']} args {c.get('args')} lack --metrics-addr=0.0.0.0:{port}")
    ports = {p.get("name"): p for p in c.get("ports") or []}
    if (ports.get("metrics") or {}).get("containerPort") != port:
        fail(f"{tag}: {c['name']} does not declare containerPort {port} named metrics")
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = (c.get(probe) or {}).get("httpGet") or {}
        if get.get("path") != path or get.get("port") not in ("metrics", port):
            fail(f"{tag}: {c['name']} {probe} is {c.get(probe)}, expected httpGet {path} on metrics")
    svcs = [s for s in services.values()
            if s["spec"].get("selector") == {"app.kubernetes.io/name": name}
            and any(p.get("targetPort") in ("metrics", port) for p in s["spec"].get("ports") or [])]
    if len(svcs) != 1:
        fail(f"{tag}: {len(svcs)} Services expose its metrics port, expected 1")
    elif svcs[0]["metadata"].get("labels", {}).get("app.kubernetes.io/component") != "metrics":
        fail(f"{tag}: Service/{svcs[0]['metadata']['name']} lacks app.kubernetes.io/component=metrics")
    else:
        ok(f"{tag}: metrics on {port} (probes /healthz, /readyz; Service/{svcs[0]['metadata']['name']})")


def check_optional_crds(by_kind: dict[str, dict[str, dict]], dss: dict[str, dict], where: str) -> None:
    """The chart's ServiceMonitor selects every metrics Service; its OpenShift SCC admits every
    DaemonSet's service account with what its pod asks for."""
    services = by_kind.get("Service", {})
    for name, sm in by_kind.get("ServiceMonitor", {}).items():
        sel = sm["spec"].get("selector", {}).get("matchLabels", {})
        picked = {n for n, s in services.items()
                  if all(s["metadata"].get("labels", {}).get(k) == v for k, v in sel.items())}
        want = {n for n, s in services.items()
                if s["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "metrics"}
        ports = {e.get("port") for e in sm["spec"].get("endpoints") or []}
        if picked != want or ports != {"metrics"}:
            fail(f"{where}: ServiceMonitor/{name} selects {sorted(picked)} on ports {sorted(ports, key=str)}, "
                 f"expected {sorted(want)} on port metrics")
        else:
            ok(f"{where}: ServiceMonitor/{name} scrapes {sorted(picked)}")
    for name, scc in by_kind.get("SecurityContextConstraints", {}).items():
        users = set(scc.get("users") or [])
        for ds_name, ds in dss.items():
            spec = pod_spec(ds) or {}
            ns = ds["metadata"].get("namespace")
            user = f"system:serviceaccount:{ns}:{spec.get('serviceAccountName')}"
            if user not in users:
                fail(f"{where}: SecurityContextConstraints/{name} does not admit {user}")
            if spec.get("hostPID") and not scc.get("allowHostPID"):
                fail(f"{where}: SecurityContextConstraints/{name} forbids hostPID, which {ds_name} uses")
            if any((c.get("securityContext") or {}).get("privileged") for c in pod_containers(ds)) \
                    and not scc.get("allowPrivilegedContainer"):
                fail(f"{where}: SecurityContextConstraints/{name} forbids privileged, which {ds_name} uses")
            kinds = {k for v in spec.get("volumes") or [] for k in v if k != "name"}
            allowed = set(scc.get("volumes") or [])
            if "*" not in allowed and kinds - allowed:
                fail(f"{where}: SecurityContextConstraints/{name} forbids volumes {sorted(kinds - allowed)} of {ds_name}")
        ok(f"{where}: SecurityContextConstraints/{name} admits {sorted(users)}")


TYPE_KEY = re.compile(r"^[A-Za-z0-9]+[A-Za-z0-9-]*-[0-9A-Za-z-]+$|^nvidia-[0-9]+$|^[a-z]+-[0-9]+$")
FILTER = re.compile(r"^0x[0-9A-Fa-f]{8}(:0x[0-9A-Fa-f]{8})?$")


def check_vgpu_config(name: str, text: str, where: str) -> None:
    tag = f"{where}: ConfigMap/{name} config.yaml"
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as e:
        fail(f"{tag}: not YAML: {e}")
        return
    if not isinstance(cfg, dict) or cfg.get("version") != "v1" or set(cfg) != {"version", "vgpu-configs"}:
        fail(f"{tag}: expected exactly version: v1 and vgpu-configs")
        return
    profiles = cfg["vgpu-configs"]
    if "default" not in profiles:
        fail(f"{tag}: no default profile")
    n = 0
    for pname, entries in profiles.items():
        if not isinstance(entries, list) or not entries:
            fail(f"{tag}: profile {pname}: not a list of entries")
            continue
        for i, e in enumerate(entries):
            if set(e) - {"devices", "device-filter", "vgpu-devices"} or "devices" not in e or "vgpu-devices" not in e:
                fail(f"{tag}: profile {pname} entry {i}: fields {sorted(e)}")
                continue
            if e["devices"] != "all" and not (isinstance(e["devices"], list) and all(isinstance(x, int) and x >= 0 for x in e["devices"])):
                fail(f"{tag}: profile {pname} entry {i}: devices {e['devices']!r}")
            f = e.get("device-filter")
            for fv in ([f] if isinstance(f, str) else f or []):
                if not FILTER.match(fv):
                    fail(f"{tag}: profile {pname} entry {i}: device-filter {fv!r}")
            for t, count in (e["vgpu-devices"] or {}).items():
                if not TYPE_KEY.match(str(t)) or not isinstance(count, int) or count < 1:
                    fail(f"{tag}: profile {pname} entry {i}: vgpu-devices {t!r}: {count!r}")
            n += 1
    ok(f"{tag}: {len(profiles)} profiles, {n} entries, well-formed")


def cmd_rules(files: list[str]) -> None:
    for f in files:
        objs = load_objects(f)
        ok(f"{rel(os.path.abspath(f))}: {len(objs)} objects")
        check_rules(objs, rel(os.path.abspath(f)))


def cmd_examples(manifests: list[str]) -> None:
    """An example refers only to what exists: a VMI's GPU to a claim of its own and a request of
    that claim's template, a template to a DeviceClass the manifests ship."""
    shipped = {o["metadata"]["name"] for f in manifests for o in load_objects(f) if o["kind"] == "DeviceClass"}
    for d in sorted(glob.glob(os.path.join(EXAMPLES, "*", ""))):
        objs = [o for f in sorted(glob.glob(os.path.join(d, "*.yaml"))) for o in load_objects(f)]
        check_example(objs, shipped, rel(d.rstrip(os.sep)))


def check_example(objs: list[dict], shipped: set[str], where: str) -> None:
    templates = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ResourceClaimTemplate"}
    for name, t in templates.items():
        for r in t["spec"]["spec"]["devices"].get("requests") or []:
            cls = (r.get("exactly") or {}).get("deviceClassName")
            if cls not in shipped:
                fail(f"{where}: ResourceClaimTemplate/{name} request {r['name']}: DeviceClass {cls!r} is not shipped")
            else:
                ok(f"{where}: ResourceClaimTemplate/{name} request {r['name']}: DeviceClass {cls}")
    for o in objs:
        if o["kind"] != "VirtualMachineInstance":
            continue
        tag = f"{where}: VirtualMachineInstance/{o['metadata']['name']}"
        spec = o.get("spec") or {}
        allowed = {"name", "claimName", "requestName", "deviceName", "tag", "virtualGPUOptions"}
        claims = {c.get("name"): c for c in spec.get("resourceClaims") or []}
        for g in (spec.get("domain") or {}).get("devices", {}).get("gpus") or []:
            if set(g) - allowed:
                fail(f"{tag}: gpus[] entry has fields {sorted(set(g) - allowed)} KubeVirt does not know")
                continue
            if "claimName" not in g:
                continue
            claim = claims.get(g["claimName"])
            if claim is None:
                fail(f"{tag}: GPU {g.get('name')} names claim {g['claimName']!r}, not in spec.resourceClaims")
                continue
            t = templates.get(claim.get("resourceClaimTemplateName"))
            if t is None:
                fail(f"{tag}: claim {g['claimName']} uses template {claim.get('resourceClaimTemplateName')!r}, not in the example")
                continue
            requests = [r["name"] for r in t["spec"]["spec"]["devices"].get("requests") or []]
            if g.get("requestName") not in requests:
                fail(f"{tag}: GPU {g.get('name')} names request {g.get('requestName')!r}, not one of {requests}")
            else:
                ok(f"{tag}: GPU {g['name']} from claim {g['claimName']}, request {g['requestName']}")


# --- Containerfile -------------------------------------------------------------------------------


def containerfile_instructions(path: str) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out = []
    with open(path) as f:
        lines = f.read().split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        start = i + 1
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        text = line
        while text.rstrip().endswith("\\") and i < len(lines):
            text = text.rstrip()[:-1] + " "
            nxt = lines[i]
            i += 1
            if nxt.lstrip().startswith("#"):
                continue
            text += nxt
        parts = text.strip().split(None, 1)
        out.append((start, parts[0].upper(), parts[1] if len(parts) > 1 else ""))
    return out


def dockerignore_patterns(path: str) -> list[tuple[bool, re.Pattern]]:
    pats = []
    if not os.path.exists(path):
        return pats
    with open(path) as f:
        for raw in f:
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            neg = line.startswith("!")
            if neg:
                line = line[1:].strip()
            line = os.path.normpath(line).lstrip("/")
            pats.append((neg, re.compile(glob_to_regex(line))))
    return pats


def glob_to_regex(pat: str) -> str:
    """Docker's .dockerignore syntax: Go filepath.Match plus `**` for any number of dirs."""
    out = ""
    i = 0
    while i < len(pat):
        c = pat[i]
        if pat.startswith("**", i):
            i += 2
            if pat.startswith("/", i):
                i += 1
                out += "(?:.*/)?"
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            j = pat.find("]", i)
            if j == -1:
                out += re.escape(c)
            else:
                cls = pat[i + 1 : j]
                if cls.startswith("^"):
                    cls = "!" + cls[1:]
                out += "[" + ("^" + cls[1:] if cls.startswith("!") else cls) + "]"
                i = j
        elif c == "\\" and i + 1 < len(pat):
            i += 1
            out += re.escape(pat[i])
        else:
            out += re.escape(c)
        i += 1
    return "^" + out + "$"


def ignored(relpath: str, pats: list[tuple[bool, re.Pattern]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = relpath.split("/")
    candidates = ["/".join(parts[: k + 1]) for k in range(len(parts))]
    result = False
    for neg, rx in pats:
        if any(rx.match(c) for c in candidates):
            result = not neg
    return result


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "-C", REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True,
            capture_output=True,
        ).stdout
        return [p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for root, dirs, names in os.walk(REPO):
            dirs[:] = [d for d in dirs if d not in (".git", "target")]
            files += [os.path.relpath(os.path.join(root, n), REPO) for n in names]
        return files


def workspace() -> dict:
    with open(os.path.join(REPO, "Cargo.toml"), "rb") as f:
        return tomllib.load(f)


def bin_targets(pkg_dir: str) -> list[str]:
    with open(os.path.join(REPO, pkg_dir, "Cargo.toml"), "rb") as f:
        manifest = tomllib.load(f)
    bins = [b["name"] for b in manifest.get("bin", [])]
    if not bins and os.path.exists(os.path.join(REPO, pkg_dir, "src", "main.rs")):
        bins = [manifest["package"]["name"]]
    return bins


DAEMONS = ["vfio-manager", "vgpu-device-manager", "sandbox-dp", "sandbox-dra"]


def cmd_containerfile() -> None:
    cf = os.path.join(REPO, "Containerfile")
    if not os.path.exists(cf):
        fail("Containerfile missing")
        return
    pats = dockerignore_patterns(os.path.join(REPO, ".dockerignore"))
    files = tracked_files()
    in_context = [f for f in files if not ignored(f, pats)]
    stages: list[str] = []
    text = open(cf).read()
    for lineno, instr, args in containerfile_instructions(cf):
        where = f"Containerfile:{lineno}"
        if instr == "FROM":
            m = re.match(r"^(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?\s*$", args, re.I)
            if not m:
                fail(f"{where}: cannot parse FROM {args!r}")
                continue
            stages.append((m.group(2) or str(len(stages))).lower())
        elif instr in ("COPY", "ADD"):
            if args.lstrip().startswith("["):
                words = json.loads(args)
            else:
                words = shlex.split(args)
            flags = [w for w in words if w.startswith("--")]
            paths = [w for w in words if not w.startswith("--")]
            if len(paths) < 2:
                fail(f"{where}: {instr} needs a source and a destination")
                continue
            frm = [f.split("=", 1)[1] for f in flags if f.startswith("--from=")]
            if frm:
                if frm[0].lower() not in stages[:-1] and not re.search(r"[/:]", frm[0]):
                    fail(f"{where}: COPY --from={frm[0]}: no earlier stage of that name")
                else:
                    ok(f"{where}: COPY --from={frm[0]} names an earlier stage")
                continue
            for src in paths[:-1]:
                src_n = os.path.normpath(src).lstrip("/")
                if src_n == ".":
                    ok(f"{where}: {instr} {src}: the whole context ({len(in_context)} of {len(files)} files)")
                    continue
                hits = [f for f in in_context if fnmatch.fnmatch(f, src_n) or f.startswith(src_n.rstrip("/") + "/")]
                if not hits:
                    exists = any(fnmatch.fnmatch(f, src_n) or f.startswith(src_n + "/") for f in files)
                    fail(f"{where}: {instr} {src}: " + (
                        "excluded by .dockerignore" if exists else "does not exist in the build context"))
                else:
                    ok(f"{where}: {instr} {src}: {len(hits)} files in the build context")
    # Everything the cargo build reads is in the context.
    ws = workspace()
    members = ws.get("workspace", {}).get("members", [])
    need_prefixes = [m.rstrip("/") + "/" for m in members]
    # The build scripts the image runs, if it runs any.
    scripts = sorted(set(re.findall(r"\b(tools/[\w.-]+\.sh)\b", text)))
    # And the files those scripts name.
    for sc in list(scripts):
        if os.path.exists(os.path.join(REPO, sc)):
            named = re.findall(r"\b(tools/[\w.-]+\.\w+)\b", open(os.path.join(REPO, sc)).read())
            scripts += [f for f in named if os.path.exists(os.path.join(REPO, f))]
    scripts = sorted(set(scripts))
    needed = ["Cargo.toml", "Cargo.lock"] + scripts + [
        f for f in files if any(f.startswith(p) for p in need_prefixes)
    ]
    # Files outside the members pulled in by include_str!/include_bytes!/#[path].
    inc = re.compile(r'(?:include_str!|include_bytes!)\s*\(\s*"([^"]+)"|#\[path\s*=\s*"([^"]+)"\]')
    for f in list(needed):
        if f.endswith(".rs") and os.path.exists(os.path.join(REPO, f)):
            for m in inc.finditer(open(os.path.join(REPO, f), errors="replace").read()):
                target = os.path.normpath(os.path.join(os.path.dirname(f), m.group(1) or m.group(2)))
                if not target.startswith(".."):
                    needed.append(target)
    missing = sorted({f for f in needed if f not in files or ignored(f, pats)})
    if missing:
        fail(f".dockerignore excludes, or the context lacks, files the build reads: {missing[:10]}")
    else:
        ok(f"build context holds the {len(set(needed))} files the cargo build reads "
           f"(workspace members {', '.join(members)})")
    # The image builds and installs the three daemons the manifests and units run.
    for d in DAEMONS:
        if not os.path.isdir(os.path.join(REPO, d)):
            fail(f"workspace member {d} missing")
            continue
        if d not in [m.rstrip("/") for m in members]:
            fail(f"{d} is not a workspace member")
        if not re.search(
            rf"cargo build[^\n]*(?:-p {re.escape(d)}\b|--workspace)", text
        ):
            fail(f"Containerfile does not build package {d} (cargo build --release -p {d})")
        for b in bin_targets(d):
            if b not in text:
                fail(f"Containerfile does not install binary {b}")
        ok(f"Containerfile builds and installs {d}")
    for u in glob.glob(os.path.join(REPO, "systemd", "*.service")):
        for m in re.finditer(r"^ExecStart=-?(\S+)", open(u).read(), re.M):
            if os.path.basename(m.group(1)) not in DAEMONS:
                fail(f"{rel(u)}: runs {m.group(1)}, not one of {DAEMONS}")
    # The image is laid out by tools/build-image.sh, as the OCI archive is; its config is the
    # archive's.
    if not re.search(r"tools/build-image\.sh --rootfs /out\b", text):
        fail("Containerfile does not lay the image out with tools/build-image.sh --rootfs /out")
    instrs = containerfile_instructions(cf)
    froms = [a for _, i, a in instrs if i == "FROM"]
    if not froms or froms[-1].strip().lower() != "scratch":
        fail(f"Containerfile's runtime stage is FROM {froms[-1] if froms else None}, not scratch")
    copies = [a for _, i, a in instrs if i == "COPY" and "--from=" in a]
    if copies != ["--from=builder /out/ /"]:
        fail(f"the runtime stage copies {copies}, not only --from=builder /out/ /")
    want = json.loads(subprocess.run([os.path.join(REPO, "tools/build-image.sh"), "--print-config"],
                                     check=True, capture_output=True, text=True).stdout)
    env, labels, cmd = [], {}, None
    for _, i, a in instrs:
        if i == "ENV":
            env += [f"{k}={v}" for k, v in (w.split("=", 1) for w in shlex.split(a))]
        elif i == "LABEL":
            labels.update(dict(w.split("=", 1) for w in shlex.split(a)))
        elif i == "CMD":
            cmd = json.loads(a)
    for what, ours, theirs in (("ENV", env, want["Env"]), ("LABEL", labels, want["Labels"]),
                               ("CMD", cmd, want["Cmd"])):
        if ours != theirs:
            fail(f"Containerfile's {what} {ours} is not tools/build-image.sh's {theirs}")
        else:
            ok(f"Containerfile's {what} is the OCI archive's")


# --- CLI consistency -----------------------------------------------------------------------------


def run_help(argv: list[str], where: str) -> None:
    try:
        r = subprocess.run(argv + ["--help"], capture_output=True, text=True, timeout=30)
    except OSError as e:
        fail(f"{where}: cannot run {argv[0]}: {e}")
        return
    if r.returncode != 0:
        err = (r.stderr or r.stdout).strip().splitlines()
        fail(f"{where}: `{' '.join(argv)}` is rejected by the binary: {err[:3]}")
    elif "Usage:" not in r.stdout:
        fail(f"{where}: `{' '.join(argv)} --help` printed no usage: is {argv[0]} built from its CLI?")
    else:
        ok(f"{where}: `{' '.join(argv[1:])}` parses")


def env_examples(path: str) -> dict[str, list[str]]:
    """VAR -> example values, from `VAR=...` and `#VAR=...` lines of the env file."""
    out: dict[str, list[str]] = {}
    for line in open(path):
        m = re.match(r"^#?([A-Z_][A-Z0-9_]*)=(.*)$", line.strip())
        if m:
            val = m.group(2)
            if len(val) >= 2 and val[0] == val[-1] and val[0] in "\"'":
                val = val[1:-1]
            out.setdefault(m.group(1), []).append(val)
    return out


def cmd_cli(bindir: str, manifests: list[str]) -> None:
    def binpath(cmd: str) -> str:
        return os.path.join(bindir, os.path.basename(cmd))

    seen = set()
    for f, o in daemonsets(manifests):
        for c in (pod_spec(o) or {}).get("containers") or []:
            cmd = c.get("command") or []
            if not cmd or os.path.basename(cmd[0]) not in DAEMONS:
                continue
            args = [re.sub(r"\$\((\w+)\)", "node-1", a) for a in c.get("args") or []]
            if (cmd[0], *args) not in seen:  # the same command in another value set
                seen.add((cmd[0], *args))
                run_help([binpath(cmd[0])] + args, f"{f}: DaemonSet/{o['metadata']['name']}")
    env_file = os.path.join(REPO, "systemd", "gpu-vm-node.env")
    examples = env_examples(env_file) if os.path.exists(env_file) else {}
    for u in sorted(glob.glob(os.path.join(REPO, "systemd", "*.service"))):
        unit = open(u).read()
        defaults = dict(re.findall(r"^Environment=([A-Z_][A-Z0-9_]*)=(\S*)$", unit, re.M))
        for m in re.finditer(r"^ExecStart=-?(.*)$", unit, re.M):
            words = shlex.split(m.group(1))
            vars_used = [w for w in words if re.fullmatch(r"\$\{?\w+\}?", w)]
            # Run once with every variable at its default (unset: nothing), then once per
            # example value of each variable from the env file.
            variants = [{}]
            for w in vars_used:
                name = w.strip("${}")
                variants += [{name: v} for v in examples.get(name, [])]
            for var in variants:
                argv = []
                for w in words:
                    if re.fullmatch(r"\$\{?\w+\}?", w):
                        name = w.strip("${}")
                        val = var.get(name, defaults.get(name, ""))
                        argv += [val] if w.startswith("${") else shlex.split(val)
                    else:
                        argv.append(w)
                argv[0] = binpath(argv[0])
                run_help(argv, rel(u))


def cmd_image(rootfs: str, manifests: list[str]) -> None:
    """The image's files (tools/build-image.sh --rootfs, from the built binaries) hold every
    program the manifests and probes run, and each daemon starts there with nothing but them."""
    def exists(path: str) -> bool:
        p = path
        for _ in range(10):
            full = os.path.join(rootfs, p.lstrip("/"))
            if os.path.islink(full):
                t = os.readlink(full)
                p = t if t.startswith("/") else os.path.join(os.path.dirname(p), t)
                continue
            return os.path.isfile(full)
        return False
    for f, o in daemonsets(manifests):
        for c in pod_containers(o):
            progs = [(c.get("command") or [""])[0]]
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                progs.append((((c.get(probe) or {}).get("exec") or {}).get("command") or [""])[0])
            for prog in progs:
                if prog.startswith("/") and not exists(prog):
                    fail(f"{f}: {o['metadata']['name']}/{c['name']} runs {prog}, which the image lacks")
    ok("the image holds every program the manifests run")
    for b in DAEMONS + ["vfio-manage"]:
        r = subprocess.run(["chroot", rootfs, f"/usr/local/bin/{b}", "--version"], capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"{b} does not start in the image's files alone: {(r.stderr or r.stdout).strip()[:300]}")
        else:
            ok(f"{b} starts in the image's files alone ({r.stdout.strip()})")


def help_text(argv: list[str]) -> str:
    r = subprocess.run(argv + ["--help"], capture_output=True, text=True, timeout=30)
    return r.stdout if r.returncode == 0 else ""


def accepts(argv: list[str], flag: str) -> bool:
    r = subprocess.run(argv + [flag, "1", "--help"], capture_output=True, text=True, timeout=30)
    return r.returncode == 0 and "Usage:" in r.stdout


def subcommands(help_out: str) -> list[str]:
    out, inside = [], False
    for line in help_out.splitlines():
        if line.startswith("Commands:"):
            inside = True
            continue
        if inside:
            m = re.match(r"^  (\S+)\s", line + " ")
            if m and m.group(1) != "help":
                out.append(m.group(1))
            elif line and not line.startswith(" "):
                break
    return out


def cmd_docs(bindir: str) -> None:
    """Every subcommand and long flag the binaries' --help lists appears in the configuration
    reference."""
    doc_path = os.path.join(REPO, "docs", "configuration.md")
    if not os.path.exists(doc_path):
        fail("docs/configuration.md missing")
        return
    doc = open(doc_path).read()
    all_flags: set[str] = {"--help", "--version"}
    commands: list[list[str]] = []
    for b in DAEMONS:
        exe = os.path.join(bindir, b)
        top = help_text([exe])
        if "Usage:" not in top:
            fail(f"{b} --help printed no usage")
            continue
        missing = []
        for sub in [None] + subcommands(top):
            argv = [exe] + ([sub] if sub else [])
            commands.append(argv)
            if sub and f"`{sub}" not in doc:
                missing.append(f"command {sub}")
            text = help_text(argv)
            # A visible alias (`[alias: --device-id]`) is a flag the binary has.
            for aliases in re.findall(r"\[alias(?:es)?: ([^\]]+)\]", text):
                all_flags.update(a.strip() for a in aliases.split(",") if a.strip().startswith("--"))
            for flag in re.findall(r"^\s+(?:-\w, )?(--[a-z][a-z0-9-]*)", text, re.M):
                all_flags.add(flag)
                if flag in ("--help", "--version"):
                    continue
                if f"`{flag}" not in doc and f", {flag}" not in doc:
                    missing.append(f"{' '.join([b] + ([sub] if sub else []))} {flag}")
        if missing:
            fail(f"docs/configuration.md does not describe: {sorted(set(missing))}")
        else:
            ok(f"docs/configuration.md describes every command and flag of {b}")
    stale = sorted(set(re.findall(r"`(--[a-z][a-z0-9-]*)", doc)) - all_flags)
    # A deprecated alias is hidden from --help but still accepted: a command that takes it
    # (with a value) before --help prints its help; an unknown flag is a usage error.
    stale = [f for f in stale if not any(accepts(argv, f) for argv in commands)]
    if stale:
        fail(f"docs/configuration.md names flags no binary has: {stale}")
    else:
        ok("docs/configuration.md names no flag the binaries lack")


def main() -> int:
    args = sys.argv[1:]
    cmd = args[0] if args else ""
    if cmd == "rules" and len(args) >= 2:
        cmd_rules(args[1:])
    elif cmd == "examples" and len(args) >= 2:
        cmd_examples(args[1:])
    elif cmd == "containerfile" and len(args) == 1:
        cmd_containerfile()
    elif cmd == "cli" and len(args) >= 3:
        cmd_cli(args[1], args[2:])
    elif cmd == "image" and len(args) >= 3:
        cmd_image(args[1], args[2:])
    elif cmd == "docs" and len(args) == 2:
        cmd_docs(args[1])
    else:
        print(__doc__)
        return 2
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
