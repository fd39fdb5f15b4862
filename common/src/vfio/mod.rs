//! Binding a GPU's IOMMU group to VFIO and giving it back: what vfio-manager does for the node
//! and sandbox-dra for one claim.
//!
//! [`select::select`] decides, from an [`Inventory`], which functions move (each selected GPU
//! with the other endpoint functions of its IOMMU group) and to which driver (`vfio-pci`, or
//! the variant VFIO driver the kernel's `modules.alias` names: [`alias`]); [`bind::bind_all`]
//! and [`bind::unbind_all`] make the writes through [`crate::Sysfs`], one worker per group, and
//! say what became of each function ([`DeviceResult`]). The driver each function had before
//! the first bind is kept in [`crate::state::originals`], written before the bind, so that
//! giving it back returns it to `nouveau` or to no driver at all rather than to whichever
//! driver probes first.

pub mod alias;
pub mod bind;
pub mod select;

use serde::Serialize;

use crate::{HostPaths, Inventory, PciAddress, Usage, Use, error_chain};

pub use alias::AliasTable;
pub use bind::{OpOptions, bind_all, unbind_all};
pub use select::{BadDeviceId, DeviceId, Refusal, Selection, Selector, Target, select};

/// What happened to one function.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "result", rename_all = "lowercase")]
pub enum Outcome {
    /// Moved from one driver to another (`None`: no driver).
    Changed {
        /// The driver before.
        from: Option<String>,
        /// The driver after.
        to: Option<String>,
    },
    /// Already where it should be; nothing was written.
    Unchanged {
        /// Its driver.
        driver: Option<String>,
    },
    /// The operation failed; the sentence names the device and the file.
    Failed {
        /// Why.
        error: String,
    },
    /// Not attempted.
    Refused {
        /// Why.
        reason: String,
    },
}

/// One function's result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceResult {
    /// The function.
    pub address: PciAddress,
    /// Its IOMMU group.
    pub group: Option<u32>,
    /// What happened.
    #[serde(flatten)]
    pub outcome: Outcome,
}

impl DeviceResult {
    /// Failed or refused.
    pub fn is_failure(&self) -> bool {
        matches!(
            self.outcome,
            Outcome::Failed { .. } | Outcome::Refused { .. }
        )
    }

    /// The sentence of a failure or refusal, naming the function; `None` otherwise.
    pub fn failure(&self) -> Option<String> {
        match &self.outcome {
            Outcome::Failed { error } => Some(format!("{}: {error}", self.address)),
            Outcome::Refused { reason } => Some(reason.clone()),
            _ => None,
        }
    }
}

/// The `modules.alias` of the running kernel; empty (everything on `vfio-pci`) when there is
/// none to read.
pub fn load_aliases(paths: &HostPaths) -> AliasTable {
    match paths.read_modules_alias() {
        Ok(text) => AliasTable::parse(&text),
        Err(e) => {
            tracing::debug!(error = %error_chain(&e), "no modules.alias; using vfio-pci for every device");
            AliasTable::default()
        }
    }
}

/// Who would lose something if `t` left its driver for its VFIO driver: processes holding its
/// `/dev/nvidia<N>` or group (on nvidia an unbind then hangs until they exit), and whoever uses
/// its VFs and vGPUs (an unbind from nvidia destroys them), or unknown where a source cannot be
/// read. A pod kubelet gave the function itself to needs it on VFIO and does not count.
pub fn bind_blockers(usage: &Usage, inv: &Inventory, t: &Target) -> Vec<Use> {
    usage.of_gpu_for_passthrough(inv, &t.address)
}
