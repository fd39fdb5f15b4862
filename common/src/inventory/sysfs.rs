//! The sysfs attribute and link readers of one inventory read: a function's attributes and
//! links, its mdev types and its vendor-path vGPU files, an mdev. Each reads a whole attribute
//! in one call and names the file it could not read.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::{MdevDevice, MdevType, NvidiaVgpu, PciDevice, ReadOptions, VgpuType, is_vfio_driver};
use crate::error::{Error, Result};
use crate::paths::HostPaths;
use crate::pci::PciAddress;

pub(super) fn is_not_found(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if source.kind() == io::ErrorKind::NotFound)
}

/// Names in a directory, sorted.
pub(crate) fn list_dir(dir: &Path) -> Result<Vec<String>> {
    let rd = fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut names = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        if let Some(n) = entry.file_name().to_str() {
            names.push(n.to_string());
        }
    }
    names.sort();
    Ok(names)
}

/// A file's contents without surrounding whitespace; `None` when it does not exist.
pub(crate) fn read_opt(path: &Path) -> Result<Option<String>> {
    match read_attr(path) {
        Ok(s) => Ok(Some(s.trim().to_string())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// Reads a sysfs attribute: open and one `read` of up to a page, which is all an attribute
/// holds and all the kernel hands over in one go. `fs::read_to_string` would add an `fstat`
/// and a second `read` for the end of file: on a node of a few hundred attributes that is a
/// few hundred more round trips for nothing (many more on a FUSE tree such as node-sim).
/// A larger file (a long `creatable_vgpu_types`) is read on to its end.
fn read_attr(path: &Path) -> io::Result<String> {
    read_all(fs::File::open(path)?)
}

/// Reads an opened attribute: one `read` of a page, on to the end only if it filled the page.
/// The page is on the stack: zeroing it costs less than allocating a zeroed one per attribute,
/// and the string made from it is only as long as the value.
fn read_all(mut f: fs::File) -> io::Result<String> {
    use std::io::Read;
    let mut page = [0u8; 4096];
    let n = f.read(&mut page)?;
    let mut buf = page[..n].to_vec();
    if n == page.len() {
        f.read_to_end(&mut buf)?;
    }
    String::from_utf8(buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

fn parse_hex(path: &Path, s: &str) -> Result<u32> {
    let digits = s
        .strip_prefix("0x")
        .or_else(|| s.strip_prefix("0X"))
        .unwrap_or(s);
    if digits.is_empty() || digits.len() > 8 {
        return Err(Error::Parse {
            path: path.to_path_buf(),
            reason: format!("not a hex number: {s:?}"),
        });
    }
    u32::from_str_radix(digits, 16).map_err(|_| Error::Parse {
        path: path.to_path_buf(),
        reason: format!("not a hex number: {s:?}"),
    })
}

fn read_opt_u32(path: &Path) -> Result<Option<u32>> {
    read_opt(path)?
        .map(|s| {
            s.parse::<u32>().map_err(|_| Error::Parse {
                path: path.to_path_buf(),
                reason: format!("not a number: {s:?}"),
            })
        })
        .transpose()
}

/// The last component of a symlink's target; `None` when there is no link.
pub(crate) fn link_name(path: &Path) -> Result<Option<String>> {
    match fs::read_link(path) {
        Ok(t) => Ok(t
            .file_name()
            .and_then(|n| n.to_str())
            .map(|s| s.to_string())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

pub(super) fn link_number(path: &Path) -> Result<Option<u32>> {
    link_name(path)?
        .map(|n| {
            n.parse::<u32>().map_err(|_| Error::Parse {
                path: path.to_path_buf(),
                reason: format!("link does not end in a group number: {n:?}"),
            })
        })
        .transpose()
}

/// Where a sysfs link (`bus/pci/devices/<addr>` → `../../../devices/pci0000:00/…`) points, as
/// a path under the same root, checked to exist.
///
/// Resolved lexically rather than by `canonicalize`: sysfs's own links are relative and every
/// directory between `/sys` and a device is a real directory, so `..` may be folded without
/// looking; `realpath` would instead read every component of the path back as a possible link,
/// a round trip each on a FUSE tree and twenty per device on a node.
fn resolve_link(link: &Path) -> io::Result<PathBuf> {
    let target = fs::read_link(link)?;
    let joined = match link.parent() {
        Some(parent) if target.is_relative() => parent.join(&target),
        _ => target,
    };
    let mut out = PathBuf::new();
    for c in joined.components() {
        match c {
            std::path::Component::ParentDir => {
                // Fold `a/..`; keep a `..` that climbs above a relative host root.
                if matches!(
                    out.components().next_back(),
                    Some(std::path::Component::Normal(_))
                ) {
                    out.pop();
                } else {
                    out.push("..");
                }
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    fs::symlink_metadata(&out)?;
    Ok(out)
}

/// Whether `name` is a PCIe root complex's directory under `/sys/devices`: `pci` then a
/// four-digit domain and a two-digit bus in hex (`pci0000:40`, `pci10000:00` on VMD domains).
fn is_pcie_root(name: &str) -> bool {
    name.strip_prefix("pci")
        .and_then(|r| r.split_once(':'))
        .is_some_and(|(domain, bus)| {
            (4..=8).contains(&domain.len())
                && bus.len() == 2
                && domain
                    .chars()
                    .chain(bus.chars())
                    .all(|c| c.is_ascii_hexdigit())
        })
}

/// Reads one function; with it, the UUIDs of the mdevs whose directories sit in its own.
pub(super) fn read_pci_device(
    link: &Path,
    address: PciAddress,
    opts: &ReadOptions,
    type_names: &mut TypeNames,
) -> Result<Option<(PciDevice, Vec<String>)>> {
    let dir = match resolve_link(link) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            // A dangling link; a device that vanished has no link at all.
            if fs::symlink_metadata(link).is_ok() {
                return Err(Error::Parse {
                    path: link.to_path_buf(),
                    reason: "dangling link".into(),
                });
            }
            return Ok(None);
        }
        Err(e) => return Err(Error::io(link, e)),
    };
    // One open of the device directory; every attribute below is opened relative to it.
    let d = AttrDir::open(&dir)?;
    let bridges: Vec<PciAddress> = dir
        .ancestors()
        .skip(1)
        .map_while(|p| p.file_name()?.to_str()?.parse::<PciAddress>().ok())
        .collect();
    // Above the last bridge: the root complex's directory, `pci<domain>:<bus>`.
    let pcie_root = dir
        .ancestors()
        .nth(bridges.len() + 1)
        .and_then(|p| p.file_name()?.to_str())
        .filter(|n| is_pcie_root(n))
        .map(str::to_string);
    let mut virtfns: Vec<(u32, PciAddress)> = Vec::new();
    let mut mdev_parent = false;
    let mut vfio_cdev = None;
    let mut mdevs = Vec::new();
    // Optional attributes are opened only when the listing has them: a failed open costs as
    // much as a read, and most functions lack most of them (SR-IOV, physfn, nvidia/).
    let names = list_dir(&dir)?;
    let has = |n: &str| names.binary_search_by(|x| x.as_str().cmp(n)).is_ok();
    let driver = if has("driver") {
        d.link_name("driver")?
    } else {
        None
    };
    // A VF read without its identity: filled in from its PF by the caller. A VF on a VFIO
    // driver is passed through on its own, as what it is: always read.
    let identity =
        opts.vf_identity || !has("physfn") || driver.as_deref().is_some_and(is_vfio_driver);
    for name in &names {
        if let Some(n) = name
            .strip_prefix("virtfn")
            .and_then(|n| n.parse::<u32>().ok())
        {
            if let Some(a) = d.link_address(name)? {
                virtfns.push((n, a));
            }
        } else if name == "mdev_supported_types" {
            mdev_parent = true;
        } else if name == "vfio-dev" {
            vfio_cdev = list_dir(&dir.join(name))
                .ok()
                .and_then(|v| v.into_iter().next());
        } else if let Some(uuid) = crate::uevent::parse_uuid(name) {
            mdevs.push(uuid);
        }
    }
    virtfns.sort();
    let opt = |n: &str| if has(n) { d.read_opt(n) } else { Ok(None) };
    let id_opt = |n: &str| if identity { opt(n) } else { Ok(None) };
    let opt_link = |n: &str| if has(n) { d.link_name(n) } else { Ok(None) };
    let hex16 = |n: &str, s: &str| -> Result<u16> {
        let v = parse_hex(&d.file(n), s)?;
        u16::try_from(v).map_err(|_| Error::Parse {
            path: d.file(n),
            reason: format!("not a 16-bit id: {s:?}"),
        })
    };
    let opt_hex = |n: &str| id_opt(n)?.map_or(Ok(0), |s| hex16(n, &s));
    let req_hex = |n: &str| {
        if identity {
            hex16(n, &d.read_req(n)?)
        } else {
            Ok(0)
        }
    };
    let class = if identity {
        parse_hex(&d.file("class"), &d.read_req("class")?)?
    } else {
        0
    };
    let opt_u32 = |n: &str| {
        opt(n)?
            .map(|s| {
                s.parse::<u32>().map_err(|_| Error::Parse {
                    path: d.file(n),
                    reason: format!("not a number: {s:?}"),
                })
            })
            .transpose()
    };
    let numa = id_opt("numa_node")?
        .map(|s| {
            s.parse::<i32>().map_err(|_| Error::Parse {
                path: d.file("numa_node"),
                reason: format!("not a number: {s:?}"),
            })
        })
        .transpose()?;
    let iommu_group = opt_link("iommu_group")?
        .map(|n| {
            n.parse::<u32>().map_err(|_| Error::Parse {
                path: d.file("iommu_group"),
                reason: format!("link does not end in a group number: {n:?}"),
            })
        })
        .transpose()?;
    let physfn = if has("physfn") {
        d.link_address("physfn")?
    } else {
        None
    };
    let mdev_types = if mdev_parent && opts.mdev_types {
        read_mdev_types(&dir, Some((physfn.unwrap_or(address), type_names)))?
    } else {
        Vec::new()
    };
    let nvidia_vgpu = if has("nvidia") {
        read_nvidia_vgpu(&dir)?
    } else {
        None
    };
    let dev = PciDevice {
        address,
        vendor: req_hex("vendor")?,
        device: req_hex("device")?,
        subsystem_vendor: opt_hex("subsystem_vendor")?,
        subsystem_device: opt_hex("subsystem_device")?,
        class,
        driver,
        driver_override: id_opt("driver_override")?.filter(|s| !s.is_empty() && s != "(null)"),
        iommu_group,
        numa_node: numa.filter(|n| *n >= 0),
        physfn,
        virtfns: virtfns.into_iter().map(|(_, a)| a).collect(),
        sriov_totalvfs: opt_u32("sriov_totalvfs")?,
        sriov_numvfs: opt_u32("sriov_numvfs")?,
        modalias: id_opt("modalias")?,
        upstream_bridge: bridges.first().copied(),
        bridges,
        pcie_root,
        vfio_cdev,
        mdev_types,
        mdev_parent,
        nvidia_vgpu,
    };
    Ok(Some((dev, mdevs)))
}

/// A sysfs directory opened once, its attributes read relative to it: each read then resolves
/// one name instead of the whole path from the root (a round trip per component on a FUSE
/// tree, a dcache walk on real sysfs).
struct AttrDir {
    fd: std::os::fd::OwnedFd,
    path: PathBuf,
}

impl AttrDir {
    fn open(path: &Path) -> Result<AttrDir> {
        use nix::fcntl::OFlag;
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
        let fd = nix::fcntl::open(path, flags, nix::sys::stat::Mode::empty())
            .map_err(|e| Error::io(path, io::Error::from(e)))?;
        Ok(AttrDir {
            fd,
            path: path.to_path_buf(),
        })
    }

    /// The full path of `name`, for errors.
    fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    fn read(&self, name: &str) -> io::Result<String> {
        use nix::fcntl::OFlag;
        let fd = nix::fcntl::openat(
            &self.fd,
            name,
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(io::Error::from)?;
        read_all(fs::File::from(fd))
    }

    /// The attribute without surrounding whitespace; `None` when it does not exist.
    fn read_opt(&self, name: &str) -> Result<Option<String>> {
        match self.read(name) {
            Ok(s) => Ok(Some(s.trim().to_string())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(self.file(name), e)),
        }
    }

    fn read_req(&self, name: &str) -> Result<String> {
        self.read(name)
            .map(|s| s.trim().to_string())
            .map_err(|e| Error::io(self.file(name), e))
    }

    /// The last component of the link `name`'s target; `None` when there is no link.
    fn link_name(&self, name: &str) -> Result<Option<String>> {
        match nix::fcntl::readlinkat(&self.fd, name) {
            Ok(t) => Ok(Path::new(&t)
                .file_name()
                .and_then(|n| n.to_str())
                .map(str::to_string)),
            Err(nix::errno::Errno::ENOENT) => Ok(None),
            Err(e) => Err(Error::io(self.file(name), io::Error::from(e))),
        }
    }

    fn link_address(&self, name: &str) -> Result<Option<PciAddress>> {
        self.link_name(name)?
            .map(|n| {
                n.parse::<PciAddress>().map_err(|_| Error::Parse {
                    path: self.file(name),
                    reason: format!("link does not end in a PCI address: {n:?}"),
                })
            })
            .transpose()
    }
}

/// Reads one mdev parent's supported types (`<mdev_bus>/<parent>/mdev_supported_types/*`), for
/// readers that skip types in [`Inventory::read_with`] and need them for a few parents only.
pub fn read_parent_mdev_types(paths: &HostPaths, parent: &str) -> Result<Vec<MdevType>> {
    read_mdev_types(&paths.mdev_bus().join(parent), None)
}

/// The `name` and `description` of the mdev types one read has met, by GPU (a VF's PF, or the
/// function itself) and type id. A GPU's driver lists the same types on each of its VFs, each
/// VF with its own `available_instances` but the same name and description: those two are read
/// on the first VF of the GPU only, which on an A10 (32 VFs listing 23 types each) spares 1,426
/// of a read's 2,208 type files.
#[derive(Default)]
pub(crate) struct TypeNames(HashMap<(PciAddress, String), (Option<String>, Option<String>)>);

/// The types of the mdev parent at `parent_dir`: `available_instances` of each, and its name and
/// description. With `known`, the parent's GPU and the names read so far: those of that GPU are
/// taken from there, and those read are added.
pub(super) fn read_mdev_types(
    parent_dir: &Path,
    mut known: Option<(PciAddress, &mut TypeNames)>,
) -> Result<Vec<MdevType>> {
    let dir = parent_dir.join("mdev_supported_types");
    let ids = list_dir(&dir)?;
    // Each type's files are opened relative to the types' directory, opened once.
    let d = AttrDir::open(&dir)?;
    let mut types = Vec::with_capacity(ids.len());
    for id in ids {
        let file = format!("{id}/available_instances");
        let available = d.read_req(&file)?;
        let available_instances = available.parse::<u32>().map_err(|_| Error::Parse {
            path: d.file(&file),
            reason: format!("not a number: {available:?}"),
        })?;
        let cached = match &known {
            Some((gpu, names)) => names.0.get(&(*gpu, id.clone())).cloned(),
            None => None,
        };
        let (name, description) = match cached {
            Some(nd) => nd,
            None => {
                let nd = (
                    d.read_opt(&format!("{id}/name"))?,
                    d.read_opt(&format!("{id}/description"))?,
                );
                if let Some((gpu, names)) = known.as_mut() {
                    names.0.insert((*gpu, id.clone()), nd.clone());
                }
                nd
            }
        };
        types.push(MdevType {
            id,
            name,
            available_instances,
            description,
        });
    }
    Ok(types)
}

/// Parses `creatable_vgpu_types`: an optional `ID : vGPU Name` header, then `1145  : NVIDIA L40S-1B`.
pub fn parse_creatable_vgpu_types(path: &Path, text: &str) -> Result<Vec<VgpuType>> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let Some((id, name)) = line.split_once(':') else {
            return Err(Error::Parse {
                path: path.to_path_buf(),
                reason: format!("line without ':': {line:?}"),
            });
        };
        let (id, name) = (id.trim(), name.trim());
        if id.eq_ignore_ascii_case("id") {
            continue; // header
        }
        let id = id.parse::<u32>().map_err(|_| Error::Parse {
            path: path.to_path_buf(),
            reason: format!("type id is not a number: {line:?}"),
        })?;
        out.push(VgpuType {
            id,
            name: name.to_string(),
        });
    }
    Ok(out)
}

fn read_nvidia_vgpu(dir: &Path) -> Result<Option<NvidiaVgpu>> {
    let path = dir.join("nvidia/creatable_vgpu_types");
    let Some(text) = (match read_attr(&path) {
        Ok(s) => Some(s),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(Error::io(&path, e)),
    }) else {
        return Ok(None);
    };
    let creatable = parse_creatable_vgpu_types(&path, &text)?;
    let current = read_opt_u32(&dir.join("nvidia/current_vgpu_type"))?.unwrap_or(0);
    let current_name = creatable
        .iter()
        .find(|t| t.id == current && current != 0)
        .map(|t| t.name.clone());
    Ok(Some(NvidiaVgpu {
        creatable,
        current,
        current_name,
    }))
}

pub(super) fn read_mdev(link: &Path, name: &str) -> Result<Option<MdevDevice>> {
    let dir = match resolve_link(link) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(link, e)),
    };
    let type_id = link_name(&dir.join("mdev_type"))?.ok_or_else(|| Error::Parse {
        path: dir.join("mdev_type"),
        reason: "mdev has no mdev_type link".into(),
    })?;
    let parent = dir
        .parent()
        .and_then(|p| p.file_name())
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::Parse {
            path: dir.clone(),
            reason: "mdev has no parent directory".into(),
        })?
        .to_string();
    Ok(Some(MdevDevice {
        uuid: name.to_ascii_lowercase(),
        type_name: read_opt(&dir.join("mdev_type/name")).ok().flatten(),
        parent_pci: parent.parse().ok(),
        parent,
        iommu_group: link_number(&dir.join("iommu_group"))?,
        driver: link_name(&dir.join("driver"))?,
        vfio_cdev: list_dir(&dir.join("vfio-dev"))
            .ok()
            .and_then(|v| v.into_iter().next()),
        type_id,
    }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed setup step should panic
    use super::*;

    #[test]
    fn an_attribute_is_read_whole_whatever_its_length() {
        let dir = tempfile::tempdir().unwrap();
        for len in [0, 1, 4095, 4096, 4097, 3 * 4096 + 5] {
            let value: String = (0..len)
                .map(|i| char::from(b'a' + (i % 26) as u8))
                .collect();
            let path = dir.path().join(format!("attr{len}"));
            fs::write(&path, &value).unwrap();
            assert_eq!(read_attr(&path).unwrap(), value, "{len} bytes");
        }
    }

    #[test]
    fn an_attribute_that_is_not_utf8_is_invalid_data() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("attr");
        fs::write(&path, [b'o', b'k', 0xff]).unwrap();
        let e = read_attr(&path).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }
}
