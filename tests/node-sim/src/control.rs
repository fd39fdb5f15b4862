//! Control commands (`sys/kernel/node-sim/control`, `Sim::control`): outside the simulated
//! kernel, they inject faults, stand in for VMs holding groups and hot-plug GPUs.

use crate::catalogue::catalogue;
use crate::state::State;
use crate::topology::parse_bdf;

/// What reading `sys/kernel/node-sim/control` shows.
pub(crate) const CONTROL_HELP: &str = "\
# node-sim control: write one command per write.
#   fault <op> <BDF|uuid|*> <ERRNO|delay=MS|after=MS> [count=N]
#       delay: the write takes effect after MS; after: at once, answered after MS
#       op: bind unbind probe driver_override create remove sriov_numvfs current_vgpu_type
#   clear-faults
#   hold <group> [pid=N] [comm=NAME]      a synthetic VM holding /dev/vfio/<group>
#   release <group>
#   hotplug <BDF> <model> [group=G] [numa=N]
#   unplug <BDF>
#   clear-ops
";

impl State {
    /// Runs control commands (one per line). The error says what is wrong.
    pub fn control(&mut self, text: &str) -> Result<(), String> {
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            self.control_one(line)?;
        }
        Ok(())
    }

    fn control_one(&mut self, line: &str) -> Result<(), String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let (positional, opts): (Vec<&str>, Vec<&str>) =
            words.iter().skip(1).partition(|w| !w.contains('='));
        let opt = |k: &str| {
            opts.iter()
                .find_map(|o| o.strip_prefix(k).and_then(|r| r.strip_prefix('=')))
        };
        let bad = |why: &str| format!("{line:?}: {why}");
        let number = |v: &str, what: &str| {
            v.parse::<u32>()
                .map_err(|_| bad(&format!("{what} is not a number")))
        };
        match words.first().copied() {
            Some("fault") => self
                .faults
                .add(&positional, opt("delay"), opt("after"), opt("count"))
                .map_err(|e| bad(&e))?,
            Some("clear-faults") => self.faults.clear(),
            Some("clear-ops") => self.ops.clear(),
            Some("hold") => {
                let [g] = positional.as_slice() else {
                    return Err(bad("usage: hold <group> [pid=N] [comm=NAME]"));
                };
                let g = number(g, "group")?;
                let pid = opt("pid").map(|p| number(p, "pid")).transpose()?;
                let comm = opt("comm").unwrap_or("qemu-kvm");
                self.holders.hold(g, pid, comm).map_err(|e| bad(&e))?;
            }
            Some("release") => {
                let [g] = positional.as_slice() else {
                    return Err(bad("usage: release <group>"));
                };
                let g = number(g, "group")?;
                self.holders.release_synthetic(g).map_err(|e| bad(&e))?;
            }
            Some("hotplug") => {
                let [bdf, model] = positional.as_slice() else {
                    return Err(bad("usage: hotplug <BDF> <model> [group=G] [numa=N]"));
                };
                let addr = parse_bdf(bdf).ok_or_else(|| bad("not a PCI address"))?;
                if self.devs.contains_key(&addr) {
                    return Err(bad("address exists"));
                }
                let model = catalogue()
                    .model(model)
                    .ok_or_else(|| bad("unknown model"))?;
                let group = opt("group").map(|g| number(g, "group")).transpose()?;
                let numa = opt("numa")
                    .map(|n| n.parse().map_err(|_| bad("numa is not a number")))
                    .transpose()?
                    .unwrap_or(0);
                self.hotplug(&addr, model, group, numa);
            }
            Some("unplug") => {
                let [bdf] = positional.as_slice() else {
                    return Err(bad("usage: unplug <BDF>"));
                };
                let addr = parse_bdf(bdf).ok_or_else(|| bad("not a PCI address"))?;
                if !self.devs.contains_key(&addr) {
                    return Err(bad("no such device"));
                }
                self.remove_device(&addr);
            }
            _ => {
                return Err(bad(
                    "unknown command; one of fault, clear-faults, hold, release, hotplug, unplug, clear-ops",
                ));
            }
        }
        Ok(())
    }
}
