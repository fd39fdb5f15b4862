//! Unpreparing a claim: the record marked, the files removed, its vGPUs and mdevs destroyed,
//! its GPUs kept on VFIO or given back ([`OnUnprepare`]), the record removed last.

use common::state;

use super::{ClaimRef, Node, OnUnprepare, PrepareError};
use crate::record::{self, ClaimState, Record};

impl Node {
    pub(super) fn unprepare(
        &self,
        claim: &ClaimRef,
        rec: Option<Record>,
        policy: OnUnprepare,
    ) -> Result<(), PrepareError> {
        let Some(mut rec) = rec else {
            // Nothing was prepared, or its record could not be read (set aside): the files a
            // prepare writes are removed all the same, so the container runtime is left
            // nothing that names the claim.
            self.remove_files(claim, None)?;
            tracing::debug!(%claim, "not prepared here; nothing to do");
            return Ok(());
        };
        // Marked first, so that a restart finishes the unprepare rather than preparing again.
        let p = record::path(&self.driver_dir(), &claim.uid);
        if rec.state == ClaimState::Prepared {
            rec.state = ClaimState::Unpreparing;
            self.save(claim, &p, &rec)?;
        }
        self.remove_files(claim, Some(&rec))?;
        self.destroy_vgpus(claim, &rec)?;
        self.destroy_mdevs(claim, &rec)?;
        if policy == OnUnprepare::Restore {
            self.restore(claim, &rec)?;
        }
        state::remove_if_present(&p).map_err(Self::state_err(
            claim,
            format!("cannot remove its record {}", p.display()),
        ))?;
        tracing::info!(%claim, ?policy, "unprepared");
        Ok(())
    }
}
