//! etcd, kube-apiserver and, for a whole cluster, kube-controller-manager and kube-scheduler.
//!
//! By default they run in this process's network namespace, the API server on `127.0.0.1`. With
//! [`ControlPlaneOpts::netns`] all four run in that namespace instead, the API server on its
//! address there, and the host reaches it through a port of its own `127.0.0.1`
//! ([`Forward`]): [`ControlPlane::server`] is that port's URL, [`ControlPlane::internal_server`]
//! the one the cluster's processes use.

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::assets::Assets;
use crate::netns::{Forward, NetNs};
use crate::pki::{Cert, Pki};
use crate::proc::{Proc, run};

/// How to run the control plane.
#[derive(Debug, Clone)]
pub struct ControlPlaneOpts {
    /// The API server's address (also its advertised address), in [`ControlPlaneOpts::netns`]
    /// when there is one.
    pub bind_ip: String,
    /// Its port (0: any free one).
    pub port: u16,
    /// The Service IP range: its first address is the `kubernetes` Service's.
    pub service_cidr: String,
    /// Whether the controller-manager and the scheduler run too.
    pub controllers: bool,
    /// The scheduler's HTTPS port, serving `/metrics` (and `/healthz`) to anyone on
    /// 127.0.0.1 (a self-signed certificate; in [`ControlPlaneOpts::netns`] when there is one);
    /// 0: none.
    pub scheduler_port: u16,
    /// More flags for kube-apiserver (`--feature-gates=…`, say).
    pub apiserver_args: Vec<String>,
    /// The network namespace etcd, the API server and the controllers run in (`None`: this
    /// process's).
    pub netns: Option<Arc<NetNs>>,
}

impl Default for ControlPlaneOpts {
    /// An API server (and etcd) alone on a free loopback port: for tests of API semantics.
    fn default() -> Self {
        ControlPlaneOpts {
            bind_ip: "127.0.0.1".into(),
            port: 0,
            service_cidr: "10.96.0.0/24".into(),
            controllers: false,
            scheduler_port: 0,
            apiserver_args: Vec::new(),
            netns: None,
        }
    }
}

/// A running control plane.
#[derive(Debug)]
pub struct ControlPlane {
    dir: PathBuf,
    pki: Pki,
    k8s_bin: PathBuf,
    kubectl: PathBuf,
    opts: ControlPlaneOpts,
    port: u16,
    // The host's way in when the control plane has a network namespace of its own.
    forward: Option<Forward>,
    etcd_url: String,
    // Stopped in reverse order of start by `Drop` of the fields, last first: declared so.
    sched: Option<Proc>,
    kcm: Option<Proc>,
    apiserver: Option<Proc>,
    etcd: Proc,
    admin: PathBuf,
}

/// A free TCP port on 127.0.0.1 (free when asked).
pub fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("binding a free port")?;
    Ok(l.local_addr().context("a bound port")?.port())
}

