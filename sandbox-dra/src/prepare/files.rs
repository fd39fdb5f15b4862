//! The files a prepared claim leaves for others: the device-metadata files KubeVirt's
//! virt-launcher reads and the CDI spec the container runtime reads, both readable by users
//! other than root, written only when they differ and removed by unprepare.

use std::path::Path;

use common::state;

use super::{ClaimRef, Node, PrepareError, check_id};
use crate::cdi;
use crate::record::Record;

impl Node {
    /// The metadata files, then the CDI spec that mounts them.
    pub(super) fn write_files(&self, claim: &ClaimRef, rec: &Record) -> Result<(), PrepareError> {
        check_id(claim, rec)?;
        let layout = &self.config.layout;
        let top = self.local(&layout.metadata_dir(&rec.claim));
        for r in cdi::requests_of(&rec.devices) {
            let host = layout.metadata_file(&rec.claim, &r);
            let local = self.local(&host);
            let err = || format!("cannot write its device metadata {}", host.display());
            // The generation of what is there: kept when nothing changed, one more when it did.
            let now = state::read_if_present(&local)
                .map_err(Self::state_err(claim, err()))?
                .unwrap_or_default();
            let was = cdi::stream_generation(&now);
            let mut generation = was.unwrap_or(1);
            let mut stream = layout.metadata_stream(&rec.claim, &r, &rec.devices, generation);
            if was.is_some() && now.as_bytes() != stream {
                generation += 1;
                stream = layout.metadata_stream(&rec.claim, &r, &rec.devices, generation);
            }
            write_shared(&local, Some(&top), stream).map_err(Self::state_err(claim, err()))?;
            let host = layout.legacy_metadata_file(&rec.claim, &r);
            let plain = layout.metadata_json(
                &rec.claim,
                &r,
                &rec.devices,
                cdi::LEGACY_METADATA_API_VERSION,
                generation,
            );
            write_json(&self.local(&host), Some(&top), &plain).map_err(Self::state_err(
                claim,
                format!("cannot write its device metadata {}", host.display()),
            ))?;
        }
        let host = layout.cdi_spec(&claim.uid);
        let json = layout.cdi_spec_json(&rec.claim, &rec.devices);
        // The CDI directory is the runtime's: only the file's own mode is set.
        write_json(&self.local(&host), None, &json).map_err(Self::state_err(
            claim,
            format!("cannot write its CDI spec {}", host.display()),
        ))?;
        Ok(())
    }

    /// Removes the claim's CDI spec and device metadata, where they are: the metadata named
    /// by its record, or by the claim kubelet names when it has none (never prepared, or its
    /// record could not be read and was set aside).
    pub(super) fn remove_files(
        &self,
        claim: &ClaimRef,
        rec: Option<&Record>,
    ) -> Result<(), PrepareError> {
        if let Some(rec) = rec {
            check_id(claim, rec)?;
        }
        let layout = &self.config.layout;
        let spec = layout.cdi_spec(&claim.uid);
        state::remove_if_present(&self.local(&spec)).map_err(Self::state_err(
            claim,
            format!("cannot remove its CDI spec {}", spec.display()),
        ))?;
        let id = rec.map_or_else(|| claim.id(), |r| r.claim.clone());
        let dir = layout.metadata_dir(&id);
        match std::fs::remove_dir_all(self.local(&dir)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(PrepareError::State {
                    claim: claim.clone(),
                    what: format!("cannot remove its device metadata {}", dir.display()),
                    source: Box::new(e),
                });
            }
        }
        Ok(())
    }
}

/// The mode of the files the container runtime and the VM's pod read: the metadata file is
/// read inside the container by virt-launcher, which runs as a user of its own (`qemu`).
const SHARED_FILE_MODE: u32 = 0o644;

/// The mode of the directories holding them.
const SHARED_DIR_MODE: u32 = 0o755;

/// Writes `v` to `p` with [`SHARED_FILE_MODE`] unless `p` holds exactly that already; the
/// directories from `top` (the driver's own) down to `p`'s get [`SHARED_DIR_MODE`] (a umask of
/// 077 would make them 0700).
fn write_json(
    p: &Path,
    top: Option<&Path>,
    v: &serde_json::Value,
) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
    let mut bytes = serde_json::to_vec_pretty(v)?;
    bytes.push(b'\n');
    write_shared(p, top, bytes)
}

/// Writes `bytes` to `p` as [`write_json`] does.
fn write_shared(
    p: &Path,
    top: Option<&Path>,
    bytes: Vec<u8>,
) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
    use std::os::unix::fs::PermissionsExt as _;
    let mode = |p: &Path| std::fs::metadata(p).map(|m| m.permissions().mode() & 0o7777);
    if let Ok(Some(now)) = state::read_if_present(p)
        && now.as_bytes() == bytes
        && mode(p).ok() == Some(SHARED_FILE_MODE)
    {
        return Ok(false);
    }
    if let Some(dir) = p.parent() {
        state::ensure_dir(dir)?;
        let ours = dir
            .ancestors()
            .take_while(|d| top.is_some_and(|t| d.starts_with(t)));
        for d in ours {
            if mode(d).ok() != Some(SHARED_DIR_MODE) {
                std::fs::set_permissions(d, std::fs::Permissions::from_mode(SHARED_DIR_MODE))
                    .map_err(|source| common::Error::Save {
                        path: d.to_path_buf(),
                        source,
                    })?;
            }
        }
    }
    // Written again by the prepare kubelet makes after a reboot: not flushed to disk.
    state::write_atomic_mode(p, &bytes, SHARED_FILE_MODE, state::Flush::No)?;
    Ok(true)
}
