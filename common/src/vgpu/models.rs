//! What NVIDIA's vGPU-capable GPUs are known to make, by PF device id: the prefix of their vGPU
//! type names, the series they offer and their memory.
//!
//! sysfs is the authority on types wherever it shows them. This table is for the two places it
//! cannot: a GPU whose VFs are not enabled yet shows no types at all (a profile that cannot fit
//! is refused before any VF is enabled, and [`super::capacity`] names what enabling them would
//! offer), and the SR-IOV vendor path lists types without counts (the equal-size limit of a
//! time-sliced type is the GPU's memory over the type's size).
//!
//! Facts from pci.ids and NVIDIA's vGPU type tables (the sources are listed with node-sim's
//! `tests/node-sim/catalogue.toml`): every time-sliced type's size divides the GPU's memory, and
//! its equal-size limit is the memory over the size. Only device ids and sizes those sources
//! confirm are here; a model missing here is judged by sysfs alone.

/// One GPU model.
#[derive(Debug, PartialEq, Eq)]
pub struct Model {
    /// PF device id (vendor 0x10de).
    pub device: u16,
    /// The type-name prefixes (`A10` in `NVIDIA A10-4Q`). One id can be two boards (A2, A16).
    pub prefixes: &'static [&'static str],
    /// Memory of one GPU, GiB.
    pub memory_gib: u32,
    /// The time-sliced series it offers.
    pub series: &'static [char],
    /// The first word of its type names: `NVIDIA` (`NVIDIA A10-4Q`) or `GRID` (`GRID T4-1Q`).
    pub name_word: &'static str,
}

const QABC: &[char] = &['Q', 'A', 'B', 'C'];
const C: &[char] = &['C'];

/// The known models.
pub const MODELS: &[Model] = &[
    Model {
        device: 0x1eb8,
        prefixes: &["T4"],
        memory_gib: 16,
        name_word: "GRID",
        series: QABC,
    },
    Model {
        device: 0x2236,
        prefixes: &["A10"],
        memory_gib: 24,
        name_word: "NVIDIA",
        series: QABC,
    },
    Model {
        device: 0x2235,
        prefixes: &["A40"],
        memory_gib: 48,
        name_word: "NVIDIA",
        series: QABC,
    },
    Model {
        device: 0x25b6,
        prefixes: &["A2", "A16"],
        memory_gib: 16,
        name_word: "NVIDIA",
        series: QABC,
    },
    Model {
        device: 0x20b2,
        prefixes: &["A100DX"],
        memory_gib: 80,
        name_word: "GRID",
        series: C,
    },
    Model {
        device: 0x20b5,
        prefixes: &["A100D"],
        memory_gib: 80,
        name_word: "GRID",
        series: C,
    },
    Model {
        device: 0x2330,
        prefixes: &["H100XM"],
        memory_gib: 80,
        name_word: "NVIDIA",
        series: C,
    },
    Model {
        device: 0x2331,
        prefixes: &["H100"],
        memory_gib: 80,
        name_word: "NVIDIA",
        series: C,
    },
    Model {
        device: 0x26b9,
        prefixes: &["L40S"],
        memory_gib: 48,
        name_word: "NVIDIA",
        series: QABC,
    },
];

/// The model of a PF, when known.
pub fn model(vendor: u16, device: u16) -> Option<&'static Model> {
    (vendor == 0x10de)
        .then(|| MODELS.iter().find(|m| m.device == device))
        .flatten()
}

/// A vGPU type name in NVIDIA's form, parsed: `A10-4Q`, `T4-2B4`, `A100DX-1-10C` (MIG-backed).
#[derive(Debug, PartialEq, Eq)]
pub struct TypeName<'a> {
    /// `A10`.
    pub prefix: &'a str,
    /// Framebuffer of one instance, GiB.
    pub size_gib: u32,
    /// `Q`, `A`, `B` or `C`.
    pub series: char,
    /// MIG-backed (`<slices>-<size>C`): its limit is not memory over size.
    pub mig: bool,
}