impl ControlPlane {
    /// Starts etcd and the API server (and the controllers with `opts.controllers`) in `dir`;
    /// returns when the API server is ready.
    pub fn start(dir: &Path, assets: &Assets, opts: ControlPlaneOpts) -> Result<ControlPlane> {
        let logs = dir.join("logs");
        let pids = dir.join("pids");
        let pki = Pki::new(&dir.join("pki"))?;
        let port = if opts.port == 0 {
            free_port()?
        } else {
            opts.port
        };
        let (client, peer) = (free_port()?, free_port()?);
        // etcd's data on tmpfs when there is one: Debian's etcd 3.4 cannot skip fsync, and each
        // write would wait for the disk.
        let data = match Path::new("/dev/shm").is_dir() {
            true => PathBuf::from(format!(
                "/dev/shm/{}-etcd",
                dir.file_name()
                    .and_then(|s| s.to_str())
                    .unwrap_or("cluster")
            )),
            false => dir.join("etcd"),
        };
        std::fs::write(dir.join("etcd-data"), data.as_os_str().as_encoded_bytes())
            .with_context(|| format!("writing {}", dir.join("etcd-data").display()))?;
        let etcd_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let netns = opts.netns.clone();
        let etcd = Proc::spawn_in(
            netns.as_deref(),
            "etcd",
            Command::new("etcd")
                .arg("--data-dir")
                .arg(&data)
                .args([
                    "--listen-client-urls",
                    &etcd_url,
                    "--advertise-client-urls",
                    &etcd_url,
                ])
                .args([
                    "--listen-peer-urls",
                    &peer_url,
                    "--initial-advertise-peer-urls",
                    &peer_url,
                ])
                .args(["--initial-cluster", &format!("default={peer_url}")])
                .args(["--log-level", "warn"]),
            &logs,
            &pids,
        )?;
        let forward = match &netns {
            Some(ns) => {
                let ip: IpAddr = opts
                    .bind_ip
                    .parse()
                    .with_context(|| format!("the API server's address {}", opts.bind_ip))?;
                Some(Forward::start(ns.clone(), SocketAddr::new(ip, port))?)
            }
            None => None,
        };
        let server = match &forward {
            Some(f) => format!("https://127.0.0.1:{}", f.port()),
            None => format!("https://{}:{port}", opts.bind_ip),
        };
        let admin = pki.sign("admin", "admin", &["system:masters"], &[])?;
        let admin_kc = pki.kubeconfig(&dir.join("admin.kubeconfig"), &server, &admin)?;
        let mut cp = ControlPlane {
            dir: dir.to_path_buf(),
            pki,
            k8s_bin: assets.k8s_bin.clone(),
            kubectl: assets.kubectl.clone(),
            opts,
            port,
            forward,
            etcd_url,
            sched: None,
            kcm: None,
            apiserver: None,
            etcd,
            admin: admin_kc,
        };
        cp.write_apiserver_files()?;
        cp.start_apiserver()?;
        if cp.opts.controllers {
            cp.start_controllers()?;
        }
        Ok(cp)
    }

    fn write_apiserver_files(&self) -> Result<()> {
        let sans = vec![
            format!("IP:{}", self.opts.bind_ip),
            "IP:127.0.0.1".into(),
            format!("IP:{}", first_ip(&self.opts.service_cidr)?),
            "DNS:localhost".into(),
            "DNS:kubernetes".into(),
            "DNS:kubernetes.default".into(),
            "DNS:kubernetes.default.svc".into(),
        ];
        self.pki.sign("apiserver", "kube-apiserver", &[], &sans)?;
        self.pki.sign(
            "apiserver-kubelet-client",
            "kube-apiserver-kubelet-client",
            &["system:masters"],
            &[],
        )?;
        // Every request's metadata: tests count what the daemons ask of the API server.
        let policy = self.dir.join("audit-policy.yaml");
        std::fs::write(
            &policy,
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n- level: Metadata\n",
        )
        .with_context(|| format!("writing {}", policy.display()))?;
        Ok(())
    }

    /// Starts the API server (again, after [`ControlPlane::stop_apiserver`]); returns when it is ready.
    pub fn start_apiserver(&mut self) -> Result<()> {
        let pki = &self.pki.clone();
        let d = pki.ca().parent().map(Path::to_path_buf).unwrap_or_default();
        let mut cmd = Command::new(self.k8s_bin.join("kube-apiserver"));
        cmd.args(["--etcd-servers", &self.etcd_url])
            .args([
                "--bind-address",
                &self.opts.bind_ip,
                "--advertise-address",
                &self.opts.bind_ip,
            ])
            .args(["--secure-port", &self.port.to_string()])
            .arg(format!(
                "--tls-cert-file={}",
                d.join("apiserver.crt").display()
            ))
            .arg(format!(
                "--tls-private-key-file={}",
                d.join("apiserver.key").display()
            ))
            .arg(format!("--client-ca-file={}", pki.ca().display()))
            .arg(format!(
                "--service-account-key-file={}",
                pki.sa_pub().display()
            ))
            .arg(format!(
                "--service-account-signing-key-file={}",
                pki.sa_key().display()
            ))
            .args(["--service-account-issuer", "https://kubernetes.default.svc"])
            .args(["--service-cluster-ip-range", &self.opts.service_cidr])
            .args(["--authorization-mode", "Node,RBAC"])
            // `kubectl logs` and `exec` reach kubelet at the node's address: no DNS here.
            .args(["--kubelet-preferred-address-types", "InternalIP,Hostname"])
            .args(["--enable-admission-plugins", "NodeRestriction"])
            .args(["--allow-privileged=true", "--profiling=false"])
            .arg(format!(
                "--kubelet-client-certificate={}",
                d.join("apiserver-kubelet-client.crt").display()
            ))
            .arg(format!(
                "--kubelet-client-key={}",
                d.join("apiserver-kubelet-client.key").display()
            ))
            .arg(format!(
                "--kubelet-certificate-authority={}",
                pki.ca().display()
            ))
            .arg(format!(
                "--audit-policy-file={}",
                self.dir.join("audit-policy.yaml").display()
            ))
            .arg(format!("--audit-log-path={}", self.audit_log().display()))
            .args(["--audit-log-maxsize", "0"]);
        if is_loopback(&self.opts.bind_ip) {
            // An API server on loopback serves no pods: the `kubernetes` Service gets no
            // endpoints (their reconciler refuses a loopback address from v1.37 on, and the API
            // server with it: "may not be in the loopback range").
            cmd.args(["--endpoint-reconciler-type", "none"]);
        }
        cmd.args(&self.opts.apiserver_args);
        self.apiserver = Some(Proc::spawn_in(
            self.opts.netns.as_deref(),
            "kube-apiserver",
            &mut cmd,
            &self.dir.join("logs"),
            &self.dir.join("pids"),
        )?);
        self.wait_ready(Duration::from_secs(60))
    }

