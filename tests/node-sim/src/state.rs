//! The kernel model: the node's PCI functions, VFs, mdevs and vendor vGPUs, what the vGPU
//! placement rules offer, and the kernel's answer to each write (its effects and errnos).
//! Rendering the state as files is [`crate::render`]; control commands, fault injection, the op
//! log and device-node holders sit beside it in their own modules.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::catalogue::{Attach, GpuModel, VgpuTypeDef, catalogue};
use crate::errno::Errno;
use crate::faults::Faults;
use crate::holders::Holders;
use crate::ops::OpLog;
use crate::topology::Topology;
use crate::tree::{Owner, WriteTarget};
use crate::uevent::Uevent;

/// A PCI function (a bridge, a GPU, one of its VFs, a companion function).
#[derive(Clone, Debug)]
pub(crate) struct Dev {
    pub addr: String,
    pub vendor: u16,
    pub device: u16,
    pub subsystem_vendor: u16,
    pub subsystem_device: u16,
    pub class: u32,
    pub numa: i32,
    pub group: u32,
    /// The directory the device dir sits in (`sys/devices/pci0000:40/0000:40:01.1`).
    pub parent_dir: String,
    pub driver: Option<String>,
    pub default_driver: Option<String>,
    pub driver_override: Option<String>,
    pub model: Option<String>,
    pub physfn: Option<String>,
    pub vf_index: u32,
    pub totalvfs: u32,
    pub numvfs: u32,
    pub current_vgpu: u32,
    pub nvidia_minor: Option<u32>,
    pub vfio_dev: Option<u32>,
}

impl Dev {
    pub fn dir(&self) -> String {
        format!("{}/{}", self.parent_dir, self.addr)
    }

    fn is_display(&self) -> bool {
        matches!(self.class >> 8, 0x0300 | 0x0302)
    }

    /// Drivers whose id tables match this device.
    fn id_drivers(&self) -> Vec<String> {
        let mut v: Vec<String> = self.default_driver.iter().cloned().collect();
        if self.vendor == 0x10de && self.is_display() && self.physfn.is_none() {
            for d in ["nvidia", "nouveau"] {
                if !v.iter().any(|x| x == d) {
                    v.push(d.to_string());
                }
            }
        }
        v
    }

    pub fn modalias(&self) -> String {
        format!(
            "pci:v{:08X}d{:08X}sv{:08X}sd{:08X}bc{:02X}sc{:02X}i{:02X}",
            self.vendor,
            self.device,
            self.subsystem_vendor,
            self.subsystem_device,
            self.class >> 16,
            (self.class >> 8) & 0xff,
            self.class & 0xff
        )
    }
}

/// A mediated device.
#[derive(Clone, Debug)]
pub(crate) struct Mdev {
    pub uuid: String,
    pub parent: String,
    pub type_id: u32,
    pub group: u32,
}

/// The node.
#[derive(Debug)]
pub(crate) struct State {
    pub topo: Topology,
    pub drivers: BTreeSet<String>,
    pub vfio_drivers: BTreeSet<String>,
    pub devs: BTreeMap<String, Dev>,
    pub mdevs: BTreeMap<String, Mdev>,
    pub holders: Holders,
    pub faults: Faults,
    pub ops: OpLog,
    next_group: u32,
    next_minor: u32,
    next_vfio_dev: u32,
    /// Uevents not yet sent.
    pub events: Vec<Uevent>,
    /// The parts of the node whose files changed since the tree was last brought up to date.
    pub dirty: BTreeSet<Owner>,
}

pub(crate) fn root_dir(addr: &str) -> String {
    // The root complex a function without a bridge sits under: pciDDDD:BB.
    format!("sys/devices/pci{}", &addr[..7])
}

