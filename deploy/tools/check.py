#!/usr/bin/env python3
"""Offline checks of the deployment files; run by tests/check-manifests.sh.

  check.py manifests            render every kustomization under deploy/ (resources,
                                components, namespace, images: the subset of kustomize this
                                project uses) and validate each object against the Kubernetes
                                API schemas of 1.30 and later (kubernetes-validate, strict; 1.34
                                and later for resource.k8s.io/v1), then check the project's own
                                rules (selectors, mounts, RBAC, ...); the examples under
                                deploy/examples/ refer to what the manifests ship
  check.py render DIR           print the rendered kustomization DIR as YAML
  check.py same A B WHAT        the YAML streams A and B (WHAT names them) hold the same
                                objects, compared parsed and in any order; else where they differ
  check.py validate FILE WHERE  the objects of FILE (e.g. a `helm template` output) validated
                                and checked like a kustomization's objects
  check.py containerfile        every COPY source exists and is not excluded by .dockerignore,
                                every file the cargo build reads is in the build context, the
                                image is laid out by tools/build-image.sh and configured as its
                                OCI archive is
  check.py cli BINDIR           the commands the DaemonSets and systemd units run parse with the
                                built binaries in BINDIR (`<command> --help` exits 0)
  check.py image ROOTFS         the image's files (tools/build-image.sh --rootfs) hold every
                                program the manifests run, and each daemon starts in them alone
  check.py policy               the ValidatingAdmissionPolicies' CEL, evaluated (cel-python) on
                                sample node updates and ResourceSlice writes: admitted and
                                denied as intended
  check.py docs BINDIR          every command and flag of the binaries' --help is described in
                                docs/configuration.md

Every check prints what it checked; any failure prints `FAIL: ...` and exits 1.
"""

from __future__ import annotations

import copy
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
# CHECK_DEPLOY_DIR points the manifest checks at a copy (tests/check-manifests.sh breaks a copy
# on purpose to show that a broken manifest fails).
DEPLOY = os.path.abspath(os.environ.get("CHECK_DEPLOY_DIR") or os.path.join(REPO, "deploy"))
MIN_K8S = (1, 30)
# API groups newer than MIN_K8S: their objects are validated from the release that serves them.
MIN_K8S_BY_API = {"resource.k8s.io/v1": (1, 34)}
# Kinds of other projects' CRDs (no schema in kubernetes-validate): examples only, checked by
# check_examples against what the manifests ship.
CRD_KINDS = {"VirtualMachineInstance": "kubevirt.io/v1"}
# Kinds of other projects' CRDs the Helm chart may ship (off by default): checked by
# check_rules against the objects they refer to.
OPTIONAL_CRD_KINDS = {
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "SecurityContextConstraints": "security.openshift.io/v1",
}
# Where the examples live: rendered and schema-validated, but not a deployment.
EXAMPLES = os.path.join(DEPLOY, "examples")
# The Helm chart: not a kustomization (tests/check-manifests.sh renders it with helm).
HELM = os.path.join(DEPLOY, "helm")
# Add-ons to the GPU Operator's own DaemonSets: validated, not a deployment of their own.
OPERATOR = os.path.join(DEPLOY, "operator")
GPU_OPERATOR_ACCOUNTS = {"nvidia-vfio-manager", "nvidia-vgpu-device-manager", "nvidia-sandbox-device-plugin"}

# The kinds this project ships; a kind outside this list is an error (a typo would otherwise
# only be a "schema not found" warning).
KNOWN_KINDS = {
    "Namespace",
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ConfigMap",
    "Service",
    "DaemonSet",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "DeviceClass",
    "ResourceClaimTemplate",
    "VirtualMachineInstance",
    *OPTIONAL_CRD_KINDS,
}
CLUSTER_SCOPED = {
    "DeviceClass",
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "SecurityContextConstraints",
}
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "components", "images", "patches"}

failures: list[str] = []


def fail(msg: str) -> None:
    failures.append(msg)
    print(f"FAIL: {msg}")


def ok(msg: str) -> None:
    print(f"ok: {msg}")