    /// Stops the API server (SIGTERM), as an outage would take it away.
    pub fn stop_apiserver(&mut self) {
        if let Some(mut p) = self.apiserver.take() {
            p.stop(Duration::from_secs(10));
        }
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let end = Instant::now() + timeout;
        loop {
            let ok = Command::new(&self.kubectl)
                .arg("--kubeconfig")
                .arg(&self.admin)
                .args(["get", "--raw", "/readyz"])
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false);
            if ok {
                return Ok(());
            }
            if let Some(p) = self.apiserver.as_mut()
                && !p.alive()
            {
                bail!("kube-apiserver exited:\n{}", p.log_tail(20));
            }
            if Instant::now() > end {
                let tail = self
                    .apiserver
                    .as_ref()
                    .map(|p| p.log_tail(20))
                    .unwrap_or_default();
                bail!("kube-apiserver not ready after {timeout:?}:\n{tail}");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn start_controllers(&mut self) -> Result<()> {
        let server = self.internal_server();
        let logs = self.dir.join("logs");
        let pids = self.dir.join("pids");
        let kcm_cert = self
            .pki
            .sign("kcm", "system:kube-controller-manager", &[], &[])?;
        let kcm = self
            .pki
            .kubeconfig(&self.dir.join("kcm.kubeconfig"), &server, &kcm_cert)?;
        let sched_cert = self
            .pki
            .sign("scheduler", "system:kube-scheduler", &[], &[])?;
        let sched =
            self.pki
                .kubeconfig(&self.dir.join("scheduler.kubeconfig"), &server, &sched_cert)?;
        let mut cmd = Command::new(self.k8s_bin.join("kube-controller-manager"));
        for flag in [
            "--kubeconfig",
            "--authentication-kubeconfig",
            "--authorization-kubeconfig",
        ] {
            cmd.arg(format!("{flag}={}", kcm.display()));
        }
        cmd.arg(format!(
            "--service-account-private-key-file={}",
            self.pki.sa_key().display()
        ))
        .arg(format!("--root-ca-file={}", self.pki.ca().display()))
        .args(["--use-service-account-credentials=true", "--controllers=*"])
        .args([
            "--bind-address=127.0.0.1",
            "--secure-port=0",
            "--leader-elect=false",
        ])
        // Nodes that stop reporting are not evicted from while kubelet restarts in a test.
        .args(["--node-monitor-grace-period=120s"]);
        self.kcm = Some(Proc::spawn_in(
            self.opts.netns.as_deref(),
            "kube-controller-manager",
            &mut cmd,
            &logs,
            &pids,
        )?);
        let mut cmd = Command::new(self.k8s_bin.join("kube-scheduler"));
        for flag in [
            "--kubeconfig",
            "--authentication-kubeconfig",
            "--authorization-kubeconfig",
        ] {
            cmd.arg(format!("{flag}={}", sched.display()));
        }
        cmd.args([
            "--bind-address=127.0.0.1",
            &format!("--secure-port={}", self.opts.scheduler_port),
            "--leader-elect=false",
        ]);
        if self.opts.scheduler_port != 0 {
            // /debug/pprof: the bench's scheduler profiled (`go tool pprof`) without credentials.
            cmd.arg("--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics,/debug/pprof/*");
        }
        self.sched = Some(Proc::spawn_in(
            self.opts.netns.as_deref(),
            "kube-scheduler",
            &mut cmd,
            &logs,
            &pids,
        )?);
        Ok(())
    }

    /// The API server's URL for clients in this process's network namespace (the tests, kubectl,
    /// helm): a port of `127.0.0.1` forwarded into [`ControlPlaneOpts::netns`] when there is
    /// one.
    pub fn server(&self) -> String {
        match &self.forward {
            Some(f) => format!("https://127.0.0.1:{}", f.port()),
            None => self.internal_server(),
        }
    }

    /// The API server's URL for the cluster's own processes, in its network namespace (the
    /// controllers, kubelet): its own address.
    pub fn internal_server(&self) -> String {
        format!("https://{}:{}", self.opts.bind_ip, self.port)
    }

    /// The network namespace the control plane runs in, when not this process's.
    pub fn netns(&self) -> Option<&Arc<NetNs>> {
        self.opts.netns.as_ref()
    }

    /// The cluster-admin kubeconfig.
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin
    }

    /// The CA every component trusts.
    pub fn pki(&self) -> &Pki {
        &self.pki
    }

    /// A kubeconfig for user `user` in `groups` (a client certificate): for clients the tests
    /// run outside pods under a given RBAC (`system:serviceaccount:NS:NAME` with group
    /// `system:serviceaccounts` is a service account to RBAC).
    pub fn kubeconfig_for(&self, file: &str, user: &str, groups: &[&str]) -> Result<PathBuf> {
        let cert = self.pki.sign(file, user, groups, &[])?;
        self.pki.kubeconfig(
            &self.dir.join(format!("{file}.kubeconfig")),
            &self.server(),
            &cert,
        )
    }

    /// The audit log: one JSON line per request (level Metadata).
    pub fn audit_log(&self) -> PathBuf {
        self.dir.join("logs").join("audit.log")
    }

    /// The requests user `user` made, in order, as the audit log has them: one entry each, its
    /// first (a watch shows when it started, long before it completes).
    pub fn requests_of(&self, user: &str) -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(self.audit_log()).unwrap_or_default();
        let mut seen = std::collections::HashSet::new();
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|e| e["user"]["username"] == user)
            .filter(|e| seen.insert(e["auditID"].as_str().unwrap_or_default().to_string()))
            .collect()
    }

    /// The processes, for logs on failure.
    pub fn procs(&self) -> Vec<&Proc> {
        [
            self.apiserver.as_ref(),
            self.kcm.as_ref(),
            self.sched.as_ref(),
            Some(&self.etcd),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// Runs the cluster-admin `kubectl` with `args`.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        run(Command::new(&self.kubectl)
            .arg("--kubeconfig")
            .arg(&self.admin)
            .args(args))
    }

    /// Signs a certificate with the cluster's CA (a kubelet's, say).
    pub fn sign(&self, name: &str, cn: &str, orgs: &[&str], sans: &[String]) -> Result<Cert> {
        self.pki.sign(name, cn, orgs, sans)
    }
}

