//! What `deploy/` ships, judged by a real API server (etcd and kube-apiserver, no node) as a
//! user's cluster would judge it:
//!
//! - every value set of the Helm chart, rendered as users get it (the plain manifests
//!   `deploy/generate.sh` writes, and the chart with each of its `ci/*-values.yaml`), and the
//!   examples are applied with `--dry-run=server --validate=strict`: every field, the CEL of the
//!   DeviceClasses and admission policies; a manifest with a misspelt field is refused, naming
//!   it;
//! - the daemons' service accounts may do what the daemons do and no more (`kubectl auth
//!   can-i` as each);
//! - the admission policies, created for real, admit a daemon's requests for its own node and
//!   deny those for another node (or without a node in its token), with the policy's message:
//!   requests made as the daemon's service account with the node name a pod-bound token
//!   carries (`--as`, `--as-user-extra authentication.kubernetes.io/node-name=…`).
//!
//!   cargo test -p cluster-tier --test manifests

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use cluster_tier::{ApiServer, Assets, ControlPlane, assets};

const NS: &str = "gpu-vm-node";
const CHART: &str = "deploy/helm/gpu-vm-node";
const VGPU_POLICY: &str = "gpu-vm-node-vgpu-device-manager-own-node";
const DRA_POLICY: &str = "gpu-vm-node-sandbox-dra-own-node";
const DRIVER: &str = "gpu.gpu-vm-node.io";

/// A rendered value set: what it is, and the file holding its objects.
#[derive(Debug)]
struct ValueSet {
    name: String,
    file: PathBuf,
}

