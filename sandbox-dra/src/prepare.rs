//! Preparing and unpreparing claims: the allocated GPU and its whole IOMMU group on a VFIO
//! driver, a CDI spec naming its device nodes, and the device-metadata file KubeVirt reads.

use std::fmt;

/// One claim kubelet names: namespace, name and UID of the ResourceClaim.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClaimRef {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// The claim's UID.
    pub uid: String,
}

impl fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{} ({})", self.namespace, self.name, self.uid)
    }
}

/// A device prepared for a claim, as kubelet is told about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedDevice {
    /// The claim's requests it serves.
    pub requests: Vec<String>,
    /// Its pool (the node's).
    pub pool: String,
    /// Its name in the pool.
    pub device: String,
    /// The CDI device ids the runtime injects.
    pub cdi_ids: Vec<String>,
}

/// Why a claim was not prepared or unprepared.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// Preparing is not built yet.
    #[error("claim {0}: preparing devices is not built yet")]
    NotBuilt(ClaimRef),
}

/// Prepares and unprepares the claims of this node.
#[derive(Debug, Default)]
pub struct Preparer {}

impl Preparer {
    /// Prepares `claim`: idempotent, kubelet calls again after a failure or a restart.
    pub async fn prepare(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, PrepareError> {
        Err(PrepareError::NotBuilt(claim.clone()))
    }

    /// Unprepares `claim`: idempotent, a claim never prepared is already unprepared.
    pub async fn unprepare(&self, claim: &ClaimRef) -> Result<(), PrepareError> {
        Err(PrepareError::NotBuilt(claim.clone()))
    }
}
