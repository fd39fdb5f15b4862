//! The node's PCI/VFIO/vGPU inventory and every sysfs read and write of gpu-vm-node.
//!
//! Nothing else in the project touches `/sys`, `/dev` or `/proc`: the daemons read an
//! [`Inventory`], decide, and write through [`Sysfs`]. Every path comes from one
//! [`HostPaths`] built from `--host-root`, so the same code runs on a host (`/`), in a pod
//! (`/host`) and against a simulated node (a directory).
//!
//! # Binding a GPU to vfio-pci
//!
//! The kernel's rebind sequence, as [`Sysfs`] performs it for `0000:65:00.0`:
//!
//! 1. `echo vfio-pci > /sys/bus/pci/devices/0000:65:00.0/driver_override` —
//!    [`Sysfs::set_driver_override`]. Only this device will now match vfio-pci, and no other
//!    driver will take it.
//! 2. `echo 0000:65:00.0 > /sys/bus/pci/drivers/nvidia/unbind` — [`Sysfs::unbind`]. The
//!    `driver` link disappears. For `nvidia` this blocks while the driver tears down; it hangs
//!    if a process still holds `/dev/nvidia<N>` ([`usage`] finds such holders first).
//! 3. `echo 0000:65:00.0 > /sys/bus/pci/drivers_probe` — [`Sysfs::drivers_probe`]. The kernel
//!    binds the override driver; `driver` now points at vfio-pci and `/dev/vfio/<group>` appears
//!    once every device of the IOMMU group is on a VFIO driver (or none).
//! 4. [`Sysfs::wait_for_driver`] confirms the link; the caller checks `/dev/vfio/<group>`
//!    ([`HostPaths::vfio_group_node`]).
//!
//! Giving it back: write `\n` to `driver_override` (reads `(null)` again), unbind from
//! vfio-pci, `drivers_probe` — the default driver takes the device again.
//!
//! # vGPUs
//!
//! - **mdev** (Turing on the GPU itself; Ampere on the GPU's SR-IOV VFs, enabled with
//!   [`Sysfs::set_sriov_numvfs`]): each parent lists `mdev_supported_types/<type>/` with
//!   `name` (`NVIDIA A10-4Q`) and `available_instances`. Writing a UUID to the type's `create`
//!   ([`Sysfs::mdev_create`]) makes `/sys/bus/mdev/devices/<uuid>` with its own IOMMU group and
//!   `/dev/vfio/<group>`; writing `1` to its `remove` ([`Sysfs::mdev_remove`]) deletes it.
//! - **Vendor path** (Ada, Hopper, Blackwell with recent drivers): each VF has
//!   `nvidia/creatable_vgpu_types` (`1145  : NVIDIA L40S-1B`) and `nvidia/current_vgpu_type`;
//!   writing a type id creates the vGPU on that VF, `0` deletes it
//!   ([`Sysfs::set_current_vgpu_type`]). The VF itself is then what a VM is given.
//!
//! # In use
//!
//! Before any of these writes takes a device from someone, the daemons ask [`Usage`]: a
//! process holding the device's `/dev/vfio/<group>`, VFIO cdev or `/dev/nvidia<N>`, a pod
//! kubelet runs with it (kubelet's PodResources API, or its checkpoint while kubelet is down),
//! or a source that cannot be read (unknown, which counts as in use).
//!
//! # Following changes
//!
//! sysfs emits no inotify events: the kernel announces changes as uevents, which
//! [`uevent::Monitor`] hears and turns into the device each names. A reader that keeps an
//! [`Inventory`] re-reads just that device ([`Inventory::refresh_pci`],
//! [`Inventory::refresh_mdev`]) or group node ([`Inventory::refresh_vfio_node`]) instead of the
//! node.
//!
//! # Node state
//!
//! What the daemons keep on the host themselves (readiness files, pools, the records of vGPUs
//! made, original drivers and claims) is read and written through [`state`], which replaces
//! every file atomically and versions every record ([`state::FILES`] lists them).
//!
//! Writes block while drivers probe: call this crate from async code via `spawn_blocking`.
#![warn(missing_docs)]

pub mod error;
pub mod inventory;
pub mod naming;
pub mod ops;
pub mod paths;
pub mod pci;
pub mod process;
pub mod state;
pub mod uevent;
pub mod usage;
pub mod vfio;
pub mod vgpu;

pub use error::{Error, Result, error_chain};
pub use inventory::{
    DevNodes, Inventory, MdevDevice, MdevParent, MdevType, NvidiaVgpu, PciDevice, ReadOptions,
    Unreadable, VgpuType, is_vfio_driver,
};
pub use naming::{IdsSource, PciIds, env_var_name, passthrough_resource_name, vgpu_resource_name};
pub use ops::Sysfs;
pub use paths::{HostPaths, host_vfio_group_path};
pub use pci::{PciAddress, VendorSelector, parse_hex16};
pub use usage::{Usage, Use, User};