/// The plain manifests (`deploy/generate.sh --out`) and the chart rendered with each of its
/// `ci/*-values.yaml`, into `dir`.
fn render_value_sets(helm: &Path, dir: &Path) -> Result<Vec<ValueSet>> {
    let repo = assets::repo();
    let out = Command::new("bash")
        .arg(repo.join("deploy/generate.sh"))
        .arg("--out")
        .arg(dir)
        .env("HELM", helm)
        .output()
        .context("running deploy/generate.sh")?;
    ensure!(
        out.status.success(),
        "deploy/generate.sh --out failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut sets = Vec::new();
    for sub in ["deploy/manifests", "deploy/operator"] {
        for file in yaml_files(&dir.join(sub))? {
            let name = file
                .strip_prefix(dir)
                .unwrap_or(&file)
                .display()
                .to_string();
            sets.push(ValueSet { name, file });
        }
    }
    for values in yaml_files(&repo.join(CHART).join("ci"))? {
        let out = Command::new(helm)
            .args(["template", "gpu-vm-node"])
            .arg(repo.join(CHART))
            .args(["--namespace", NS, "-f"])
            .arg(&values)
            .output()
            .context("running helm template")?;
        ensure!(
            out.status.success(),
            "helm template -f {} failed: {}",
            values.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let name = format!(
            "{CHART} -f ci/{}",
            values.file_name().unwrap_or_default().to_string_lossy()
        );
        let file = dir.join(values.file_name().unwrap_or_default());
        std::fs::write(&file, &out.stdout)
            .with_context(|| format!("writing {}", file.display()))?;
        sets.push(ValueSet { name, file });
    }
    ensure!(sets.len() >= 10, "only {} value sets rendered", sets.len());
    Ok(sets)
}

fn yaml_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    Ok(files)
}

/// A stand-in CRD for another project's kind the chart or the examples may use (the Prometheus
/// Operator's ServiceMonitor, OpenShift's SecurityContextConstraints, KubeVirt's
/// VirtualMachineInstance): served, any content.
fn crd(group: &str, kind: &str, plural: &str, scope: &str) -> String {
    format!(
        r#"apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: {plural}.{group}
spec:
  group: {group}
  scope: {scope}
  names: {{kind: {kind}, plural: {plural}, singular: {singular}}}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema: {{type: object, x-kubernetes-preserve-unknown-fields: true}}
"#,
        singular = kind.to_lowercase()
    )
}

/// Polls `f` until it holds, for at most `timeout`.
fn wait_until(what: &str, timeout: Duration, f: impl Fn() -> bool) -> Result<()> {
    let end = Instant::now() + timeout;
    while !f() {
        if Instant::now() > end {
            bail!("{what}: not after {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Ok(())
}

/// Applies every value set and the examples with `--dry-run=server`, after what they need: the
/// namespace, stand-ins for other projects' CRDs. A manifest with a misspelt field is refused.
fn check_value_sets(cp: &ControlPlane, sets: &[ValueSet], scratch: &Path) -> Result<()> {
    let file = scratch.join("needs.yaml");
    let needs = [
        crd(
            "monitoring.coreos.com",
            "ServiceMonitor",
            "servicemonitors",
            "Namespaced",
        ),
        crd(
            "security.openshift.io",
            "SecurityContextConstraints",
            "securitycontextconstraints",
            "Cluster",
        ),
        crd(
            "kubevirt.io",
            "VirtualMachineInstance",
            "virtualmachineinstances",
            "Namespaced",
        ),
    ];
    std::fs::write(&file, needs.join("---\n"))?;
    cp.kubectl(&["apply", "-f", &file.to_string_lossy()])?;
    cp.kubectl(&["create", "namespace", NS])?;
    wait_until("the stand-in CRDs served", Duration::from_secs(30), || {
        [
            "monitoring.coreos.com",
            "security.openshift.io",
            "kubevirt.io",
        ]
        .iter()
        .all(|g| {
            cp.kubectl(&["api-resources", "--api-group", g, "-o", "name"])
                .is_ok_and(|o| !o.trim().is_empty())
        })
    })?;
    let dry_run = |file: &Path, extra: &[&str]| {
        let mut args = vec![
            "apply",
            "--dry-run=server",
            "--validate=strict",
            "-f",
            file.to_str().unwrap_or_default(),
        ];
        args.extend_from_slice(extra);
        cp.kubectl(&args)
    };
    let mut failed = Vec::new();
    for set in sets {
        match dry_run(&set.file, &[]) {
            Ok(out) => eprintln!("ok: {}: {} objects accepted", set.name, out.lines().count()),
            Err(e) => {
                eprintln!("FAIL: {}: {e:#}", set.name);
                failed.push(set.name.clone());
            }
        }
    }
    let examples = assets::repo().join("deploy/examples/dra");
    match dry_run(&examples, &["-n", NS]) {
        Ok(out) => eprintln!(
            "ok: deploy/examples/dra: {} objects accepted",
            out.lines().count()
        ),
        Err(e) => {
            eprintln!("FAIL: deploy/examples/dra: {e:#}");
            failed.push("deploy/examples/dra".into());
        }
    }
    ensure!(failed.is_empty(), "refused by the API server: {failed:?}");

    // A misspelt field fails, named: the API server decodes strictly.
    let plain = sets
        .iter()
        .find(|s| s.name.ends_with("manifests/gpu-vm-node.yaml"))
        .context("no deploy/manifests/gpu-vm-node.yaml rendered")?;
    let text = std::fs::read_to_string(&plain.file)?;
    ensure!(
        text.contains("hostPID: true"),
        "no hostPID in {}",
        plain.name
    );
    let broken = scratch.join("broken.yaml");
    std::fs::write(&broken, text.replacen("hostPID: true", "hostPDI: true", 1))?;
    match dry_run(&broken, &[]) {
        Ok(_) => bail!("a DaemonSet with the unknown field hostPDI was accepted"),
        Err(e) => ensure!(
            format!("{e:#}").contains("hostPDI"),
            "the refusal does not name hostPDI: {e:#}"
        ),
    }
    eprintln!("ok: a DaemonSet with a misspelt field (hostPDI) is refused, naming it");
    Ok(())
}

#[test]
fn every_value_set_is_accepted_by_the_api_server() {
    let Some(api) = ApiServer::start_or_skip("deploy/'s value sets on a real API server").unwrap()
    else {
        return;
    };
    let assets = Assets::load().unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let sets = render_value_sets(&assets.helm, scratch.path()).unwrap();
    let t0 = Instant::now();
    check_value_sets(&api, &sets, scratch.path()).unwrap();
    eprintln!(
        "ok: {} value sets and the examples on Kubernetes {} ({:.1} s)",
        sets.len(),
        assets.k8s_version,
        t0.elapsed().as_secs_f64()
    );
    drop(api);
    // And on the newest release when prepared: what a user upgrading the cluster applies next.
    if let Some(newest) = assets.newest() {
        let api = ApiServer::start_with(&newest, false).unwrap();
        let t0 = Instant::now();
        check_value_sets(&api, &sets, scratch.path()).unwrap();
        eprintln!(
            "ok: {} value sets and the examples on Kubernetes {} ({:.1} s)",
            sets.len(),
            newest.k8s_version,
            t0.elapsed().as_secs_f64()
        );
    }
}

/// Global options making a request as service account `sa` of the chart's namespace, from a
/// pod on `node` (`None`: a token without a node name).
fn as_sa(sa: &str, node: Option<&str>) -> Vec<String> {
    let mut args = vec![
        format!("--as=system:serviceaccount:{NS}:{sa}"),
        "--as-group=system:serviceaccounts".into(),
        format!("--as-group=system:serviceaccounts:{NS}"),
        "--as-group=system:authenticated".into(),
    ];
    if let Some(node) = node {
        args.push(format!(
            "--as-user-extra=authentication.kubernetes.io/node-name={node}"
        ));
    }
    args
}

/// What a request should meet: admitted, or denied by `policy` with a message holding `message`.
#[derive(Debug)]
enum Want<'a> {
    Admitted,
    Denied(&'a str, &'a str),
}

/// Makes the request `args` (with `who`'s options) and checks the verdict; the mismatches
/// pile up in `failed`.
fn expect(
    cp: &ControlPlane,
    what: &str,
    who: &[String],
    args: &[&str],
    want: Want,
    failed: &mut Vec<String>,
) {
    let mut all: Vec<&str> = who.iter().map(String::as_str).collect();
    all.extend_from_slice(args);
    let got = cp.kubectl(&all);
    let verdict = match (&got, &want) {
        (Ok(_), Want::Admitted) => Ok("admitted".to_string()),
        (Err(e), Want::Denied(policy, message)) => {
            let e = format!("{e:#}");
            if e.contains(&format!("ValidatingAdmissionPolicy '{policy}'")) && e.contains(message) {
                Ok(format!("denied: {message}"))
            } else {
                Err(format!("denied otherwise: {e}"))
            }
        }
        (Ok(_), Want::Denied(_, message)) => Err(format!("admitted, expected denied: {message}")),
        (Err(e), Want::Admitted) => Err(format!("denied, expected admitted: {e:#}")),
    };
    match verdict {
        Ok(v) => eprintln!("ok: {what}: {v}"),
        Err(v) => {
            eprintln!("FAIL: {what}: {v}");
            failed.push(what.to_string());
        }
    }
}

/// Whether the request `args` (with `who`'s options) is denied by `policy`.
fn denied_by(cp: &ControlPlane, who: &[String], args: &[&str], policy: &str) -> bool {
    let mut all: Vec<&str> = who.iter().map(String::as_str).collect();
    all.extend_from_slice(args);
    cp.kubectl(&all)
        .is_err_and(|e| format!("{e:#}").contains(&format!("ValidatingAdmissionPolicy '{policy}'")))
}

/// Whether service account `sa` may `verb` `resource` (`kubectl auth can-i`).
fn can_i(kubectl: &Path, cp: &ControlPlane, sa: &str, verb: &str, resource: &str) -> Result<bool> {
    let out = Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(cp.admin_kubeconfig())
        .args(["auth", "can-i", verb, resource])
        .arg(format!("--as=system:serviceaccount:{NS}:{sa}"))
        .output()
        .context("running kubectl auth can-i")?;
    match String::from_utf8_lossy(&out.stdout).trim() {
        "yes" => Ok(true),
        "no" => Ok(false),
        other => bail!(
            "kubectl auth can-i {verb} {resource}: {other:?} {}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

fn slice(name: &str, node: &str, driver: &str, generation: u32) -> String {
    format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata:\n  name: {name}\nspec:\n  \
         driver: {driver}\n  nodeName: {node}\n  pool:\n    name: {node}\n    generation: {generation}\n    \
         resourceSliceCount: 1\n"
    )
}

#[test]
fn the_admission_policies_keep_each_daemon_to_its_own_node() {
    let Some(api) =
        ApiServer::start_or_skip("the admission policies on a real API server").unwrap()
    else {
        return;
    };
    let assets = Assets::load().unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let sets = render_value_sets(&assets.helm, scratch.path()).unwrap();
    // The daemons' RBAC and both policies, for real: the DRA driver's value set and the
    // own-node policy's.
    api.kubectl(&["create", "namespace", NS]).unwrap();
    for name in ["manifests/dra.yaml", "manifests/own-node-policy.yaml"] {
        let set = sets.iter().find(|s| s.name.ends_with(name)).unwrap();
        api.kubectl(&["apply", "-f", &set.file.to_string_lossy()])
            .unwrap();
    }
    let labels = [
        ("nvidia.com/gpu.workload.config", "vm-vgpu"),
        ("nvidia.com/vgpu.config", "A10-4Q"),
        ("nvidia.com/vgpu.config.state", "pending"),
    ];
    api.create_node("gpu-1", &labels).unwrap();
    api.create_node("gpu-2", &labels).unwrap();
    api.create_node("gpu-bare", &[]).unwrap();
    api.apply(&slice(&format!("gpu-1-{DRIVER}"), "gpu-1", DRIVER, 1))
        .unwrap();
    api.apply(&slice(&format!("gpu-2-{DRIVER}"), "gpu-2", DRIVER, 1))
        .unwrap();

    // The policies (and the RBAC) take effect once the API server has loaded them: until a
    // request each policy denies is denied by it.
    let state = "nvidia.com/vgpu.config.state=success";
    let dry = "--dry-run=server";
    let vdm = as_sa("vgpu-device-manager", Some("gpu-1"));
    let other_node = ["label", "node", "gpu-2", state, "--overwrite", dry];
    wait_until(
        "the own-node policy in force",
        Duration::from_secs(60),
        || denied_by(&api, &vdm, &other_node, VGPU_POLICY),
    )
    .unwrap();
    let dra = as_sa("sandbox-dra", Some("gpu-1"));
    let write = |name: &str, yaml: String| {
        let p = scratch.path().join(name);
        std::fs::write(&p, yaml).unwrap();
        p.to_string_lossy().into_owned()
    };
    let other_new = write("other.yaml", slice("gpu-2-new", "gpu-2", DRIVER, 1));
    wait_until(
        "the DRA own-node policy in force",
        Duration::from_secs(60),
        || denied_by(&api, &dra, &["create", "-f", &other_new, dry], DRA_POLICY),
    )
    .unwrap();

    let mut failed = Vec::new();
    // RBAC: what each daemon does, and no more.
    let (slices, claims) = (
        "resourceslices.resource.k8s.io",
        "resourceclaims.resource.k8s.io",
    );
    let can = [
        ("vfio-manager", "create", "events.events.k8s.io", true),
        ("vfio-manager", "patch", "nodes", false),
        ("sandbox-dp", "create", "events", true),
        ("sandbox-dp", "get", "nodes", true),
        ("sandbox-dp", "list", "nodes", false),
        ("sandbox-dp", "patch", "nodes", false),
        ("vgpu-device-manager", "watch", "nodes", true),
        ("vgpu-device-manager", "patch", "nodes", true),
        ("vgpu-device-manager", "update", "nodes", false),
        ("vgpu-device-manager", "delete", "nodes", false),
        ("vgpu-device-manager", "create", slices, false),
        ("sandbox-dra", "create", slices, true),
        ("sandbox-dra", "delete", slices, true),
        ("sandbox-dra", "get", claims, true),
        ("sandbox-dra", "update", claims, false),
        ("sandbox-dra", "get", "nodes", true),
        ("sandbox-dra", "watch", "nodes", false),
        ("sandbox-dra", "patch", "nodes", false),
    ];
    for (sa, verb, resource, want) in can {
        let got = can_i(&assets.kubectl, &api, sa, verb, resource).unwrap();
        if got == want {
            eprintln!("ok: RBAC: {sa} may {verb} {resource}: {got}");
        } else {
            eprintln!("FAIL: RBAC: {sa} may {verb} {resource}: {got}, expected {want}");
            failed.push(format!("{sa} {verb} {resource}"));
        }
    }

    let own_node = "vgpu-device-manager may change only the node its pod runs on";
    let only_label = "vgpu-device-manager may change only the label nvidia.com/vgpu.config.state";
    let only_annotation =
        "vgpu-device-manager may change only the annotation nvidia.com/vgpu.config.state.reason";
    let cases: [(&str, Vec<String>, Vec<&str>, Want); 10] = [
        (
            "vgpu-device-manager: its own node's state label",
            vdm.clone(),
            vec!["label", "node", "gpu-1", state, "--overwrite", dry],
            Want::Admitted,
        ),
        (
            "vgpu-device-manager: its own node's reason annotation",
            vdm.clone(),
            vec![
                "annotate",
                "node",
                "gpu-1",
                "nvidia.com/vgpu.config.state.reason=x",
                dry,
            ],
            Want::Admitted,
        ),
        (
            "vgpu-device-manager: a first state label on an unlabelled node",
            as_sa("vgpu-device-manager", Some("gpu-bare")),
            vec![
                "label",
                "node",
                "gpu-bare",
                "nvidia.com/vgpu.config.state=pending",
                dry,
            ],
            Want::Admitted,
        ),
        (
            "vgpu-device-manager: another node",
            vdm.clone(),
            vec!["label", "node", "gpu-2", state, "--overwrite", dry],
            Want::Denied(
                VGPU_POLICY,
                "may change only the node its pod runs on (gpu-1), not gpu-2",
            ),
        ),
        (
            "vgpu-device-manager: a token without a node name",
            as_sa("vgpu-device-manager", None),
            vec!["label", "node", "gpu-1", state, "--overwrite", dry],
            Want::Denied(VGPU_POLICY, own_node),
        ),
        (
            "vgpu-device-manager: the profile label",
            vdm.clone(),
            vec![
                "label",
                "node",
                "gpu-1",
                "nvidia.com/vgpu.config=A10-8Q",
                "--overwrite",
                dry,
            ],
            Want::Denied(VGPU_POLICY, only_label),
        ),
        (
            "vgpu-device-manager: removing a label",
            vdm.clone(),
            vec![
                "label",
                "node",
                "gpu-1",
                "nvidia.com/gpu.workload.config-",
                dry,
            ],
            Want::Denied(VGPU_POLICY, only_label),
        ),
        (
            "vgpu-device-manager: another annotation",
            vdm.clone(),
            vec!["annotate", "node", "gpu-1", "example.com/x=y", dry],
            Want::Denied(VGPU_POLICY, only_annotation),
        ),
        (
            "vgpu-device-manager: the spec (cordon)",
            vdm.clone(),
            vec![
                "patch",
                "node",
                "gpu-1",
                "-p",
                r#"{"spec":{"unschedulable":true}}"#,
                dry,
            ],
            Want::Denied(
                VGPU_POLICY,
                "vgpu-device-manager may not change a node's spec",
            ),
        ),
        (
            "an administrator: another node's profile label",
            Vec::new(),
            vec![
                "label",
                "node",
                "gpu-2",
                "nvidia.com/vgpu.config=A10-8Q",
                "--overwrite",
                dry,
            ],
            Want::Admitted,
        ),
    ];
    for (what, who, args, want) in cases {
        expect(&api, what, &who, &args, want, &mut failed);
    }

    // sandbox-dra's ResourceSlices: files for the writes it makes.
    let own_new = write("own.yaml", slice("gpu-1-new", "gpu-1", DRIVER, 1));
    let own_next = write(
        "own-next.yaml",
        slice(&format!("gpu-1-{DRIVER}"), "gpu-1", DRIVER, 2),
    );
    let other_next = write(
        "other-next.yaml",
        slice(&format!("gpu-2-{DRIVER}"), "gpu-2", DRIVER, 2),
    );
    let foreign = write(
        "foreign.yaml",
        slice("gpu-1-other", "gpu-1", "other.example.com", 1),
    );
    let own_slices =
        "sandbox-dra may write only the ResourceSlices of the node its pod runs on (gpu-1)";
    let own_driver =
        "sandbox-dra may write only the ResourceSlices of the driver gpu.gpu-vm-node.io";
    let own_slice = format!("resourceslice/gpu-1-{DRIVER}");
    let other_slice = format!("resourceslice/gpu-2-{DRIVER}");
    let cases: [(&str, Vec<String>, Vec<&str>, Want); 9] = [
        (
            "sandbox-dra: creating its own node's slice",
            dra.clone(),
            vec!["create", "-f", &own_new, dry],
            Want::Admitted,
        ),
        (
            "sandbox-dra: updating its own node's slice",
            dra.clone(),
            vec!["replace", "-f", &own_next, dry],
            Want::Admitted,
        ),
        (
            "sandbox-dra: deleting a slice of its own node",
            dra.clone(),
            vec!["delete", &own_slice, dry],
            Want::Admitted,
        ),
        (
            "sandbox-dra: creating another node's slice",
            dra.clone(),
            vec!["create", "-f", &other_new, dry],
            Want::Denied(DRA_POLICY, own_slices),
        ),
        (
            "sandbox-dra: updating another node's slice",
            dra.clone(),
            vec!["replace", "-f", &other_next, dry],
            Want::Denied(DRA_POLICY, own_slices),
        ),
        (
            "sandbox-dra: deleting another node's slice",
            dra.clone(),
            vec!["delete", &other_slice, dry],
            Want::Denied(DRA_POLICY, own_slices),
        ),
        (
            "sandbox-dra: another driver's slice on its own node",
            dra.clone(),
            vec!["create", "-f", &foreign, dry],
            Want::Denied(DRA_POLICY, own_driver),
        ),
        (
            "sandbox-dra: a token without a node name",
            as_sa("sandbox-dra", None),
            vec!["create", "-f", &own_new, dry],
            Want::Denied(
                DRA_POLICY,
                "sandbox-dra may write only the ResourceSlices of the node its pod runs on ()",
            ),
        ),
        (
            "an administrator: another node's slice",
            Vec::new(),
            vec!["delete", &other_slice, dry],
            Want::Admitted,
        ),
    ];
    for (what, who, args, want) in cases {
        expect(&api, what, &who, &args, want, &mut failed);
    }
    assert!(failed.is_empty(), "not as expected: {failed:?}");
}
