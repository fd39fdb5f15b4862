//! Which GPUs and mdev parents a daemon takes for vGPUs made on demand: `all`, or a comma list
//! of GPU PCI addresses and non-PCI mdev parents (`mtty`). sandbox-dp's `--on-demand` and
//! sandbox-dra's `--vgpu` take it.

use std::collections::BTreeSet;

use crate::PciAddress;
pub use crate::paths::is_parent_name;

/// `all`, or the GPUs and mdev parents listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selector {
    /// Every GPU the daemon can make vGPUs on (each daemon says which).
    All,
    /// These GPUs, and these mdev parents that are not PCI functions, by their name under
    /// `<sys>/class/mdev_bus/`.
    Listed {
        /// GPUs, by PCI address.
        gpus: BTreeSet<PciAddress>,
        /// Other mdev parents (`mtty`).
        parents: BTreeSet<String>,
    },
}

impl Selector {
    /// Nothing selected.
    pub fn none() -> Selector {
        Selector::Listed {
            gpus: BTreeSet::new(),
            parents: BTreeSet::new(),
        }
    }
}

/// A selector that is neither `all` nor a list of GPUs and mdev parents.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadSelector {
    /// An entry names neither.
    #[error(
        "{0:?} is neither a PCI address (0000:41:00.0) nor an mdev parent's name (mtty: \
         letters, digits, -, _ and .); \"all\" stands alone"
    )]
    Entry(String),
    /// Nothing is named.
    #[error("expected \"all\" or a comma list of GPU PCI addresses and mdev parents")]
    Empty,
    /// A parent's name does not fit where the daemon uses it.
    #[error("mdev parent {name:?} {why}")]
    Parent {
        /// The parent.
        name: String,
        /// What it cannot be.
        why: &'static str,
    },
}

/// Parses `all`, or a comma list of GPU PCI addresses (`0000:41:00.0`) and non-PCI mdev
/// parents (`mtty`); spaces around entries and empty entries are ignored.
pub fn parse_selector(s: &str) -> Result<Selector, BadSelector> {
    if s.trim() == "all" {
        return Ok(Selector::All);
    }
    let (mut gpus, mut parents) = (BTreeSet::new(), BTreeSet::new());
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if let Ok(a) = part.parse::<PciAddress>() {
            gpus.insert(a);
        } else if part != "all" && is_parent_name(part) {
            parents.insert(part.to_string());
        } else {
            return Err(BadSelector::Entry(part.to_string()));
        }
    }
    if gpus.is_empty() && parents.is_empty() {
        return Err(BadSelector::Empty);
    }
    Ok(Selector::Listed { gpus, parents })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> PciAddress {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e:?}"))
    }

    #[test]
    fn all_addresses_and_parents() {
        assert_eq!(parse_selector(" all "), Ok(Selector::All));
        assert_eq!(
            parse_selector("0000:41:00.0, 0000:61:00.0,"),
            Ok(Selector::Listed {
                gpus: [addr("0000:41:00.0"), addr("0000:61:00.0")].into(),
                parents: BTreeSet::new(),
            })
        );
        assert_eq!(
            parse_selector("mtty, 0000:41:00.0,mtty-x,mdev_1.0"),
            Ok(Selector::Listed {
                gpus: [addr("0000:41:00.0")].into(),
                parents: ["mtty", "mtty-x", "mdev_1.0"].map(String::from).into(),
            })
        );
    }

    #[test]
    fn what_names_neither_is_refused_naming_the_entry() {
        for bad in ["0000:41:00", "../mtty", "GPU 0", "..", "mtty,all", "a/b"] {
            let e = parse_selector(bad).expect_err(bad).to_string();
            let entry = bad.split(',').next_back().unwrap_or(bad);
            assert!(e.contains(&format!("{entry:?}")), "{bad}: {e}");
        }
        for empty in ["", ",", " , "] {
            assert!(
                parse_selector(empty)
                    .unwrap_err()
                    .to_string()
                    .contains("expected"),
                "{empty:?}"
            );
        }
    }
}
