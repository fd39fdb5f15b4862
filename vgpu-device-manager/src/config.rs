//! The configuration file: NVIDIA vgpu-device-manager's `version: v1` / `vgpu-configs` format.
//!
//! ```yaml
//! version: v1
//! vgpu-configs:
//!   A10-4Q:
//!     - devices: all               # or [0, 1]: index among the node's GPUs, PCI-address order
//!       device-filter: "0x223610DE" # optional; a list, or "0xDDDDVVVV:0xSSSSssss"
//!       vgpu-devices: {"A10-4Q": 6}
//! ```
//!
//! Everything that can be checked without looking at the node is checked while parsing, so the
//! error carries the YAML path (`vgpu-configs.A10-4Q[0].vgpu-devices`) and the line and column.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

/// A parse or validation error of the configuration file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The YAML is malformed, has an unknown field or an invalid value.
    #[error("{source}")]
    Yaml {
        /// The YAML error, with the path in the document and the line and column.
        #[from]
        source: yaml_serde::Error,
    },
    /// `version` is not `v1`.
    #[error("unsupported version {0:?}: only \"v1\" is understood")]
    Version(String),
    /// `vgpu-configs` is empty, or a profile has no entries.
    #[error("{0}")]
    Empty(String),
    /// The selected profile is not in the file.
    #[error("no profile named {name:?} in the config file (profiles: {known})")]
    UnknownProfile {
        /// The name asked for.
        name: String,
        /// The names the file has, comma separated.
        known: String,
    },
    /// No profile was named and the file has more than one.
    #[error(
        "-c/--selected-config (or VGPU_DM_SELECTED_CONFIG) is required: the config file has {count} profiles ({known})"
    )]
    NoSelection {
        /// How many profiles the file has.
        count: usize,
        /// Their names, comma separated.
        known: String,
    },
}

/// A config or profile that does not fit ends a command with exit status 2 (nothing changed).
impl From<ConfigError> for daemon_kit::Failure {
    fn from(e: ConfigError) -> Self {
        daemon_kit::Failure::new(daemon_kit::exit::USAGE, e)
    }
}

/// The whole file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Always `v1`.
    pub version: String,
    /// Profiles by name.
    #[serde(rename = "vgpu-configs")]
    pub vgpu_configs: BTreeMap<String, Vec<Entry>>,
}

/// One entry of a profile: which GPUs, and what vGPUs each of them gets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Entry {
    /// `all`, or indices among the node's GPUs.
    pub devices: Devices,
    /// Only GPUs with one of these ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_filter: Option<DeviceFilter>,
    /// vGPU type key → count on each selected GPU.
    pub vgpu_devices: BTreeMap<TypeKey, Count>,
}

/// `devices:` of an entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Devices {
    /// `all`.
    All,
    /// `[0, 1]`.
    Indices(Vec<usize>),
}

impl Devices {
    /// Whether the GPU at `index` is selected.
    pub fn matches(&self, index: usize) -> bool {
        match self {
            Devices::All => true,
            Devices::Indices(v) => v.contains(&index),
        }
    }
}