def rel(path: str) -> str:
    return os.path.relpath(path, REPO)


# --- kustomize subset ----------------------------------------------------------------------------


def load_yaml_docs(path: str) -> list[dict]:
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    for d in docs:
        if not isinstance(d, dict):
            raise ValueError(f"{rel(path)}: a document is not a mapping")
    return docs


def kustomization_file(d: str) -> str | None:
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        p = os.path.join(d, name)
        if os.path.isfile(p):
            return p
    return None


def json_pointer_apply(obj: dict, op: dict, where: str) -> None:
    """One JSON6902 operation (add, replace, remove) on obj, in place."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
    cur = obj
    for p in parts[:-1]:
        cur = cur[int(p)] if isinstance(cur, list) else cur[p]
    last = parts[-1]
    kind = op["op"]
    if isinstance(cur, list):
        if kind == "add":
            cur.insert(len(cur) if last == "-" else int(last), copy.deepcopy(op["value"]))
        elif kind == "replace":
            cur[int(last)] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del cur[int(last)]
        else:
            raise ValueError(f"{where}: patch op {kind!r} is not supported by this renderer")
    else:
        if kind in ("add", "replace"):
            cur[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del cur[last]
        else:
            raise ValueError(f"{where}: patch op {kind!r} is not supported by this renderer")


def apply_patches(k: dict, kf: str, objs: list[dict], strict: bool = True) -> None:
    """A kustomization's `patches` entries with an inline JSON6902 patch and a kind/name target.
    Not `strict` (a Component rendered alone, to check its own objects): a patch whose target is
    not there is skipped."""
    for entry in k.get("patches") or []:
        target = entry.get("target") or {}
        ops = yaml.safe_load(entry.get("patch", ""))
        if not isinstance(ops, list) or set(target) - {"kind", "name"}:
            raise ValueError(f"{rel(kf)}: only inline JSON6902 patches with a kind/name target are supported")
        hits = [o for o in objs if o.get("kind") == target.get("kind")
                and (o.get("metadata") or {}).get("name") == target.get("name")]
        if not hits and strict:
            raise ValueError(f"{rel(kf)}: patch target {target} matches no object")
        for o in hits:
            for op in ops:
                json_pointer_apply(o, op, rel(kf))


def render(d: str, seen: set[str] | None = None, used: set[str] | None = None,
           acc: list[dict] | None = None) -> list[dict]:
    """Renders the kustomization in directory d. `used` collects every file it reads. A
    Component adds its resources to `acc` (what the kustomization using it has so far) and
    patches all of them, as kustomize does."""
    seen = set() if seen is None else seen
    used = set() if used is None else used
    d = os.path.abspath(d)
    if d in seen:
        raise ValueError(f"{rel(d)}: kustomization cycle")
    seen = seen | {d}
    kf = kustomization_file(d)
    if kf is None:
        raise ValueError(f"{rel(d)}: no kustomization.yaml")
    used.add(kf)
    [k] = load_yaml_docs(kf)
    unknown = set(k) - KUSTOMIZATION_KEYS
    if unknown:
        raise ValueError(
            f"{rel(kf)}: fields {sorted(unknown)} are not supported by this renderer "
            f"(supported: {sorted(KUSTOMIZATION_KEYS)}); extend deploy/tools/check.py"
        )
    objs: list[dict] = acc if acc is not None else []
    for entry in k.get("resources") or []:
        p = os.path.normpath(os.path.join(d, entry))
        if os.path.isdir(p):
            objs.extend(render(p, seen, used))
        elif os.path.isfile(p):
            used.add(p)
            objs.extend(load_yaml_docs(p))
        else:
            raise ValueError(f"{rel(kf)}: resources entry {entry!r} does not exist")
    for entry in k.get("components") or []:
        p = os.path.normpath(os.path.join(d, entry))
        if not os.path.isdir(p):
            raise ValueError(f"{rel(kf)}: components entry {entry!r} does not exist")
        render(p, seen, used, objs)
    apply_patches(k, kf, objs, strict=acc is not None or k.get("kind") != "Component")
    ns = k.get("namespace")
    if ns:
        for o in objs:
            if o.get("kind") not in CLUSTER_SCOPED:
                o.setdefault("metadata", {})["namespace"] = ns
            if o.get("kind") in ("RoleBinding", "ClusterRoleBinding"):
                for s in o.get("subjects") or []:
                    if s.get("kind") == "ServiceAccount":
                        s["namespace"] = ns
    for img in k.get("images") or []:
        for o in objs:
            for c in pod_containers(o):
                name, tag = split_image(c.get("image", ""))
                if name != img["name"]:
                    continue
                new = img.get("newName", name)
                if "digest" in img:
                    c["image"] = f"{new}@{img['digest']}"
                else:
                    c["image"] = f"{new}:{img.get('newTag', tag or 'latest')}"
    return objs


def split_image(image: str) -> tuple[str, str | None]:
    if "@" in image:
        return image.split("@", 1)[0], None
    last = image.rsplit("/", 1)[-1]
    if ":" in last:
        return image.rsplit(":", 1)[0], image.rsplit(":", 1)[1]
    return image, None


def pod_spec(o: dict) -> dict | None:
    if o.get("kind") == "DaemonSet":
        return o.get("spec", {}).get("template", {}).get("spec")
    return None


def pod_containers(o: dict) -> list[dict]:
    spec = pod_spec(o)
    if not spec:
        return []
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def kustomization_dirs() -> list[str]:
    out = []
    for root, _dirs, files in os.walk(DEPLOY):
        if any(f in files for f in ("kustomization.yaml", "kustomization.yml", "Kustomization")):
            out.append(root)
    return sorted(out)


def is_component(d: str) -> bool:
    kf = kustomization_file(d)
    return bool(kf) and load_yaml_docs(kf)[0].get("kind") == "Component"


# --- schema validation ---------------------------------------------------------------------------


def schema_versions(minimum: tuple[int, int] = MIN_K8S) -> list[str]:
    import kubernetes_validate.utils as kvu

    vs = []
    for v in kvu.all_versions():
        parts = tuple(int(x) for x in v.split(".")[:2])
        if parts >= minimum and v not in vs:
            vs.append(v)
    return vs


def validate_schemas(objs: list[dict], where: str) -> None:
    import kubernetes_validate.utils as kvu

    versions = schema_versions()
    if not versions:
        fail("kubernetes-validate has no schemas for Kubernetes 1.30 or later")
        return
    for o in objs:
        name = f"{o.get('kind')}/{o.get('metadata', {}).get('name')}"
        if o.get("kind") not in KNOWN_KINDS:
            fail(f"{where}: {name}: kind not expected in this project (typo?)")
            continue
        crd = CRD_KINDS.get(o.get("kind")) or OPTIONAL_CRD_KINDS.get(o.get("kind"))
        if crd:
            if o.get("apiVersion") != crd:
                fail(f"{where}: {name}: apiVersion {o.get('apiVersion')}, expected {crd}")
            else:
                ok(f"{where}: {name}: no schema offline (a CRD); checked by its references below")
            continue
        versions = schema_versions(MIN_K8S_BY_API.get(o.get("apiVersion"), MIN_K8S))
        bad = []
        for v in versions:
            try:
                kvu.validate(copy.deepcopy(o), v, strict=True)
            except kvu.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                bad.append(f"{v}: {path}: {e.message}")
            except Exception as e:  # schema not found, version not supported
                bad.append(f"{v}: {type(e).__name__}: {e}")
        if bad:
            fail(f"{where}: {name} does not validate: " + "; ".join(bad[:3]))
        else:
            ok(f"{where}: {name} validates against Kubernetes {versions[0]}..{versions[-1]} (strict)")


# --- project rules -------------------------------------------------------------------------------

WORKLOAD_LABEL = "nvidia.com/gpu.workload.config"
EXPECTED_WORKLOADS = {
    "vfio-manager": {"vm-passthrough"},
    "vgpu-device-manager": {"vm-vgpu"},
    "sandbox-dp": {"vm-passthrough", "vm-vgpu"},
    "sandbox-dra": {"vm-dra"},
    "sandbox-dp-on-demand": {"vm-vgpu-on-demand"},
}
# DaemonSets only some deployments have (the DRA driver: deploy/components/dra; sandbox-dp
# --on-demand: deploy/components/on-demand).
OPTIONAL_DAEMONSETS = {"sandbox-dra", "sandbox-dp-on-demand"}
# The binary a DaemonSet runs, where it is not the DaemonSet's name.
BINARY = {"sandbox-dp-on-demand": "sandbox-dp"}
# What each daemon may mount from the host, and whether writable. Everything lives under
# HOST_ROOT=/host at its host path.
ALLOWED_HOST_MOUNTS = {
    "vfio-manager": {
        "/sys": True,
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
NEEDS_API = set(EXPECTED_WORKLOADS)
NEEDS_PRIVILEGED = {"vfio-manager", "vgpu-device-manager", "sandbox-dra", "sandbox-dp-on-demand"}
NEEDS_HOSTPID = {"vfio-manager", "vgpu-device-manager", "sandbox-dra", "sandbox-dp-on-demand"}
# What each service account may do: (apiGroups, resources, verbs) a rule must stay within.
EVENTS_RULE = ({"events.k8s.io", ""}, {"events"}, {"create", "patch"})
ALLOWED_RULES = {
    "vfio-manager": [EVENTS_RULE],
    "sandbox-dp": [EVENTS_RULE],
    "vgpu-device-manager": [({""}, {"nodes"}, {"get", "list", "watch", "patch"}), EVENTS_RULE],
    "sandbox-dra": [
        EVENTS_RULE,
        ({"resource.k8s.io"}, {"resourceslices"},
         {"get", "list", "watch", "create", "update", "patch", "delete"}),
        ({"resource.k8s.io"}, {"resourceclaims"}, {"get"}),
        ({""}, {"nodes"}, {"list", "watch"}),
    ],
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
VGPU_CONFIGMAP = "default-vgpu-devices-config"
# The files sandbox-dp's init container waits for.
READY_FILES = {
    "vfio-manager": "/host/run/nvidia/validations/vfio-pci-ready",
    "vgpu-device-manager": "/host/run/nvidia/validations/vgpu-devices-ready",
}


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
    required = set(EXPECTED_WORKLOADS) - OPTIONAL_DAEMONSETS
    if not required <= set(dss) <= set(EXPECTED_WORKLOADS):
        fail(f"{where}: DaemonSets are {sorted(dss)}, expected {sorted(required)} "
             f"and any of {sorted(OPTIONAL_DAEMONSETS)}")
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
        vols = {v["name"]: v for v in spec.get("volumes") or []}
        allowed = ALLOWED_HOST_MOUNTS.get(name, {})
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
                if hp not in allowed:
                    fail(f"{tag}: mounts host {hp}, not in its allowed set {sorted(allowed)}")
                    continue
                if m["mountPath"] != "/host" + hp:
                    fail(f"{tag}: host {hp} mounted at {m['mountPath']}, expected /host{hp}")
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
            kdir = "/host/var/lib/kubelet/device-plugins"
            if kdir in mounted and env.get("KUBELET_DIR", {}).get("value") != kdir:
                fail(f"{tag}: {c['name']} mounts {kdir} but does not set KUBELET_DIR={kdir}")
            cmd = c.get("command") or []
            binary = BINARY.get(name, name)
            if cmd != [f"/usr/local/bin/{binary}"]:
                fail(f"{tag}: {c['name']} runs {cmd}, expected [/usr/local/bin/{binary}]")
            check_metrics(c, name, tag, by_kind.get("Service", {}))
        ok(f"{tag}: service account, host namespaces, privileges and host mounts as required")
    # The init containers of sandbox-dp wait for the readiness files the others write.
    sdp = dss.get("sandbox-dp")
    if sdp:
        inits = " ".join(
            " ".join(c.get("command") or []) + " " + " ".join(c.get("args") or [])
            for c in (pod_spec(sdp) or {}).get("initContainers") or []
        )
        for f in READY_FILES.values():
            if os.path.basename(f) not in inits:
                fail(f"{where}: sandbox-dp's init containers do not wait for {os.path.basename(f)}")
        ok(f"{where}: sandbox-dp waits for {sorted(os.path.basename(f) for f in READY_FILES.values())}")
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
    cms = by_kind.get("ConfigMap", {})
    for name, ds in dss.items():
        for v in (pod_spec(ds) or {}).get("volumes") or []:
            ref = (v.get("configMap") or {}).get("name")
            if ref and ref not in cms:
                fail(f"{where}: DaemonSet/{name} mounts missing ConfigMap {ref}")
    cm = cms.get(VGPU_CONFIGMAP)
    if cm is None:
        fail(f"{where}: ConfigMap {VGPU_CONFIGMAP} missing")
    else:
        check_vgpu_config(cm.get("data", {}).get("config.yaml", ""), where)
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


def check_vgpu_config(text: str, where: str) -> None:
    tag = f"{where}: ConfigMap/{VGPU_CONFIGMAP} config.yaml"
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


def cmd_manifests() -> None:
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        fail("the Python package kubernetes-validate is not installed (tests/check-manifests.sh installs it)")
        return
    dirs = kustomization_dirs()
    if not dirs:
        fail("no kustomization under deploy/")
    used: set[str] = set()
    for d in dirs:
        where = rel(d)
        try:
            objs = render(d, used=used)
        except (ValueError, OSError, yaml.YAMLError, KeyError) as e:
            fail(f"{where}: cannot render: {e}")
            continue
        ok(f"{where}: renders {len(objs)} objects")
        validate_schemas(objs, where)
        if os.path.abspath(d).startswith(EXAMPLES + os.sep):
            check_examples(objs, where)
        elif os.path.abspath(d) == OPERATOR:
            check_operator_addons(objs, where)
        elif not is_component(d):
            check_rules(objs, where)
    # Every manifest file is part of some kustomization (a file nobody renders is never checked
    # or applied).
    for p in sorted(glob.glob(os.path.join(DEPLOY, "**", "*.y*ml"), recursive=True)):
        if os.path.basename(p).startswith("kustomization.") or os.path.abspath(p).startswith(HELM + os.sep):
            continue
        if os.path.abspath(p) not in used:
            fail(f"{rel(p)} is not listed in any kustomization")


def check_operator_addons(objs: list[dict], where: str) -> None:
    """The add-ons grant to the GPU Operator's operand service accounts, and nothing else runs."""
    kinds = sorted({o["kind"] for o in objs} - {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"})
    if kinds:
        fail(f"{where}: only RBAC belongs here, found {kinds}")
    for o in objs:
        for s in o.get("subjects") or []:
            if s.get("kind") == "ServiceAccount" and s.get("name") not in GPU_OPERATOR_ACCOUNTS:
                fail(f"{where}: {o['kind']}/{o['metadata']['name']} grants to {s.get('name')!r}, "
                     f"not one of the GPU Operator's {sorted(GPU_OPERATOR_ACCOUNTS)}")
    ok(f"{where}: RBAC for the GPU Operator's operands only")


def check_examples(objs: list[dict], where: str) -> None:
    """An example refers only to what exists: a VMI's GPU to a claim of its own and a request of
    that claim's template, a template to a DeviceClass the manifests ship."""
    shipped = {
        o["metadata"]["name"]
        for d in kustomization_dirs()
        if not os.path.abspath(d).startswith(EXAMPLES + os.sep)
        for o in render(d)
        if o["kind"] == "DeviceClass"
    }
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


def cmd_render(d: str) -> None:
    objs = render(d)
    sys.stdout.write(yaml.safe_dump_all(objs, sort_keys=True))


def load_objects(path: str) -> list[dict]:
    with open(path) as f:
        return [o for o in yaml.safe_load_all(f) if o is not None]


def object_key(o: dict) -> tuple[str, str, str, str]:
    m = o.get("metadata") or {}
    return (o.get("apiVersion", ""), o.get("kind", ""), m.get("namespace") or "", m.get("name", ""))


def cmd_same(a: str, b: str, what: str, ignore_kinds: tuple[str, ...] = ()) -> None:
    """Compares two renders as sets of parsed objects: any object only in one, or any field
    that differs, fails with the first differences. Objects of `ignore_kinds` are left out."""
    ours = {object_key(o): o for o in load_objects(a) if o.get("kind") not in ignore_kinds}
    theirs = {object_key(o): o for o in load_objects(b) if o.get("kind") not in ignore_kinds}
    diffs = [f"only in the first: {k}" for k in sorted(set(ours) - set(theirs))]
    diffs += [f"only in the second: {k}" for k in sorted(set(theirs) - set(ours))]

    def walk(x, y, path: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y), key=str):
                walk(x.get(k, "<absent>"), y.get(k, "<absent>"), f"{path}.{k}")
        elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            for i, (xi, yi) in enumerate(zip(x, y)):
                walk(xi, yi, f"{path}[{i}]")
        elif x != y:
            diffs.append(f"{path}: {json.dumps(x)[:200]} != {json.dumps(y)[:200]}")

    for k in sorted(set(ours) & set(theirs)):
        walk(ours[k], theirs[k], f"{k[1]}/{k[3]}")
    if diffs:
        fail(f"{what} differ: " + "; ".join(diffs[:10]))
    else:
        ok(f"{what}: the same {len(ours)} objects")


def cmd_validate(path: str, where: str) -> None:
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        fail("the Python package kubernetes-validate is not installed (tests/check-manifests.sh installs it)")
        return
    objs = load_objects(path)
    ok(f"{where}: {len(objs)} objects")
    validate_schemas(objs, where)
    check_rules(objs, where)


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


def cmd_cli(bindir: str) -> None:
    def binpath(cmd: str) -> str:
        return os.path.join(bindir, os.path.basename(cmd))

    for d in kustomization_dirs():
        if is_component(d):
            continue
        for o in render(d):
            for c in (pod_spec(o) or {}).get("containers") or []:
                cmd = c.get("command") or []
                if not cmd or os.path.basename(cmd[0]) not in DAEMONS:
                    continue
                args = [re.sub(r"\$\((\w+)\)", "node-1", a) for a in c.get("args") or []]
                run_help([binpath(cmd[0])] + args, f"{rel(d)}: {o['kind']}/{o['metadata']['name']}")
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


# --- admission policy ----------------------------------------------------------------------------

SA_USER = "system:serviceaccount:gpu-vm-node:vgpu-device-manager"


def node(name: str, labels: dict | None = None, annotations: dict | None = None, spec: dict | None = None) -> dict:
    meta: dict = {"name": name}
    if labels is not None:
        meta["labels"] = labels
    if annotations is not None:
        meta["annotations"] = annotations
    o = {"apiVersion": "v1", "kind": "Node", "metadata": meta}
    if spec is not None:
        o["spec"] = spec
    return o


BASE_LABELS = {"kubernetes.io/hostname": "gpu-1", "nvidia.com/gpu.workload.config": "vm-vgpu",
               "nvidia.com/vgpu.config": "A10-4Q", "nvidia.com/vgpu.config.state": "pending"}
# (what, user, token node, old, new, admitted)
POLICY_CASES = [
    ("its own node's state label", SA_USER, "gpu-1",
     node("gpu-1", BASE_LABELS, {}, {"podCIDR": "10.0.0.0/24"}),
     node("gpu-1", {**BASE_LABELS, "nvidia.com/vgpu.config.state": "success"}, {}, {"podCIDR": "10.0.0.0/24"}), True),
    ("its own node's reason annotation", SA_USER, "gpu-1",
     node("gpu-1", BASE_LABELS), node("gpu-1", BASE_LABELS, {"nvidia.com/vgpu.config.state.reason": "x"}), True),
    ("a first state label on an unlabelled node", SA_USER, "gpu-1",
     node("gpu-1"), node("gpu-1", {"nvidia.com/vgpu.config.state": "pending"}), True),
    ("another node", SA_USER, "gpu-1",
     node("gpu-2", BASE_LABELS), node("gpu-2", {**BASE_LABELS, "nvidia.com/vgpu.config.state": "success"}), False),
    ("a token without a node name", SA_USER, None,
     node("gpu-1", BASE_LABELS), node("gpu-1", {**BASE_LABELS, "nvidia.com/vgpu.config.state": "success"}), False),
    ("the profile label", SA_USER, "gpu-1",
     node("gpu-1", BASE_LABELS), node("gpu-1", {**BASE_LABELS, "nvidia.com/vgpu.config": "A10-8Q"}), False),
    ("removing a label", SA_USER, "gpu-1",
     node("gpu-1", BASE_LABELS), node("gpu-1", {k: v for k, v in BASE_LABELS.items() if k != "kubernetes.io/hostname"}), False),
    ("another annotation", SA_USER, "gpu-1",
     node("gpu-1", BASE_LABELS), node("gpu-1", BASE_LABELS, {"example.com/x": "y"}), False),
    ("the spec (cordon)", SA_USER, "gpu-1",
     node("gpu-1", BASE_LABELS, None, {}), node("gpu-1", BASE_LABELS, None, {"unschedulable": True}), False),
    ("(another user) anything", "system:node:gpu-1", "gpu-1",
     node("gpu-1", BASE_LABELS), node("gpu-1", {**BASE_LABELS, "nvidia.com/vgpu.config": "A10-8Q"}), True),
]

DRA_USER = "system:serviceaccount:gpu-vm-node:sandbox-dra"
DRA_DRIVER = "gpu.gpu-vm-node.io"


def rslice(node_name: str, driver: str = DRA_DRIVER, generation: int = 1) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node_name}-{driver}"},
            "spec": {"driver": driver, "nodeName": node_name,
                     "pool": {"name": node_name, "generation": generation, "resourceSliceCount": 1}}}


