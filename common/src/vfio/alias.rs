//! Which VFIO driver a device wants, from the kernel's `modules.alias`.
//!
//! Variant VFIO drivers (`nvgrace_gpu_vfio_pci`, `mlx5_vfio_pci`, ...) declare the devices they
//! drive with `alias vfio_pci:v000010DEd00002941sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci` lines. The
//! device's `modalias` reads `pci:v000010DEd00002941sv...`; the part after `pci:` is matched
//! against the part after `vfio_pci:`. When several lines match, the one with the fewest
//! wildcards (the most specific) wins, as the kernel's own `vfio-pci` core does when it picks a
//! variant driver.

/// The generic VFIO PCI driver.
pub const VFIO_PCI: &str = "vfio-pci";

/// The `vfio_pci:` lines of a `modules.alias` file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AliasTable {
    entries: Vec<(String, String)>,
}

impl AliasTable {
    /// Parses `modules.alias` text; lines other than `alias vfio_pci:<pattern> <module>` are
    /// ignored.
    pub fn parse(text: &str) -> Self {
        let entries = text
            .lines()
            .filter_map(|line| {
                let mut words = line.split_whitespace();
                if words.next()? != "alias" {
                    return None;
                }
                let pattern = words.next()?.strip_prefix("vfio_pci:")?;
                let module = words.next()?;
                Some((pattern.to_string(), module.to_string()))
            })
            .collect();
        AliasTable { entries }
    }

    /// The driver for a device with this `modalias` (`pci:v...`), when a line matches. Among
    /// matching lines the one with the fewest wildcards wins; the first such line on a tie.
    pub fn driver_for(&self, modalias: &str) -> Option<String> {
        let subject = modalias.strip_prefix("pci:")?;
        self.entries
            .iter()
            .filter(|(pattern, _)| glob_match(pattern.as_bytes(), subject.as_bytes()))
            .min_by_key(|(pattern, _)| wildcards(pattern))
            .map(|(_, module)| driver_name(module))
    }
}

/// The driver a module registers: `vfio_pci` registers `vfio-pci`; variant drivers register
/// their module name.
fn driver_name(module: &str) -> String {
    if module == "vfio_pci" {
        VFIO_PCI.to_string()
    } else {
        module.to_string()
    }
}

fn wildcards(pattern: &str) -> usize {
    pattern.bytes().filter(|b| matches!(b, b'*' | b'?')).count()
}

/// `fnmatch` with `*` and `?`, the wildcards `modules.alias` uses.
fn glob_match(pattern: &[u8], subject: &[u8]) -> bool {
    let (mut p, mut s) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while s < subject.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, s));
                p += 1;
            }
            Some(&c) if c == b'?' || c == subject[s] => {
                p += 1;
                s += 1;
            }
            _ => match star {
                Some((sp, ss)) => {
                    p = sp + 1;
                    s = ss + 1;
                    star = Some((sp, ss + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: &str = "pci:v000010DEd00002941sv000010DEsd00002046bc03sc02i00";
    const A10: &str = "pci:v000010DEd00002236sv000010DEsd00001482bc03sc02i00";

    #[test]
    fn a_variant_driver_is_found_for_its_device() {
        let t = AliasTable::parse(
            "# Aliases extracted from modules themselves.\n\
             alias pci:v000010DEd*sv*sd*bc03sc*i* nvidiafb\n\
             alias vfio_pci:v000010DEd00002941sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci\n",
        );
        assert_eq!(t.driver_for(GRACE).as_deref(), Some("nvgrace_gpu_vfio_pci"));
        assert_eq!(t.driver_for(A10), None);
    }

    #[test]
    fn fewest_wildcards_wins() {
        let t = AliasTable::parse(
            "alias vfio_pci:v*d*sv*sd*bc*sc*i* vfio_pci\n\
             alias vfio_pci:v000010DEd*sv*sd*bc*sc*i* broad_vfio_pci\n\
             alias vfio_pci:v000010DEd00002941sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci\n",
        );
        assert_eq!(t.driver_for(GRACE).as_deref(), Some("nvgrace_gpu_vfio_pci"));
        assert_eq!(t.driver_for(A10).as_deref(), Some("broad_vfio_pci"));
        let intel = "pci:v00008086d00001572sv00008086sd00000000bc02sc00i00";
        assert_eq!(t.driver_for(intel).as_deref(), Some(VFIO_PCI));
    }

    #[test]
    fn on_a_tie_the_first_line_wins() {
        let t = AliasTable::parse(
            "alias vfio_pci:v000010DEd00002941sv*sd*bc*sc*i* first_vfio_pci\n\
             alias vfio_pci:v000010DEd*sv000010DEsd*bc*sc*i* second_vfio_pci\n",
        );
        assert_eq!(t.driver_for(GRACE).as_deref(), Some("first_vfio_pci"));
    }

    #[test]
    fn plain_pci_aliases_and_garbage_are_ignored() {
        let t = AliasTable::parse(
            "alias pci:v000010DEd00002941sv*sd*bc*sc*i* nvidia\nalias\nalias vfio_pci:x\nnonsense\n",
        );
        assert_eq!(t.driver_for(GRACE), None);
        assert_eq!(t.driver_for("not-a-modalias"), None);
    }

    #[test]
    fn glob_semantics() {
        assert!(glob_match(b"a*c", b"abbbc"));
        assert!(glob_match(b"a*", b"a"));
        assert!(glob_match(b"a?c", b"abc"));
        assert!(!glob_match(b"a?c", b"ac"));
        assert!(!glob_match(b"abc", b"abcd"));
        assert!(glob_match(b"*d0000*", b"v10de0000d00002236"));
        assert!(!glob_match(b"v000010DEd00002941*", A10.as_bytes()));
    }
}
