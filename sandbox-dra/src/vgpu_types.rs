//! Which vGPU types a pooled GPU publishes (`--vgpu-types`): every type of its model (`all`,
//! the default), or those a comma list names: type names as NVIDIA writes them without the
//! first word (`A10-4Q` for `NVIDIA A10-4Q`), or patterns with `*` (`A10-*Q`: every Q size of
//! the A10; `*-8Q`: the 8 GiB Q type of every model), compared without regard to case.
//!
//! A GPU's types are those the driver can publish for it ([`Model::types_before_vfs`], the
//! vGPU model table every daemon plans with). An entry that is a type of no model the table
//! knows is refused at start, naming the entry and the types of the node's pooled GPUs: a
//! typo would otherwise publish nothing and say nothing. An entry that is another model's type
//! (`L40S-8Q` on a node of A10s) is accepted and matches nothing here, so one setting serves a
//! cluster of several GPU models.

use std::collections::BTreeMap;

use common::vgpu::models::{MODELS, Model};
use common::{Inventory, PciAddress};

/// Which vGPU types a pooled GPU publishes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Types {
    /// Every type of its model.
    #[default]
    All,
    /// Those matching one of these names or patterns (upper-case, without the first word).
    Listed(Vec<String>),
}

/// Why `--vgpu-types` is refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum TypesError {
    /// An entry that cannot be a type name or pattern.
    #[error(
        "{0:?} is not a vGPU type name (A10-4Q) or pattern (A10-*Q, *-8Q): letters, digits, - and *"
    )]
    NotAName(String),
    /// `all` beside other entries.
    #[error("\"all\" stands alone")]
    AllAlone,
    /// Nothing given.
    #[error("expected \"all\" or a comma list of vGPU types (A10-4Q,A10-8Q)")]
    Empty,
    /// Entries that are no model's type, and what the node's GPUs publish.
    #[error("--vgpu-types: {} {} no vGPU type: {theirs}", quoted(.unknown), if .unknown.len() == 1 { "is" } else { "are" })]
    Unknown {
        unknown: Vec<String>,
        theirs: String,
    },
}