impl State {
    /// The node of `topo`, mounted at `root` (canonical: how the host's `/proc` names it).
    pub fn new(topo: &Topology, root: &Path) -> State {
        let mut devs = BTreeMap::new();
        let mut max_group = 0;
        let bridge_dir = |topo: &Topology, addr: &str| -> String {
            // Walk up the parents to build the directory.
            let mut chain = vec![addr.to_string()];
            let mut cur = addr.to_string();
            while let Some(p) = topo
                .bridges
                .iter()
                .find(|b| b.address == cur)
                .and_then(|b| b.parent.clone())
            {
                chain.push(p.clone());
                cur = p;
            }
            let mut dir = root_dir(&cur);
            for a in chain.iter().rev() {
                dir = format!("{dir}/{a}");
            }
            dir
        };
        for b in &topo.bridges {
            let dir = bridge_dir(topo, &b.address);
            let parent_dir = dir
                .rsplit_once('/')
                .map(|(p, _)| p.to_string())
                .unwrap_or_default();
            max_group = max_group.max(b.group);
            devs.insert(
                b.address.clone(),
                Dev {
                    addr: b.address.clone(),
                    vendor: b.vendor,
                    device: b.device,
                    subsystem_vendor: b.vendor,
                    subsystem_device: 0,
                    class: 0x060400,
                    numa: b.numa,
                    group: b.group,
                    parent_dir,
                    driver: Some("pcieport".into()),
                    default_driver: Some("pcieport".into()),
                    driver_override: None,
                    model: None,
                    physfn: None,
                    vf_index: 0,
                    totalvfs: 0,
                    numvfs: 0,
                    current_vgpu: 0,
                    nvidia_minor: None,
                    vfio_dev: None,
                },
            );
        }
        let mut next_minor = 0;
        for d in &topo.devices {
            let parent_dir = match &d.bridge {
                Some(b) => bridge_dir(topo, b),
                None => root_dir(&d.address),
            };
            max_group = max_group.max(d.group);
            let model = d.model.as_deref().and_then(|m| catalogue().model(m));
            let is_nv_gpu = d.vendor == 0x10de && matches!(d.class >> 8, 0x0300 | 0x0302);
            let minor = is_nv_gpu.then(|| {
                next_minor += 1;
                next_minor - 1
            });
            devs.insert(
                d.address.clone(),
                Dev {
                    addr: d.address.clone(),
                    vendor: d.vendor,
                    device: d.device,
                    subsystem_vendor: d.subsystem_vendor,
                    subsystem_device: d.subsystem_device,
                    class: d.class,
                    numa: d.numa,
                    group: d.group,
                    parent_dir,
                    driver: d.driver.clone(),
                    default_driver: d.default_driver.clone(),
                    driver_override: None,
                    model: d.model.clone(),
                    physfn: None,
                    vf_index: 0,
                    totalvfs: model.map_or(0, |m| m.sriov_totalvfs),
                    numvfs: 0,
                    current_vgpu: 0,
                    nvidia_minor: minor,
                    vfio_dev: None,
                },
            );
        }
        let mut vfio_drivers: BTreeSet<String> = ["vfio-pci".to_string()].into();
        vfio_drivers.extend(topo.vfio_drivers.iter().cloned());
        let mut st = State {
            topo: topo.clone(),
            drivers: topo.drivers(),
            vfio_drivers,
            devs,
            mdevs: BTreeMap::new(),
            holders: Holders::new(root),
            faults: Faults::default(),
            ops: OpLog::default(),
            next_group: max_group + 1,
            next_minor,
            next_vfio_dev: 0,
            events: Vec::new(),
            dirty: BTreeSet::new(),
        };
        let addrs: Vec<String> = st.devs.keys().cloned().collect();
        for a in addrs {
            st.attach_vfio_dev(&a);
        }
        st.dirty = st.owners().collect();
        st
    }

    /// Marks a function's files for rendering again.
    fn mark(&mut self, addr: &str) {
        self.dirty.insert(Owner::Dev(addr.to_string()));
    }

    /// Marks a function and its VFs (whose vGPU types follow the PF's driver).
    fn mark_with_vfs(&mut self, addr: &str) {
        let vfs: Vec<String> = self
            .devs
            .values()
            .filter(|d| d.physfn.as_deref() == Some(addr))
            .map(|d| d.addr.clone())
            .collect();
        self.mark(addr);
        for vf in vfs {
            self.mark(&vf);
        }
    }

    /// Marks an mdev and its parent (whose type lists it).
    fn mark_mdev(&mut self, m: &Mdev) {
        self.dirty.insert(Owner::Mdev(m.uuid.clone()));
        self.mark(&m.parent);
    }

    fn alloc_group(&mut self) -> u32 {
        let g = self.next_group;
        self.next_group += 1;
        g
    }