impl ControlPlane {
    /// Stops every process and removes etcd's data (also on drop).
    pub fn shutdown(&mut self) {
        for p in [
            self.sched.as_mut(),
            self.kcm.as_mut(),
            self.apiserver.as_mut(),
        ]
        .into_iter()
        .flatten()
        {
            p.stop(Duration::from_secs(5));
        }
        self.etcd.stop(Duration::from_secs(5));
        self.forward = None;
        if let Ok(data) = std::fs::read_to_string(self.dir.join("etcd-data"))
            && data.starts_with("/dev/shm/")
        {
            let _ = std::fs::remove_dir_all(data);
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Whether `ip` is a loopback address (`127.0.0.0/8`, `::1`).
fn is_loopback(ip: &str) -> bool {
    ip.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The first host address of an IPv4 CIDR (`10.96.0.0/24` → `10.96.0.1`).
pub fn first_ip(cidr: &str) -> Result<String> {
    let net = cidr.split('/').next().unwrap_or_default();
    let mut octets: Vec<u8> = net.split('.').filter_map(|o| o.parse().ok()).collect();
    if octets.len() != 4 {
        bail!("not an IPv4 CIDR: {cidr}");
    }
    octets[3] = octets[3].saturating_add(1);
    Ok(octets
        .iter()
        .map(u8::to_string)
        .collect::<Vec<_>>()
        .join("."))
}
