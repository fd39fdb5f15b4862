//! The scheduler's counter arithmetic on published ResourceSlices (partitionable devices,
//! `resource.k8s.io/v1`), for tests: a model of the rule kube-scheduler's DRA allocator applies,
//! not its code. A device can be allocated when no claim holds it and, for every counter it
//! consumes (`consumesCounters`), the counter's value in its pool's counter set
//! (`sharedCounters`) minus what the allocated devices consume of it is at least what it
//! consumes. Only the slices of a pool's highest generation count, as for the scheduler.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

/// A quantity as an integer: `24Gi`, `4096Mi`, `32`.
pub fn quantity(q: &str) -> Option<i128> {
    let q = q.trim();
    let split = q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len());
    let (n, unit) = q.split_at(split);
    let n: i128 = n.parse().ok()?;
    let mult: i128 = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        _ => return None,
    };
    Some(n * mult)
}

/// One pool's devices and counters, and what is allocated.
#[derive(Debug, Default)]
pub struct Allocator {
    counters: BTreeMap<String, BTreeMap<String, i128>>,
    devices: BTreeMap<String, Value>,
    allocated: BTreeSet<String>,
}

impl Allocator {
    /// The pool `pool` of `slices` (the API server's objects), at its highest generation.
    pub fn from_slices(slices: &[Value], pool: &str) -> Allocator {
        let ours: Vec<&Value> = slices
            .iter()
            .filter(|s| s["spec"]["pool"]["name"] == pool)
            .collect();
        let newest = ours
            .iter()
            .filter_map(|s| s["spec"]["pool"]["generation"].as_i64())
            .max()
            .unwrap_or(0);
        let mut a = Allocator::default();
        for s in ours
            .into_iter()
            .filter(|s| s["spec"]["pool"]["generation"].as_i64() == Some(newest))
        {
            for set in s["spec"]["sharedCounters"].as_array().into_iter().flatten() {
                let mut cs = BTreeMap::new();
                for (k, v) in set["counters"].as_object().into_iter().flatten() {
                    if let Some(n) = v["value"].as_str().and_then(quantity) {
                        cs.insert(k.clone(), n);
                    }
                }
                a.counters
                    .insert(set["name"].as_str().unwrap_or_default().to_string(), cs);
            }
            for d in s["spec"]["devices"].as_array().into_iter().flatten() {
                a.devices.insert(
                    d["name"].as_str().unwrap_or_default().to_string(),
                    d.clone(),
                );
            }
        }
        a
    }

    /// The device named `name`.
    pub fn device(&self, name: &str) -> Option<&Value> {
        self.devices.get(name)
    }

    /// Every device name, in order.
    pub fn names(&self) -> Vec<&str> {
        self.devices.keys().map(String::as_str).collect()
    }

    /// The counter sets: set → counter → value.
    pub fn counter_sets(&self) -> &BTreeMap<String, BTreeMap<String, i128>> {
        &self.counters
    }

    fn consumption(d: &Value) -> Vec<(String, String, i128)> {
        let mut out = Vec::new();
        for c in d["consumesCounters"].as_array().into_iter().flatten() {
            let set = c["counterSet"].as_str().unwrap_or_default();
            for (k, v) in c["counters"].as_object().into_iter().flatten() {
                let n = v["value"].as_str().and_then(quantity).unwrap_or(0);
                out.push((set.to_string(), k.clone(), n));
            }
        }
        out
    }

    /// Why `name` cannot be allocated now, or `None` when it can.
    pub fn refusal(&self, name: &str) -> Option<String> {
        let Some(d) = self.devices.get(name) else {
            return Some(format!("no device {name}"));
        };
        if self.allocated.contains(name) {
            return Some(format!("{name} is allocated"));
        }
        for (set, counter, want) in Self::consumption(d) {
            let Some(total) = self.counters.get(&set).and_then(|c| c.get(&counter)) else {
                return Some(format!(
                    "{name} consumes {set}/{counter}, which no slice offers"
                ));
            };
            let used: i128 = self
                .allocated
                .iter()
                .filter_map(|a| self.devices.get(a))
                .flat_map(Self::consumption)
                .filter(|(s, c, _)| *s == set && *c == counter)
                .map(|(_, _, n)| n)
                .sum();
            if used + want > *total {
                return Some(format!(
                    "{name} needs {want} of {set}/{counter}: {used} of {total} in use"
                ));
            }
        }
        None
    }

    /// Allocates `name`, or says why not.
    pub fn allocate(&mut self, name: &str) -> Result<(), String> {
        match self.refusal(name) {
            Some(why) => Err(why),
            None => {
                self.allocated.insert(name.to_string());
                Ok(())
            }
        }
    }

    /// The first device (in name order) `pred` takes that can be allocated, allocated.
    pub fn allocate_first(&mut self, pred: impl Fn(&Value) -> bool) -> Option<String> {
        let name = self
            .devices
            .iter()
            .filter(|(_, d)| pred(d))
            .map(|(n, _)| n.clone())
            .find(|n| self.refusal(n).is_none())?;
        self.allocated.insert(name.clone());
        Some(name)
    }

    /// Frees `name`.
    pub fn release(&mut self, name: &str) {
        self.allocated.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn counters_bound_what_is_allocated() {
        let slices = vec![
            json!({"spec": {"pool": {"name": "n", "generation": 2}, "sharedCounters": [
                {"name": "g", "counters": {"memory": {"value": "8Gi"}}}]}}),
            json!({"spec": {"pool": {"name": "n", "generation": 2}, "devices": [
                {"name": "half-0", "consumesCounters": [{"counterSet": "g", "counters": {"memory": {"value": "4Gi"}}}]},
                {"name": "half-1", "consumesCounters": [{"counterSet": "g", "counters": {"memory": {"value": "4Gi"}}}]},
                {"name": "whole", "consumesCounters": [{"counterSet": "g", "counters": {"memory": {"value": "8Gi"}}}]}]}}),
            json!({"spec": {"pool": {"name": "n", "generation": 1}, "devices": [{"name": "old"}]}}),
        ];
        let mut a = Allocator::from_slices(&slices, "n");
        assert_eq!(a.names(), ["half-0", "half-1", "whole"]);
        a.allocate("half-0").unwrap();
        assert!(
            a.allocate("whole")
                .unwrap_err()
                .contains("4294967296 of 8589934592")
        );
        a.allocate("half-1").unwrap();
        a.release("half-0");
        a.release("half-1");
        a.allocate("whole").unwrap();
        assert_eq!(a.allocate_first(|_| true), None);
    }
}
