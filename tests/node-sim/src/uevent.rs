//! Uevents for kernel-like changes (filled in below).

use crate::state::Uevent;

/// Broadcasts uevents.
#[derive(Debug)]
pub(crate) struct UeventSender {}

impl UeventSender {
    pub fn new() -> Option<UeventSender> {
        None
    }
}

impl UeventSender {
    pub fn send(&self, _e: &Uevent) {}
}
