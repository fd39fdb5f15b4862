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
            // Nothing was prepared: at most a spec a crash left (none does: the record is the
            // first thing written and the last removed).
            self.remove_files(claim, None)?;
            tracing::debug!(%claim, "not prepared here; nothing to do");
            return Ok(());
        };
        // Marked first, so that a restart finishes the unprepare rather than preparing again.
        let p = record::path(&self.driver_dir(), &claim.uid);
        if rec.state == ClaimState::Prepared {
            rec.state = ClaimState::Unpreparing;
            record::write_if_changed(&p, &rec.to_bytes())
                .map_err(Self::state_err(claim, "cannot save its record".into()))?;
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
