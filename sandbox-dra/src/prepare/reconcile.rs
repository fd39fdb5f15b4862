//! At start: every claim record brought back in line with the node.

use common::error_chain;

use super::{ClaimRef, Node, OnUnprepare, Steps, Wanted};
use crate::record::{self, ClaimState};

impl Node {
    pub(super) fn reconcile(&self) {
        for p in record::list(&self.driver_dir()) {
            let rec = match record::load_path(&p) {
                Ok(Some(r)) => r,
                Ok(None) => continue,
                Err(e @ record::RecordError::Unreadable { .. }) => {
                    self.set_aside(&p, &e);
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %error_chain(&e), "skipping a record that cannot be read now");
                    continue;
                }
            };
            let claim = ClaimRef {
                namespace: rec.claim.namespace.clone(),
                name: rec.claim.name.clone(),
                uid: rec.claim.uid.clone(),
            };
            if p != record::path(&self.driver_dir(), &claim.uid) {
                tracing::warn!(path = %p.display(), "skipping a record whose name is not its claim's UID");
                continue;
            }
            if let Err(e) = self.migrate(&claim, &p, &rec) {
                tracing::warn!(%claim, error = %error_chain(&e), "claim left for kubelet's next call");
                continue;
            }
            let outcome = match rec.state {
                ClaimState::Prepared => {
                    let wanted = rec.devices.iter().map(Wanted::from).collect();
                    self.prepare(
                        &claim,
                        rec.claim.clone(),
                        wanted,
                        Some(rec),
                        &mut Steps::start(),
                    )
                    .map(|_| "prepared again")
                }
                // Its devices never reached a container: undone whatever the policy.
                ClaimState::Preparing => self
                    .unprepare(&claim, Some(rec), OnUnprepare::Restore)
                    .map(|()| "unfinished prepare undone"),
                ClaimState::Unpreparing => self
                    .unprepare(&claim, Some(rec), self.config.on_unprepare)
                    .map(|()| "unfinished unprepare finished"),
            };
            match outcome {
                Ok(what) => tracing::info!(%claim, "{what}"),
                Err(e) => {
                    tracing::warn!(%claim, error = %error_chain(&e), "claim left for kubelet's next call")
                }
            }
        }
    }
}
