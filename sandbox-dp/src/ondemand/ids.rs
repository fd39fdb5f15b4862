//! Device IDs of the pool's slots: `<member>-<type>-<slot>` (`0000:41:00.0-A10-4Q-0`,
//! `mtty-mtty-2-0`): a GPU's type by the last word of its name, a parent's by its sysfs id.

use common::PciAddress;
use common::vgpu::lifecycle::Member;

use super::{Pool, Selector};

/// `NVIDIA A10-4Q` → `A10-4Q`.
pub(super) fn type_key(name: &str) -> &str {
    name.split_whitespace().last().unwrap_or(name)
}

/// `0000:41:00.0-A10-4Q-3`, `mtty-mtty-2-0`: `key` is a GPU's type by the last word of its
/// name, a parent's by its sysfs id.
pub fn device_id(member: &Member, key: &str, slot: u32) -> String {
    format!("{member}-{key}-{slot}")
}

/// The slot number of `id` when it is one of `member`'s slots of type `key`.
pub(super) fn slot_of(id: &str, member: &Member, key: &str) -> Option<u32> {
    id.strip_prefix(&format!("{member}-{key}-"))?.parse().ok()
}

/// The GPU and type key of a device ID.
fn parse_device_id(id: &str) -> Option<(PciAddress, &str)> {
    let gpu = id.get(..12)?.parse().ok()?;
    let rest = id.get(13..)?;
    let (key, slot) = rest.rsplit_once('-')?;
    slot.parse::<u32>().ok()?;
    Some((gpu, key))
}

impl Pool {
    /// The member and type key a device ID names: a GPU's (`0000:41:00.0-A10-4Q-0`) or a
    /// listed parent's (`mtty-mtty-2-0`; the longest listed name that fits).
    pub(super) fn parse_id<'a>(&self, id: &'a str) -> Option<(Member, &'a str)> {
        if let Some((gpu, key)) = parse_device_id(id) {
            return Some((Member::Gpu(gpu), key));
        }
        let Selector::Listed { parents, .. } = &self.selector else {
            return None;
        };
        parents
            .iter()
            .filter_map(|p| {
                let rest = id.strip_prefix(p.as_str())?.strip_prefix('-')?;
                let (key, slot) = rest.rsplit_once('-')?;
                slot.parse::<u32>().ok()?;
                (!key.is_empty()).then_some((p, key))
            })
            .max_by_key(|(p, _)| p.len())
            .map(|(p, key)| (Member::Parent(p.clone()), key))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use common::HostPaths;

    use super::*;
    use crate::ondemand::parse_selector;

    #[test]
    fn device_ids() {
        let a: PciAddress = "0000:41:00.0".parse().unwrap();
        let id = device_id(&Member::Gpu(a), type_key("NVIDIA A10-4Q"), 3);
        assert_eq!(id, "0000:41:00.0-A10-4Q-3");
        assert_eq!(parse_device_id(&id), Some((a, "A10-4Q")));
        assert_eq!(
            parse_device_id("0000:18:00.0-H100XM-1-10C-0"),
            Some(("0000:18:00.0".parse().unwrap(), "H100XM-1-10C"))
        );
        assert_eq!(
            parse_device_id("5a3b2c1d-0000-4000-8000-00000000abcd"),
            None
        );
    }

    #[test]
    fn mdev_parents_are_named_and_their_ids_parse_by_the_listed_names() {
        let sel = parse_selector("mtty, 0000:41:00.0,mtty-x").unwrap();
        assert_eq!(
            sel,
            Selector::Listed {
                gpus: ["0000:41:00.0".parse().unwrap()].into(),
                parents: ["mtty".to_string(), "mtty-x".to_string()].into(),
            }
        );
        let pool = Pool::new(
            HostPaths::new("/nonexistent-root"),
            sel,
            None,
            Duration::from_secs(1),
            Default::default(),
        )
        .unwrap();
        let mtty = Member::Parent("mtty".into());
        let id = device_id(&mtty, "mtty-2", 0);
        assert_eq!(id, "mtty-mtty-2-0");
        assert_eq!(pool.parse_id(&id), Some((mtty.clone(), "mtty-2")));
        // The longest listed name that fits.
        assert_eq!(
            pool.parse_id("mtty-x-mtty-1-4"),
            Some((Member::Parent("mtty-x".into()), "mtty-1"))
        );
        assert_eq!(pool.parse_id("mbochs-mbochs-small-0"), None);
        assert_eq!(pool.parse_id("mtty-mtty-2-x"), None);
        assert_eq!(slot_of("mtty-mtty-2-7", &mtty, "mtty-2"), Some(7));
        assert_eq!(slot_of("mtty-mtty-2-7", &mtty, "mtty-1"), None);
    }
}