impl<'a> TypeName<'a> {
    /// Parses the last word of a type name (a config key). `None` when it is not in that form
    /// (`nvidia-593`, `mtty-2`, `1145`).
    pub fn parse(key: &'a str) -> Option<TypeName<'a>> {
        let (prefix, rest) = key.split_once('-')?;
        let (mig, sized) = match rest.split_once('-') {
            Some((slices, sized))
                if !slices.is_empty() && slices.bytes().all(|b| b.is_ascii_digit()) =>
            {
                (true, sized)
            }
            Some(_) => return None,
            None => (false, rest),
        };
        let digits = sized.bytes().take_while(u8::is_ascii_digit).count();
        let size_gib: u32 = sized[..digits].parse().ok()?;
        let series = sized[digits..].chars().next()?;
        if prefix.is_empty() || size_gib == 0 || !series.is_ascii_uppercase() {
            return None;
        }
        Some(TypeName {
            prefix,
            size_gib,
            series,
            mig,
        })
    }
}

impl Model {
    /// Whether this model can make a type of this name: its prefix and series, and a size that
    /// divides its memory. MIG-backed names pass on prefix and series alone.
    pub fn may_make(&self, t: &TypeName) -> bool {
        self.prefixes.contains(&t.prefix)
            && self.series.contains(&t.series)
            && (t.mig
                || (t.size_gib <= self.memory_gib && self.memory_gib.is_multiple_of(t.size_gib)))
    }

    /// The most time-sliced vGPUs of this size one GPU holds in equal-size mode.
    pub fn equal_size_max(&self, size_gib: u32) -> u32 {
        self.memory_gib / size_gib.max(1)
    }

    /// The time-sliced types enabling its VFs will offer, by name and size (GiB), smallest
    /// first within each series: Q and A in every size that divides its memory, C from 4 GiB.
    /// B types are left out: their sizes differ by model and the catalogue does not confirm
    /// them; they appear once the VFs show them.
    pub fn types_before_vfs(&self) -> Vec<(String, u32)> {
        let mut out = Vec::new();
        for &series in self.series {
            let smallest = match series {
                'Q' | 'A' => 1,
                'C' => 4,
                _ => continue,
            };
            for size in (smallest..=self.memory_gib).filter(|s| self.memory_gib.is_multiple_of(*s))
            {
                out.push((
                    format!("{} {}-{size}{series}", self.name_word, self.prefixes[0]),
                    size,
                ));
            }
        }
        out
    }

    /// What it makes, for a message: `A10-… types (1Q to 24Q; sizes that divide 24 GiB, such as
    /// A10-4Q)`.
    pub fn describe(&self) -> String {
        let names = self
            .prefixes
            .iter()
            .map(|p| format!("{p}-…"))
            .collect::<Vec<_>>()
            .join(" or ");
        let series: String = self.series.iter().collect();
        let example = [4, 8, 1]
            .into_iter()
            .find(|s| self.memory_gib.is_multiple_of(*s))
            .unwrap_or(self.memory_gib);
        format!(
            "{names} types of series {series} whose size divides its {} GiB, such as {}-{example}{}",
            self.memory_gib, self.prefixes[0], self.series[0]
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse() {
        assert_eq!(
            TypeName::parse("A10-4Q"),
            Some(TypeName {
                prefix: "A10",
                size_gib: 4,
                series: 'Q',
                mig: false
            })
        );
        assert_eq!(
            TypeName::parse("T4-2B4").map(|t| (t.size_gib, t.series)),
            Some((2, 'B'))
        );
        assert_eq!(
            TypeName::parse("A100DX-1-10C").map(|t| (t.size_gib, t.mig)),
            Some((10, true))
        );
        for not in [
            "nvidia-593",
            "mtty-2",
            "1145",
            "A10-Q",
            "A10-0Q",
            "-4Q",
            "A10-4q",
        ] {
            assert_eq!(TypeName::parse(not), None, "{not}");
        }
    }

    #[test]
    fn what_a_model_may_make() {
        let a10 = model(0x10de, 0x2236).unwrap();
        let ok = |k: &str| a10.may_make(&TypeName::parse(k).unwrap());
        assert!(ok("A10-4Q") && ok("A10-24Q") && ok("A10-3B") && ok("A10-12C"));
        assert!(!ok("A10-5Q"), "5 does not divide 24");
        assert!(!ok("A10-48Q"), "larger than the GPU");
        assert!(!ok("T4-4Q") && !ok("A100-4C") && !ok("A10-4X"));
        assert_eq!(a10.equal_size_max(4), 6);
        let h100 = model(0x10de, 0x2331).unwrap();
        assert!(
            !h100.may_make(&TypeName::parse("H100-4Q").unwrap()),
            "C series only"
        );
        assert_eq!(h100.equal_size_max(5), 16);
        assert_eq!(h100.equal_size_max(16), 5);
        let a16 = model(0x10de, 0x25b6).unwrap();
        assert!(a16.may_make(&TypeName::parse("A2-4Q").unwrap()));
        assert!(a16.may_make(&TypeName::parse("A16-16Q").unwrap()));
        assert_eq!(model(0x1002, 0x2236), None);
        assert!(a10.describe().contains("A10-4Q"), "{}", a10.describe());
    }
}
