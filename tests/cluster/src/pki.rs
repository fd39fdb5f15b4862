//! The cluster's certificates and kubeconfigs, made with the `openssl` command (ECDSA P-256
//! keys: quick to generate, accepted by every component).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::proc::run;

/// A certificate authority in a directory, and what it signed.
#[derive(Debug, Clone)]
pub struct Pki {
    dir: PathBuf,
}

/// A signed certificate and its key.
#[derive(Debug, Clone)]
pub struct Cert {
    /// The certificate (PEM).
    pub crt: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
}

impl Pki {
    /// A new CA, and the service-account signing key pair, in `dir`.
    pub fn new(dir: &Path) -> Result<Pki> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let pki = Pki {
            dir: dir.to_path_buf(),
        };
        pki.key("ca")?;
        run(Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-new",
                "-days",
                "3",
                "-subj",
                "/CN=gpu-vm-node-test-ca",
            ])
            .arg("-key")
            .arg(dir.join("ca.key"))
            .arg("-out")
            .arg(dir.join("ca.crt")))?;
        pki.key("sa")?;
        run(Command::new("openssl")
            .args(["pkey", "-pubout"])
            .arg("-in")
            .arg(dir.join("sa.key"))
            .arg("-out")
            .arg(dir.join("sa.pub")))?;
        Ok(pki)
    }

    fn key(&self, name: &str) -> Result<PathBuf> {
        let key = self.dir.join(format!("{name}.key"));
        run(Command::new("openssl")
            .args([
                "genpkey",
                "-algorithm",
                "EC",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
            ])
            .arg("-out")
            .arg(&key))?;
        Ok(key)
    }

    /// The CA certificate.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// The CA's key.
    pub fn ca_key(&self) -> PathBuf {
        self.dir.join("ca.key")
    }

    /// The service-account signing key.
    pub fn sa_key(&self) -> PathBuf {
        self.dir.join("sa.key")
    }

    /// The service-account verification key.
    pub fn sa_pub(&self) -> PathBuf {
        self.dir.join("sa.pub")
    }

    /// A certificate for `cn` in groups `orgs`, for clients and, with `sans`
    /// (`IP:…`, `DNS:…`), for serving.
    pub fn sign(&self, name: &str, cn: &str, orgs: &[&str], sans: &[String]) -> Result<Cert> {
        let key = self.key(name)?;
        let csr = self.dir.join(format!("{name}.csr"));
        let mut subj = format!("/CN={cn}");
        for o in orgs {
            subj.push_str(&format!("/O={o}"));
        }
        run(Command::new("openssl")
            .args(["req", "-new", "-subj", &subj])
            .arg("-key")
            .arg(&key)
            .arg("-out")
            .arg(&csr))?;
        let ext = self.dir.join(format!("{name}.ext"));
        let mut text =
            String::from("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n");
        if sans.is_empty() {
            text.push_str("extendedKeyUsage=clientAuth\n");
        } else {
            text.push_str(&format!(
                "subjectAltName={}\nextendedKeyUsage=serverAuth,clientAuth\n",
                sans.join(",")
            ));
        }
        std::fs::write(&ext, text).with_context(|| format!("writing {}", ext.display()))?;
        let crt = self.dir.join(format!("{name}.crt"));
        run(Command::new("openssl")
            .args(["x509", "-req", "-days", "3", "-CAcreateserial"])
            .arg("-in")
            .arg(&csr)
            .arg("-CA")
            .arg(self.ca())
            .arg("-CAkey")
            .arg(self.ca_key())
            .arg("-extfile")
            .arg(&ext)
            .arg("-out")
            .arg(&crt))?;
        Ok(Cert { crt, key })
    }

    /// A kubeconfig at `path` for `server`, authenticating with `cert`.
    pub fn kubeconfig(&self, path: &Path, server: &str, cert: &Cert) -> Result<PathBuf> {
        let text = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": self.ca()}}],
            "users": [{"name": "test", "user": {"client-certificate": cert.crt, "client-key": cert.key}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
            "current-context": "test",
        });
        std::fs::write(path, text.to_string())
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(path.to_path_buf())
    }
}