    pub fn model_of(&self, d: &Dev) -> Option<&'static GpuModel> {
        d.model.as_deref().and_then(|m| catalogue().model(m))
    }

    fn pf_of<'a>(&'a self, d: &'a Dev) -> &'a Dev {
        d.physfn
            .as_ref()
            .and_then(|p| self.devs.get(p))
            .unwrap_or(d)
    }

    pub fn is_vfio_driver(&self, drv: Option<&String>) -> bool {
        drv.is_some_and(|d| self.vfio_drivers.contains(d))
    }

    /// vGPU types are offered while the GPU (and the VF, for VF parents) is on nvidia.
    fn vgpu_enabled(&self, d: &Dev) -> bool {
        let nv = |x: &Dev| x.driver.as_deref() == Some("nvidia");
        nv(d) && nv(self.pf_of(d))
    }

    /// mdev types and their `available_instances` when `d` is an mdev parent now.
    pub fn mdev_types(&self, d: &Dev) -> Option<Vec<(&'static VgpuTypeDef, u32)>> {
        let model = self.model_of(d)?;
        let is_vf = d.physfn.is_some();
        match model.attach {
            Attach::PfMdev if !is_vf => {}
            Attach::VfMdev if is_vf => {}
            _ => return None,
        }
        if !self.vgpu_enabled(d) {
            return None;
        }
        let types = model.offered_types();
        if !is_vf {
            let mine: Vec<&Mdev> = self.mdevs.values().filter(|m| m.parent == d.addr).collect();
            return Some(
                types
                    .map(|t| {
                        let avail = match mine.first() {
                            None => t.max,
                            Some(m) if m.type_id == t.id => {
                                let used = mine.iter().filter(|m| m.type_id == t.id).count();
                                t.max.saturating_sub(used as u32)
                            }
                            Some(_) => 0,
                        };
                        (t, avail)
                    })
                    .collect(),
            );
        }
        let pf = self.pf_of(d).addr.clone();
        let on_this_vf = self.mdevs.values().any(|m| m.parent == d.addr);
        let on_gpu: Vec<&Mdev> = self
            .mdevs
            .values()
            .filter(|m| {
                self.devs
                    .get(&m.parent)
                    .is_some_and(|p| p.physfn.as_deref() == Some(pf.as_str()))
            })
            .collect();
        let size = on_gpu
            .first()
            .and_then(|m| model.vgpu_type(m.type_id))
            .map(|t| t.framebuffer_mb);
        Some(
            types
                .map(|t| {
                    let fits = match size {
                        None => true,
                        Some(s) => t.framebuffer_mb == s && (on_gpu.len() as u32) < t.max,
                    };
                    (t, u32::from(fits && !on_this_vf))
                })
                .collect(),
        )
    }

    /// The vendor-path creatable types of a VF, when it has the `nvidia/` directory now.
    pub fn creatable(&self, d: &Dev) -> Option<Vec<&'static VgpuTypeDef>> {
        let model = self.model_of(d)?;
        if model.attach != Attach::VfVendor || d.physfn.is_none() || !self.vgpu_enabled(d) {
            return None;
        }
        if d.current_vgpu != 0 {
            return Some(Vec::new());
        }
        let set: Vec<u32> = self
            .devs
            .values()
            .filter(|v| v.physfn == d.physfn && v.current_vgpu != 0)
            .map(|v| v.current_vgpu)
            .collect();
        let size = set
            .first()
            .and_then(|id| model.vgpu_type(*id))
            .map(|t| t.framebuffer_mb);
        Some(
            model
                .offered_types()
                .filter(|t| match size {
                    None => true,
                    Some(s) => t.framebuffer_mb == s && (set.len() as u32) < t.max,
                })
                .collect(),
        )
    }

    // ---------------------------------------------------------------- events

    fn pci_event(&mut self, action: &'static str, addr: &str) {
        if let Some(d) = self.devs.get(addr) {
            self.events.push(Uevent::pci(action, d));
        }
    }

    fn mdev_event(&mut self, action: &'static str, m: &Mdev) {
        if let Some(p) = self.devs.get(&m.parent) {
            self.events.push(Uevent::mdev(action, p, m));
        }
    }

    // ---------------------------------------------------------------- writes

    /// A new GPU of catalogue `model` appears at `addr` on `nvidia` (hot-plug): in `group`, or
    /// a fresh one.
    pub fn hotplug(&mut self, addr: &str, model: &GpuModel, group: Option<u32>, numa: i32) {
        let group = group.unwrap_or_else(|| self.alloc_group());
        self.next_group = self.next_group.max(group + 1);
        let minor = self.next_minor;
        self.next_minor += 1;
        self.devs.insert(
            addr.to_string(),
            Dev {
                addr: addr.to_string(),
                vendor: 0x10de,
                device: model.device,
                subsystem_vendor: model.subsystem_vendor,
                subsystem_device: model.subsystem_device,
                class: model.class,
                numa,
                group,
                parent_dir: root_dir(addr),
                driver: Some("nvidia".into()),
                default_driver: Some("nvidia".into()),
                driver_override: None,
                model: Some(model.model.clone()),
                physfn: None,
                vf_index: 0,
                totalvfs: model.sriov_totalvfs,
                numvfs: 0,
                current_vgpu: 0,
                nvidia_minor: Some(minor),
                vfio_dev: None,
            },
        );
        self.mark(addr);
        self.pci_event("add", addr);
        self.pci_event("bind", addr);
    }

    /// Applies a write to a kernel file.
    pub fn write(&mut self, target: &WriteTarget, value: &str) -> Result<(), Errno> {
        let one_line = value.strip_suffix('\n').unwrap_or(value);
        match target {
            WriteTarget::DriverOverride(a) => {
                let d = self.devs.get_mut(a).ok_or(libc::ENODEV)?;
                d.driver_override = (!one_line.is_empty()).then(|| one_line.to_string());
                Ok(())
            }
            WriteTarget::Bind(drv) => self.bind(drv, one_line),
            WriteTarget::Unbind(drv) => self.unbind(drv, one_line),
            WriteTarget::Probe => self.probe(one_line),
            WriteTarget::SriovNumvfs(a) => self.set_numvfs(a, value.trim()),
            WriteTarget::Create { parent, type_id } => self.create(parent, *type_id, one_line),
            WriteTarget::Remove(u) => self.remove(u, value.trim()),
            WriteTarget::CurrentVgpu(a) => self.set_current_vgpu(a, value.trim()),
            WriteTarget::Ignore => Ok(()),
            WriteTarget::Control => self.control(value).map_err(|_| libc::EINVAL),
        }
    }

    fn bind(&mut self, drv: &str, bdf: &str) -> Result<(), Errno> {
        let d = self.devs.get(bdf).ok_or(libc::ENODEV)?;
        let matches = match &d.driver_override {
            Some(o) => o == drv,
            None => d.id_drivers().iter().any(|x| x == drv),
        };
        if !matches {
            return Err(libc::ENODEV);
        }
        if d.driver.is_some() {
            return Err(libc::EBUSY);
        }
        self.attach(bdf, drv);
        Ok(())
    }

    fn attach(&mut self, bdf: &str, drv: &str) {
        if let Some(d) = self.devs.get_mut(bdf) {
            d.driver = Some(drv.to_string());
        }
        self.attach_vfio_dev(bdf);
        self.mark_with_vfs(bdf);
        self.pci_event("bind", bdf);
    }

    fn attach_vfio_dev(&mut self, bdf: &str) {
        let vfio = self
            .devs
            .get(bdf)
            .is_some_and(|d| self.is_vfio_driver(d.driver.as_ref()));
        if vfio {
            let n = self.next_vfio_dev;
            if let Some(d) = self.devs.get_mut(bdf)
                && d.vfio_dev.is_none()
            {
                d.vfio_dev = Some(n);
                self.next_vfio_dev += 1;
            }
        }
    }

    fn unbind(&mut self, drv: &str, bdf: &str) -> Result<(), Errno> {
        let d = self.devs.get(bdf).ok_or(libc::ENODEV)?;
        if d.driver.as_deref() != Some(drv) {
            return Err(libc::ENODEV);
        }
        self.detach(bdf);
        Ok(())
    }

    fn detach(&mut self, bdf: &str) {
        let Some(d) = self.devs.get(bdf) else {
            return;
        };
        if d.driver.as_deref() == Some("nvidia") {
            // The vGPUs of the GPU (or VF) go with the driver.
            let affected: BTreeSet<String> = self
                .devs
                .values()
                .filter(|x| x.addr == bdf || x.physfn.as_deref() == Some(bdf))
                .map(|x| x.addr.clone())
                .collect();
            let gone: Vec<Mdev> = self
                .mdevs
                .values()
                .filter(|m| affected.contains(&m.parent))
                .cloned()
                .collect();
            for m in gone {
                self.mdev_event("remove", &m);
                self.mdevs.remove(&m.uuid);
                self.mark_mdev(&m);
            }
            for a in &affected {
                if let Some(x) = self.devs.get_mut(a) {
                    x.current_vgpu = 0;
                }
            }
        }
        self.pci_event("unbind", bdf);
        if let Some(d) = self.devs.get_mut(bdf) {
            d.driver = None;
            d.vfio_dev = None;
        }
        self.mark_with_vfs(bdf);
    }

    fn probe(&mut self, bdf: &str) -> Result<(), Errno> {
        let d = self.devs.get(bdf).ok_or(libc::ENODEV)?;
        if d.driver.is_some() {
            return Ok(());
        }
        let want = match &d.driver_override {
            Some(o) => Some(o.clone()),
            None => d.default_driver.clone(),
        };
        if let Some(w) = want
            && self.drivers.contains(&w)
        {
            self.attach(bdf, &w);
        }
        Ok(())
    }

    fn set_numvfs(&mut self, pf: &str, v: &str) -> Result<(), Errno> {
        let n: u16 = v.parse().map_err(|_| libc::EINVAL)?;
        let n = u32::from(n);
        let d = self.devs.get(pf).ok_or(libc::ENODEV)?;
        if n > d.totalvfs {
            return Err(libc::ERANGE);
        }
        if n == d.numvfs {
            return Ok(());
        }
        if !matches!(d.driver.as_deref(), Some("nvidia" | "vfio-pci")) {
            return Err(libc::ENOENT);
        }
        if n == 0 {
            self.remove_vfs(pf);
            return Ok(());
        }
        if d.numvfs != 0 {
            return Err(libc::EBUSY);
        }
        let model = self.model_of(d);
        let base = d.clone();
        let (bus, devfn) = {
            let bus = u8::from_str_radix(&pf[5..7], 16).map_err(|_| libc::EINVAL)?;
            let dev = u8::from_str_radix(&pf[8..10], 16).map_err(|_| libc::EINVAL)?;
            let func = u8::from_str_radix(&pf[11..12], 16).map_err(|_| libc::EINVAL)?;
            (u32::from(bus), u32::from(dev) * 8 + u32::from(func))
        };
        let mut created = Vec::new();
        for i in 0..n {
            let vfn = devfn + 4 + i;
            let vbus = bus + vfn / 256;
            let vfn = vfn % 256;
            let addr = format!("{}:{:02x}:{:02x}.{}", &pf[..4], vbus, vfn / 8, vfn % 8);
            let group = self.alloc_group();
            let vf = Dev {
                addr: addr.clone(),
                vendor: base.vendor,
                device: model.and_then(|m| m.vf_device).unwrap_or(base.device),
                subsystem_vendor: base.vendor,
                subsystem_device: 0,
                class: base.class,
                numa: base.numa,
                group,
                parent_dir: base.parent_dir.clone(),
                driver: base.default_driver.clone(),
                default_driver: base.default_driver.clone(),
                driver_override: None,
                model: base.model.clone(),
                physfn: Some(pf.to_string()),
                vf_index: i,
                totalvfs: 0,
                numvfs: 0,
                current_vgpu: 0,
                nvidia_minor: None,
                vfio_dev: None,
            };
            self.devs.insert(addr.clone(), vf);
            created.push(addr);
        }
        if let Some(d) = self.devs.get_mut(pf) {
            d.numvfs = n;
        }
        for a in created {
            self.mark(&a);
            self.pci_event("add", &a);
            if self.devs.get(&a).is_some_and(|d| d.driver.is_some()) {
                self.pci_event("bind", &a);
            }
        }
        Ok(())
    }

    fn remove_vfs(&mut self, pf: &str) {
        let vfs: Vec<String> = self
            .devs
            .values()
            .filter(|d| d.physfn.as_deref() == Some(pf))
            .map(|d| d.addr.clone())
            .collect();
        for vf in vfs {
            self.remove_device(&vf);
        }
        if let Some(d) = self.devs.get_mut(pf) {
            d.numvfs = 0;
        }
    }

    /// A device vanishes with its mdevs and VFs (hot-unplug, VF disable).
    pub fn remove_device(&mut self, addr: &str) {
        let vfs: Vec<String> = self
            .devs
            .values()
            .filter(|d| d.physfn.as_deref() == Some(addr))
            .map(|d| d.addr.clone())
            .collect();
        for vf in vfs {
            self.remove_device(&vf);
        }
        let gone: Vec<Mdev> = self
            .mdevs
            .values()
            .filter(|m| m.parent == addr)
            .cloned()
            .collect();
        for m in gone {
            self.mdev_event("remove", &m);
            self.mdevs.remove(&m.uuid);
            self.mark_mdev(&m);
        }
        self.mark(addr);
        if self.devs.get(addr).is_some_and(|d| d.driver.is_some()) {
            self.pci_event("unbind", addr);
        }
        self.pci_event("remove", addr);
        self.devs.remove(addr);
    }

    fn create(&mut self, parent: &str, type_id: u32, v: &str) -> Result<(), Errno> {
        let uuid = parse_uuid(v).ok_or(libc::EINVAL)?;
        if self.mdevs.contains_key(&uuid) {
            return Err(libc::EEXIST);
        }
        let d = self.devs.get(parent).ok_or(libc::ENODEV)?;
        let types = self.mdev_types(d).ok_or(libc::ENODEV)?;
        let avail = types
            .iter()
            .find(|(t, _)| t.id == type_id)
            .map(|(_, a)| *a)
            .ok_or(libc::ENODEV)?;
        if avail == 0 {
            return Err(libc::ENOSPC);
        }
        let group = self.alloc_group();
        let m = Mdev {
            uuid: uuid.clone(),
            parent: parent.to_string(),
            type_id,
            group,
        };
        self.mdevs.insert(uuid, m.clone());
        self.mark_mdev(&m);
        self.mdev_event("add", &m);
        self.mdev_event("bind", &m);
        Ok(())
    }

    fn remove(&mut self, uuid: &str, v: &str) -> Result<(), Errno> {
        let n: u64 = v.parse().map_err(|_| libc::EINVAL)?;
        if n == 0 {
            return Ok(());
        }
        let m = self.mdevs.get(uuid).cloned().ok_or(libc::ENODEV)?;
        self.mdev_event("unbind", &m);
        self.mdev_event("remove", &m);
        self.mdevs.remove(uuid);
        self.mark_mdev(&m);
        Ok(())
    }

    fn set_current_vgpu(&mut self, vf: &str, v: &str) -> Result<(), Errno> {
        let id: u32 = v.parse().map_err(|_| libc::EINVAL)?;
        let d = self.devs.get(vf).ok_or(libc::ENODEV)?;
        let creatable = self.creatable(d).ok_or(libc::ENODEV)?;
        if id == 0 {
            if let Some(d) = self.devs.get_mut(vf) {
                d.current_vgpu = 0;
            }
            self.mark(vf);
            self.pci_event("change", vf);
            return Ok(());
        }
        if d.current_vgpu != 0 {
            return Err(libc::EBUSY);
        }
        if !creatable.iter().any(|t| t.id == id) {
            return Err(libc::EINVAL);
        }
        if let Some(d) = self.devs.get_mut(vf) {
            d.current_vgpu = id;
        }
        self.mark(vf);
        self.pci_event("change", vf);
        Ok(())
    }
}

/// A UUID in the kernel's textual form, lower-cased.
pub(crate) fn parse_uuid(s: &str) -> Option<String> {
    let b = s.as_bytes();
    if b.len() != 36 {
        return None;
    }
    for (i, c) in b.iter().enumerate() {
        let ok = if matches!(i, 8 | 13 | 18 | 23) {
            *c == b'-'
        } else {
            c.is_ascii_hexdigit()
        };
        if !ok {
            return None;
        }
    }
    Some(s.to_ascii_lowercase())
}