# (what, user, token node, operation, old, new, admitted)
DRA_POLICY_CASES = [
    ("creating its own node's slice", DRA_USER, "gpu-1", "CREATE", None, rslice("gpu-1"), True),
    ("updating its own node's slice", DRA_USER, "gpu-1", "UPDATE", rslice("gpu-1"), rslice("gpu-1", generation=2), True),
    ("deleting a stale slice of its own node", DRA_USER, "gpu-1", "DELETE", rslice("gpu-1"), None, True),
    ("creating another node's slice", DRA_USER, "gpu-1", "CREATE", None, rslice("gpu-2"), False),
    ("moving another node's slice to its own", DRA_USER, "gpu-1", "UPDATE", rslice("gpu-2"), rslice("gpu-1"), False),
    ("deleting another node's slice", DRA_USER, "gpu-1", "DELETE", rslice("gpu-2"), None, False),
    ("another driver's slice on its own node", DRA_USER, "gpu-1", "CREATE", None, rslice("gpu-1", "other.example.com"), False),
    ("a slice with a token without a node name", DRA_USER, None, "CREATE", None, rslice("gpu-1"), False),
    ("(another user) another node's slice", "system:node:gpu-1", "gpu-1", "DELETE", rslice("gpu-2"), None, True),
]

# Each policy: the service account it is about, and its cases.
POLICIES = {
    "gpu-vm-node-vgpu-device-manager-own-node": (
        SA_USER, [(w, u, t, "UPDATE", o, n, a) for w, u, t, o, n, a in POLICY_CASES]),
    "gpu-vm-node-sandbox-dra-own-node": (DRA_USER, DRA_POLICY_CASES),
}