fn quoted(entries: &[String]) -> String {
    entries
        .iter()
        .map(|u| format!("{u:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses `--vgpu-types`: `all`, or a comma list of type names and `*` patterns; the first
/// word of NVIDIA's full name (`NVIDIA A10-4Q`, `GRID T4-2Q`) may be given too. Spaces around
/// entries and empty entries are ignored.
pub fn parse(s: &str) -> Result<Types, TypesError> {
    if s.trim().eq_ignore_ascii_case("all") {
        return Ok(Types::All);
    }
    let mut out = Vec::new();
    for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let short = entry.split_whitespace().last().unwrap_or_default();
        let fits = short
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'*');
        if !fits || entry.split_whitespace().count() > 2 {
            return Err(TypesError::NotAName(entry.to_string()));
        }
        if entry.eq_ignore_ascii_case("all") {
            return Err(TypesError::AllAlone);
        }
        out.push(short.to_ascii_uppercase());
    }
    if out.is_empty() {
        return Err(TypesError::Empty);
    }
    out.dedup();
    Ok(Types::Listed(out))
}

/// Whether `text` matches `pattern`, whose `*` stands for any run of characters (none too).
fn glob(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty(); // no `*`: the whole text
    };
    for p in middle {
        match rest.find(p) {
            Some(i) => rest = &rest[i + p.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// The short name of a type (`A10-4Q` for `NVIDIA A10-4Q`), upper-case.
fn short(type_name: &str) -> String {
    type_name
        .split_whitespace()
        .last()
        .unwrap_or_default()
        .to_ascii_uppercase()
}

/// A model's publishable types, by short name (`A10-4Q`).
fn names_of(m: &Model) -> Vec<String> {
    m.types_before_vfs()
        .into_iter()
        .map(|(n, _)| short(&n))
        .collect()
}

impl Types {
    /// Whether a GPU publishes type `type_name` (`NVIDIA A10-4Q`, or `A10-4Q`).
    pub fn publishes(&self, type_name: &str) -> bool {
        match self {
            Types::All => true,
            Types::Listed(l) => {
                let s = short(type_name);
                l.iter().any(|p| glob(p, &s))
            }
        }
    }

    /// Whether a GPU of model `m` publishes any vGPU.
    pub fn publishes_any(&self, m: &Model) -> bool {
        names_of(m).iter().any(|t| self.publishes(t))
    }

    /// The entries that match no type of any model the vGPU table knows.
    pub fn unknown(&self) -> Vec<&str> {
        let Types::Listed(l) = self else {
            return Vec::new();
        };
        let all: Vec<String> = MODELS.iter().flat_map(names_of).collect();
        l.iter()
            .filter(|p| !all.iter().any(|t| glob(p, t)))
            .map(String::as_str)
            .collect()
    }

    /// Refuses entries that are no model's type, naming them and the types of `gpus` (the
    /// GPUs `--vgpu` selects on this node, read from `inv`), or every model's when none of
    /// them is known to the table.
    pub fn check(&self, inv: &Inventory, gpus: &[PciAddress]) -> Result<(), TypesError> {
        let unknown = self.unknown();
        if unknown.is_empty() {
            return Ok(());
        }
        // The node's GPUs by model, in address order.
        let mut by_model: BTreeMap<u16, (Vec<String>, &Model)> = BTreeMap::new();
        for a in gpus {
            let Some(d) = inv.device(a) else { continue };
            if let Some(m) = common::vgpu::models::model(d.vendor, d.device) {
                by_model
                    .entry(m.device)
                    .or_insert_with(|| (Vec::new(), m))
                    .0
                    .push(a.to_string());
            }
        }
        let theirs = if by_model.is_empty() {
            let models: Vec<String> = MODELS.iter().map(|m| m.prefixes.join("/")).collect();
            format!(
                "no type of any GPU model the vGPU table knows ({}); this node has no such GPU \
                 for --vgpu",
                models.join(", ")
            )
        } else {
            by_model
                .values()
                .map(|(addrs, m)| {
                    format!(
                        "{} {} ({}) publish{} {}",
                        if addrs.len() == 1 { "GPU" } else { "GPUs" },
                        addrs.join(", "),
                        m.prefixes.join("/"),
                        if addrs.len() == 1 { "es" } else { "" },
                        names_of(m).join(", ")
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        };
        Err(TypesError::Unknown {
            unknown: unknown.into_iter().map(str::to_string).collect(),
            theirs,
        })
    }

    /// For the log: `all`, or the entries joined by commas.
    pub fn describe(&self) -> String {
        match self {
            Types::All => "all".into(),
            Types::Listed(l) => l.join(","),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_parse_as_upper_case_short_names() {
        assert_eq!(parse("all"), Ok(Types::All));
        assert_eq!(parse(" ALL "), Ok(Types::All));
        assert_eq!(
            parse("a10-4q, NVIDIA A10-8Q,,A10-*C"),
            Ok(Types::Listed(vec![
                "A10-4Q".into(),
                "A10-8Q".into(),
                "A10-*C".into()
            ]))
        );
        for bad in ["", " , ", "A10-4Q,all", "A10_4Q", "A10-4Q;A10-8Q", "a b c"] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        assert!(
            parse("A10.4Q")
                .unwrap_err()
                .to_string()
                .contains("\"A10.4Q\"")
        );
    }

    #[test]
    fn patterns_match_whole_names() {
        assert!(glob("A10-4Q", "A10-4Q"));
        assert!(!glob("A10-4Q", "A10-4QX"));
        assert!(!glob("A10-4", "A10-4Q"));
        assert!(glob("A10-*Q", "A10-24Q"));
        assert!(!glob("A10-*Q", "A10-24C"));
        assert!(glob("*-8Q", "L40S-8Q"));
        assert!(glob("*", "T4-1Q"));
        assert!(glob("A*-*Q", "A10-4Q"));
        assert!(!glob("A*-*Q*C", "A10-4Q"));
        assert!(!glob("A10-*4Q", "A10-4"));
    }

    #[test]
    fn a_gpu_publishes_the_listed_types() {
        let t = parse("A10-4Q,a10-8q,*-24C").unwrap();
        assert!(t.publishes("NVIDIA A10-4Q"));
        assert!(t.publishes("NVIDIA A10-8Q"));
        assert!(t.publishes("NVIDIA A10-24C"));
        assert!(!t.publishes("NVIDIA A10-4C"));
        assert!(!t.publishes("NVIDIA A10-2Q"));
        assert!(Types::All.publishes("NVIDIA A10-2Q"));
    }

    #[test]
    fn only_names_of_no_model_are_unknown() {
        let t = parse("A10-4Q,L40S-8Q,A10-5Q,A10-2B,X-*,T4-*").unwrap();
        // B types are left out of what the driver publishes; L40S-8Q is another model's.
        assert_eq!(t.unknown(), ["A10-5Q", "A10-2B", "X-*"]);
        assert!(Types::All.unknown().is_empty());
    }
}