impl Serialize for Devices {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Devices::All => s.serialize_str("all"),
            Devices::Indices(v) => v.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Devices {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Devices;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("\"all\" or a list of GPU indices")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Devices, E> {
                if v == "all" {
                    Ok(Devices::All)
                } else {
                    Err(E::custom(format!(
                        "devices must be \"all\" or a list of GPU indices, not {v:?}"
                    )))
                }
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Devices, A::Error> {
                let mut v = Vec::new();
                while let Some(i) = seq.next_element::<usize>()? {
                    if v.contains(&i) {
                        return Err(de::Error::custom(format!("GPU index {i} is listed twice")));
                    }
                    v.push(i);
                }
                if v.is_empty() {
                    return Err(de::Error::custom("devices lists no GPU"));
                }
                Ok(Devices::Indices(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// A PCI id to match: `0xDDDDVVVV` (device, vendor), optionally `:0xSSSSssss` (subsystem
/// device, subsystem vendor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceId {
    /// PCI device id.
    pub device: u16,
    /// PCI vendor id.
    pub vendor: u16,
    /// Subsystem (device, vendor), when given.
    pub subsystem: Option<(u16, u16)>,
}

impl DeviceId {
    /// Whether a function with these ids matches.
    pub fn matches(&self, vendor: u16, device: u16, sub_vendor: u16, sub_device: u16) -> bool {
        self.vendor == vendor
            && self.device == device
            && self
                .subsystem
                .is_none_or(|(d, v)| d == sub_device && v == sub_vendor)
    }

    fn parse(s: &str) -> Result<DeviceId, BadValue> {
        fn word(w: &str) -> Option<(u16, u16)> {
            let h = w.strip_prefix("0x").or_else(|| w.strip_prefix("0X"))?;
            if h.len() != 8 {
                return None;
            }
            let n = u32::from_str_radix(h, 16).ok()?;
            Some(((n >> 16) as u16, (n & 0xffff) as u16))
        }
        let bad = || BadValue::DeviceFilter(s.to_string());
        let (main, sub) = match s.split_once(':') {
            Some((m, s)) => (m, Some(s)),
            None => (s, None),
        };
        let (device, vendor) = word(main.trim()).ok_or_else(bad)?;
        let subsystem = match sub {
            Some(x) => Some(word(x.trim()).ok_or_else(bad)?),
            None => None,
        };
        Ok(DeviceId {
            device,
            vendor,
            subsystem,
        })
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "0x{:04X}{:04X}", self.device, self.vendor)?;
        if let Some((d, v)) = self.subsystem {
            write!(f, ":0x{d:04X}{v:04X}")?;
        }
        Ok(())
    }
}

/// `device-filter:` — one id or a list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceFilter(pub Vec<DeviceId>);

impl DeviceFilter {
    /// Whether any id matches.
    pub fn matches(&self, vendor: u16, device: u16, sub_vendor: u16, sub_device: u16) -> bool {
        self.0
            .iter()
            .any(|id| id.matches(vendor, device, sub_vendor, sub_device))
    }
}

impl Serialize for DeviceFilter {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let v: Vec<String> = self.0.iter().map(|d| d.to_string()).collect();
        match v.as_slice() {
            [one] => s.serialize_str(one),
            _ => v.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for DeviceFilter {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = DeviceFilter;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a PCI id \"0xDDDDVVVV\" or a list of them")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<DeviceFilter, E> {
                Ok(DeviceFilter(vec![DeviceId::parse(v).map_err(E::custom)?]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<DeviceFilter, A::Error> {
                let mut v = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    v.push(DeviceId::parse(&s).map_err(de::Error::custom)?);
                }
                if v.is_empty() {
                    return Err(de::Error::custom("device-filter is an empty list"));
                }
                Ok(DeviceFilter(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// A value of the config file that is not what its field takes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadValue {
    /// A `device-filter` entry.
    #[error(
        "device-filter {0:?} is not \"0xDDDDVVVV\" or \"0xDDDDVVVV:0xSSSSssss\" (device and \
         vendor id in hex, e.g. \"0x223610DE\" for an A10)"
    )]
    DeviceFilter(String),
    /// A key of `vgpu-devices`.
    #[error(
        "{0:?} is not a vGPU type: expected a type name such as \"A10-4Q\" (the last word of the \
         type's name) or a type id such as \"nvidia-558\""
    )]
    TypeKey(String),
}

/// A vGPU type key: the last word of a type's name (`A10-4Q` for `NVIDIA A10-4Q`), or a sysfs
/// type id (`nvidia-558`, `mtty-2`, or the vendor path's numeric `1145`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct TypeKey(pub String);

impl TypeKey {
    /// Checks the syntax: letters, digits, `.`, `_` and `-`, with at least one `-` between
    /// non-empty parts (`A10-4Q`, `A100DX-1-10C`, `mtty-2`), or all digits (`1145`).
    pub fn parse(s: &str) -> Result<TypeKey, BadValue> {
        let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        let digits = !s.is_empty() && s.chars().all(|c| c.is_ascii_digit());
        let named =
            s.contains('-') && s.chars().all(allowed) && s.split('-').all(|p| !p.is_empty());
        if digits || named {
            Ok(TypeKey(s.to_string()))
        } else {
            Err(BadValue::TypeKey(s.to_string()))
        }
    }

    /// The key as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TypeKey {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for TypeKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        TypeKey::parse(&s).map_err(de::Error::custom)
    }
}

/// A vGPU count, at least 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Count(pub u32);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u32::deserialize(d)?;
        if n == 0 {
            return Err(de::Error::custom(
                "a vGPU count must be at least 1 (leave the type out to have none)",
            ));
        }
        Ok(Count(n))
    }
}

impl Config {
    /// Parses and checks a file's text.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let c: Config = yaml_serde::from_str(text)?;
        if c.version != "v1" {
            return Err(ConfigError::Version(c.version));
        }
        if c.vgpu_configs.is_empty() {
            return Err(ConfigError::Empty("vgpu-configs has no profiles".into()));
        }
        for (name, entries) in &c.vgpu_configs {
            if entries.is_empty() {
                return Err(ConfigError::Empty(format!(
                    "profile {name:?} has no entries"
                )));
            }
        }
        Ok(c)
    }

    /// The entries of profile `name`.
    pub fn profile(&self, name: &str) -> Result<&[Entry], ConfigError> {
        self.vgpu_configs
            .get(name)
            .map(|v| v.as_slice())
            .ok_or_else(|| ConfigError::UnknownProfile {
                name: name.to_string(),
                known: self.known(),
            })
    }

    /// The profile to use: `name` when given (it must exist), else the file's only profile, as
    /// NVIDIA's `nvidia-vgpu-dm` does.
    pub fn select(&self, name: Option<&str>) -> Result<String, ConfigError> {
        match name {
            Some(n) => self.profile(n).map(|_| n.to_string()),
            None if self.vgpu_configs.len() == 1 => {
                Ok(self.vgpu_configs.keys().next().cloned().unwrap_or_default())
            }
            None => Err(ConfigError::NoSelection {
                count: self.vgpu_configs.len(),
                known: self.known(),
            }),
        }
    }

    fn known(&self) -> String {
        self.vgpu_configs
            .keys()
            .map(|k| k.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The file as YAML.
    pub fn to_yaml(&self) -> String {
        yaml_serde::to_string(self).unwrap_or_else(|e| format!("# cannot serialize: {e}\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
version: v1
vgpu-configs:
  default:
    - devices: all
      vgpu-devices: {"A10-12Q": 2}
  A10-4Q:
    - devices: [0, 1]
      device-filter: "0x223610DE"
      vgpu-devices:
        A10-4Q: 6
  mixed:
    - devices: all
      device-filter: ["0x223610DE:0x148210DE", "0x1EB810de"]
      vgpu-devices: {"nvidia-558": 1, "mtty-2": 3}
  none:
    - devices: all
      vgpu-devices: {}
"#;

    #[test]
    fn parses_the_nvidia_format() {
        let c = Config::parse(GOOD).unwrap();
        let p = c.profile("A10-4Q").unwrap();
        assert_eq!(p[0].devices, Devices::Indices(vec![0, 1]));
        let f = p[0].device_filter.as_ref().unwrap();
        assert!(f.matches(0x10de, 0x2236, 0x10de, 0x1482));
        assert!(!f.matches(0x10de, 0x1eb8, 0x10de, 0x1482));
        let m = c.profile("mixed").unwrap();
        let f = m[0].device_filter.as_ref().unwrap();
        assert!(f.matches(0x10de, 0x2236, 0x10de, 0x1482));
        assert!(!f.matches(0x10de, 0x2236, 0x10de, 0x1483));
        assert!(f.matches(0x10de, 0x1eb8, 0x1234, 0x5678));
        assert_eq!(
            m[0].vgpu_devices.get(&TypeKey("mtty-2".into())),
            Some(&Count(3))
        );
        assert!(c.profile("none").unwrap()[0].vgpu_devices.is_empty());
        // Round trip through the writer.
        assert_eq!(Config::parse(&c.to_yaml()).unwrap(), c);
    }

    fn err(text: &str) -> String {
        Config::parse(text).unwrap_err().to_string()
    }

    #[test]
    fn errors_name_the_place_and_line() {
        let e = err(
            "version: v1\nvgpu-configs:\n  A10-4Q:\n    - devices: all\n      colour: red\n      vgpu-devices: {A10-4Q: 6}\n",
        );
        assert!(e.contains("vgpu-configs.A10-4Q[0]"), "{e}");
        assert!(e.contains("unknown field `colour`"), "{e}");
        assert!(e.contains("line 5"), "{e}");

        let e = err(
            "version: v1\nvgpu-configs:\n  p:\n    - devices: all\n      vgpu-devices: {A10-4Q: 0}\n",
        );
        assert!(e.contains("vgpu-configs.p[0].vgpu-devices"), "{e}");
        assert!(e.contains("at least 1"), "{e}");
        assert!(e.contains("line 5"), "{e}");

        let e = err(
            "version: v1\nvgpu-configs:\n  p:\n    - devices: all\n      vgpu-devices: {\"A10 4Q\": 1}\n",
        );
        assert!(e.contains("\"A10 4Q\" is not a vGPU type"), "{e}");
        assert!(e.contains("vgpu-configs.p[0]"), "{e}");

        let e = err(
            "version: v1\nvgpu-configs:\n  p:\n    - devices: some\n      vgpu-devices: {A10-4Q: 1}\n",
        );
        assert!(e.contains("devices must be"), "{e}");

        let e = err(
            "version: v1\nvgpu-configs:\n  p:\n    - devices: all\n      device-filter: A10\n      vgpu-devices: {A10-4Q: 1}\n",
        );
        assert!(e.contains("device-filter \"A10\""), "{e}");

        let e = err("version: v1\nvgpu-configs:\n  p:\n    - vgpu-devices: {A10-4Q: 1}\n");
        assert!(e.contains("missing field `devices`"), "{e}");

        assert!(
            err("version: v2\nvgpu-configs:\n  p:\n    - devices: all\n      vgpu-devices: {}\n")
                .contains("v2")
        );
        assert!(
            err("version: v1\nvgpu-configs:\n  p: []\n").contains("profile \"p\" has no entries")
        );
        assert!(err("version: v1\nextra: 1\nvgpu-configs: {}\n").contains("unknown field `extra`"));
    }

    #[test]
    fn unknown_profile_lists_the_known_ones() {
        let c = Config::parse(GOOD).unwrap();
        let e = c.profile("A10-8Q").unwrap_err().to_string();
        assert!(e.contains("\"A10-8Q\""), "{e}");
        assert!(e.contains("A10-4Q, default, mixed, none"), "{e}");
    }

    #[test]
    fn type_key_syntax() {
        for good in [
            "A10-4Q",
            "A100DX-1-10C",
            "nvidia-558",
            "mtty-2",
            "1145",
            "T4-2B4",
        ] {
            assert!(TypeKey::parse(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "A10",
            "A10 4Q",
            "-4Q",
            "A10-",
            "A10--4Q",
            "A10/4Q",
            "nvidia-5:58",
        ] {
            assert!(TypeKey::parse(bad).is_err(), "{bad}");
        }
    }

    proptest::proptest! {
        #[test]
        fn device_ids_round_trip(d: u16, v: u16, sub: Option<(u16, u16)>) {
            let id = DeviceId { device: d, vendor: v, subsystem: sub };
            proptest::prop_assert_eq!(DeviceId::parse(&id.to_string()).unwrap(), id);
        }

        #[test]
        fn parser_never_panics(s in "\\PC{0,200}") {
            let _ = Config::parse(&s);
        }
    }
}