def cmd_policy() -> None:
    """Evaluates the ValidatingAdmissionPolicies' CEL against sample requests: node updates by
    vgpu-device-manager, ResourceSlice writes by sandbox-dra."""
    try:
        import celpy
    except ImportError:
        fail("the Python package cel-python is not installed (tests/check-manifests.sh installs it)")
        return
    env = celpy.Environment()

    def prog(expr: str):
        return env.program(env.compile(expr))

    policies = []
    for d in kustomization_dirs():
        for o in render(d):
            if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"] not in [p["metadata"]["name"] for p in policies]:
                policies.append(o)
    if not policies:
        ok("no ValidatingAdmissionPolicy to evaluate")
        return
    for pol in policies:
        spec = pol["spec"]
        name = pol["metadata"]["name"]
        if name not in POLICIES:
            fail(f"{name}: no sample cases for this policy in deploy/tools/check.py")
            continue
        sa_user, cases = POLICIES[name]
        if sa_user not in json.dumps(spec.get("matchConditions", [])):
            fail(f"{name}: does not match the service account {sa_user}")
        try:
            conds = [(c["name"], prog(c["expression"])) for c in spec.get("matchConditions", [])]
            variables = [(v["name"], prog(v["expression"])) for v in spec.get("variables", [])]
            checks = [(v.get("message", v["expression"]), prog(v["expression"])) for v in spec["validations"]]
            msgs = [prog(v["messageExpression"]) for v in spec["validations"] if "messageExpression" in v]
        except Exception as e:  # a CEL syntax error
            fail(f"{name}: CEL does not compile: {e}")
            continue
        for what, user, token_node, operation, old, new, want in cases:
            extra = {"authentication.kubernetes.io/node-name": [token_node]} if token_node else {}
            act = {
                "request": celpy.json_to_cel({"userInfo": {"username": user, "extra": extra}, "operation": operation}),
                "object": celpy.json_to_cel(new),
                "oldObject": celpy.json_to_cel(old),
            }
            try:
                applies = all(bool(p.evaluate(act)) for _, p in conds)
                denied = []
                if applies:
                    vals = {}
                    for vn, p in variables:
                        act["variables"] = celpy.json_to_cel(vals)
                        vals[vn] = p.evaluate(act)
                    act["variables"] = celpy.celtypes.MapType(
                        {celpy.celtypes.StringType(k): v for k, v in vals.items()})
                    denied = [m for m, p in checks if not bool(p.evaluate(act))]
                    for m in msgs:
                        m.evaluate(act)
            except Exception as e:
                fail(f"{name}: evaluating the case '{what}' failed: {e}")
                continue
            admitted = not denied
            verdict = "admitted" if admitted else f"denied ({'; '.join(denied)})"
            if admitted != want:
                fail(f"{name}: {what}: {verdict}, expected {'admitted' if want else 'denied'}")
            else:
                ok(f"{name}: {what}: {verdict}")


def cmd_image(rootfs: str) -> None:
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
    for d in kustomization_dirs():
        if is_component(d):
            continue
        for o in render(d):
            for c in pod_containers(o):
                progs = [(c.get("command") or [""])[0]]
                for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                    progs.append((((c.get(probe) or {}).get("exec") or {}).get("command") or [""])[0])
                for prog in progs:
                    if prog.startswith("/") and not exists(prog):
                        fail(f"{rel(d)}: {o['metadata']['name']}/{c['name']} runs {prog}, which the image lacks")
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
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    cmd = sys.argv[1]
    if cmd == "manifests":
        cmd_manifests()
    elif cmd == "render" and len(sys.argv) == 3:
        cmd_render(sys.argv[2])
    elif cmd == "same" and len(sys.argv) == 5:
        cmd_same(sys.argv[2], sys.argv[3], sys.argv[4])
    elif cmd == "same" and len(sys.argv) == 6 and sys.argv[5].startswith("--ignore-kind="):
        cmd_same(sys.argv[2], sys.argv[3], sys.argv[4], tuple(sys.argv[5].split("=", 1)[1].split(",")))
    elif cmd == "validate" and len(sys.argv) == 4:
        cmd_validate(sys.argv[2], sys.argv[3])
    elif cmd == "containerfile":
        cmd_containerfile()
    elif cmd == "cli" and len(sys.argv) == 3:
        cmd_cli(sys.argv[2])
    elif cmd == "image" and len(sys.argv) == 3:
        cmd_image(sys.argv[2])
    elif cmd == "policy":
        cmd_policy()
    elif cmd == "docs" and len(sys.argv) == 3:
        cmd_docs(sys.argv[2])
    else:
        print(__doc__)
        return 2
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
