//! What a pass writes: the node's slices as the API server holds them (the cache) against the
//! slices the node's devices make, and each pool's generation to write them at. Each pool (the
//! node's, and each GPU's of the vGPU pool) is planned alone, as follows; the slices of a pool
//! the node no longer has are deleted.
//!
//! - Nothing differs: nothing is written, and the generation found is adopted (a restarted
//!   driver keeps its predecessor's).
//! - The slices of the highest generation found all say what the node has now, and that
//!   generation is not below the last one this process wrote: the rest of the pool is written
//!   at that generation. This finishes a generation a pass began and could not end (its time
//!   ran out, a write failed) and puts back what another client deleted, without rewriting the
//!   slices that are already right.
//! - The pool keeps its slices (the same names, all at one generation not below the last one
//!   this process wrote) and one of them changed: that slice alone is written, at the
//!   generation it has. One write cannot show the scheduler a mix of old and new slices, so the
//!   rest need not move (a GPU's health or attributes, a passthrough node's one slice).
//! - Otherwise the pool changed: every slice is written at one generation above the highest
//!   seen (found, or written by this process), so the scheduler takes the new slices over any
//!   older copy and never mixes two generations of the pool.
//!
//! Either way, slices of this node and driver that are not among the node's are deleted.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

/// The writes that make the API server's slices the node's.
#[derive(Debug, PartialEq)]
pub struct Plan {
    /// Each pool's generation once the plan is carried out.
    pub generations: BTreeMap<String, i64>,
    /// The slices to apply, each at its pool's generation.
    pub apply: Vec<ResourceSlice>,
    /// The names of the slices to delete, each with the resourceVersion it had in the cache.
    pub delete: Vec<(String, Option<String>)>,
}

impl Plan {
    /// Whether the API server already holds the node's slices.
    pub fn is_empty(&self) -> bool {
        self.apply.is_empty() && self.delete.is_empty()
    }
}

/// One pool's writes.
#[derive(Debug, PartialEq)]
struct PoolPlan {
    generation: i64,
    apply: Vec<ResourceSlice>,
    delete: Vec<(String, Option<String>)>,
}

fn pool_name(s: &ResourceSlice) -> &str {
    &s.spec.pool.name
}

/// The writes that make `current` (the node's slices of this driver in the cache) `wanted`
/// (their generations ignored), pool by pool; `last` is the highest generation of each pool
/// this process wrote or adopted.
pub fn plan(
    current: &[ResourceSlice],
    wanted: Vec<ResourceSlice>,
    last: &BTreeMap<String, i64>,
) -> Plan {
    let mut pools: BTreeMap<String, Vec<ResourceSlice>> = BTreeMap::new();
    for w in wanted {
        pools.entry(pool_name(&w).to_string()).or_default().push(w);
    }
    let mut out = Plan {
        generations: BTreeMap::new(),
        apply: Vec::new(),
        delete: Vec::new(),
    };
    for (pool, wanted) in pools {
        let of_pool: Vec<ResourceSlice> = current
            .iter()
            .filter(|c| pool_name(c) == pool)
            .cloned()
            .collect();
        let p = plan_pool(&of_pool, wanted, last.get(&pool).copied().unwrap_or(0));
        out.generations.insert(pool, p.generation);
        out.apply.extend(p.apply);
        out.delete.extend(p.delete);
    }
    for c in current {
        if !out.generations.contains_key(pool_name(c))
            && let Some(name) = c.metadata.name.clone()
        {
            out.delete.push((name, c.metadata.resource_version.clone()));
        }
    }
    out
}

/// What a slice says, the generation left out, and the time each device taint was added (the
/// API server sets it on the taints the driver writes without one).
fn content(
    s: &ResourceSlice,
) -> (
    Option<&str>,
    ResourceSliceSpec,
    Option<&Vec<OwnerReference>>,
) {
    let mut spec = s.spec.clone();
    spec.pool.generation = 0;
    // The API server stores no device list for an empty one.
    if spec.devices.as_ref().is_some_and(Vec::is_empty) {
        spec.devices = None;
    }
    for d in spec.devices.iter_mut().flatten() {
        for t in d.taints.iter_mut().flatten() {
            t.time_added = None;
        }
    }
    (
        s.metadata.name.as_deref(),
        spec,
        s.metadata.owner_references.as_ref(),
    )
}

fn generation(s: &ResourceSlice) -> i64 {
    s.spec.pool.generation
}

/// The writes that make `current` (one pool's slices in the cache) `wanted` (their generation
/// ignored); `last` is the pool's highest generation this process wrote or adopted.
fn plan_pool(current: &[ResourceSlice], mut wanted: Vec<ResourceSlice>, last: i64) -> PoolPlan {
    let named = |name: Option<&str>| current.iter().find(|c| c.metadata.name.as_deref() == name);
    let top = current.iter().map(generation).max();
    let resume = top.is_some_and(|top| {
        top >= last
            && current.iter().filter(|c| generation(c) == top).all(|c| {
                wanted
                    .iter()
                    .any(|w| w.metadata.name == c.metadata.name && content(w) == content(c))
            })
    });
    let generation_now = match top {
        Some(top) if resume || one_change(current, &wanted, top, last) => top,
        _ => top.unwrap_or(0).max(last) + 1,
    };
    for w in &mut wanted {
        w.spec.pool.generation = generation_now;
    }
    let delete = current
        .iter()
        .filter(|c| !wanted.iter().any(|w| w.metadata.name == c.metadata.name))
        .filter_map(|c| {
            let name = c.metadata.name.clone()?;
            Some((name, c.metadata.resource_version.clone()))
        })
        .collect();
    let apply = wanted
        .into_iter()
        .filter(|w| {
            !named(w.metadata.name.as_deref())
                .is_some_and(|c| generation(c) == generation_now && content(c) == content(w))
        })
        .collect();
    PoolPlan {
        generation: generation_now,
        apply,
        delete,
    }
}

/// Whether `current`, every slice at generation `top` (not below `last`), has the slices
/// `wanted` names and exactly one of them says something else.
fn one_change(current: &[ResourceSlice], wanted: &[ResourceSlice], top: i64, last: i64) -> bool {
    if top < last || current.len() != wanted.len() || current.iter().any(|c| generation(c) != top) {
        return false;
    }
    let mut changed = 0;
    for w in wanted {
        match current.iter().find(|c| c.metadata.name == w.metadata.name) {
            Some(c) if content(c) == content(w) => {}
            Some(_) => changed += 1,
            None => return false,
        }
    }
    changed == 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{Device, ResourcePool};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    /// Slice `name` at `generation` holding devices `devices`, of a pool of `count` slices.
    fn slice(name: &str, generation: i64, count: i64, devices: &[&str]) -> ResourceSlice {
        ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                resource_version: Some(format!("{generation}0")),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: "gpu.example.com".into(),
                node_name: Some("node-a".into()),
                pool: ResourcePool {
                    name: "node-a".into(),
                    generation,
                    resource_slice_count: count,
                },
                devices: Some(
                    devices
                        .iter()
                        .map(|d| Device {
                            name: (*d).into(),
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            },
        }
    }

    /// What the node has: slices `a` and `b` of `devices` each (generation 0: not chosen yet).
    fn wanted(a: &[&str], b: &[&str]) -> Vec<ResourceSlice> {
        let mut w = vec![slice("a", 0, 2, a), slice("b", 0, 2, b)];
        for s in &mut w {
            s.metadata.resource_version = None;
        }
        w
    }

    fn names(p: &PoolPlan) -> Vec<(&str, i64)> {
        p.apply
            .iter()
            .map(|s| (s.metadata.name.as_deref().unwrap_or(""), generation(s)))
            .collect()
    }

    #[test]
    fn nothing_differs_nothing_is_written_and_the_generation_is_adopted() {
        let current = [slice("a", 7, 2, &["x"]), slice("b", 7, 2, &["y"])];
        let p = plan_pool(&current, wanted(&["x"], &["y"]), 0);
        assert!(p.apply.is_empty() && p.delete.is_empty(), "{p:?}");
        assert_eq!(p.generation, 7);
    }

    #[test]
    fn a_change_to_one_slice_writes_that_slice_at_its_generation() {
        let current = [slice("a", 7, 2, &["x"]), slice("b", 7, 2, &["y"])];
        let p = plan_pool(&current, wanted(&["x", "z"], &["y"]), 7);
        assert_eq!(names(&p), [("a", 7)]);
        assert_eq!(p.generation, 7);
        assert!(p.delete.is_empty());
        // A passthrough node's one slice.
        let p = plan_pool(
            &[slice("a", 3, 1, &["x"])],
            vec![slice("a", 0, 1, &["w"])],
            3,
        );
        assert_eq!(names(&p), [("a", 3)]);
    }

    #[test]
    fn a_change_to_more_slices_rewrites_every_slice_one_generation_up() {
        let current = [
            slice("a", 7, 3, &["x"]),
            slice("b", 7, 3, &["y"]),
            slice("c", 7, 3, &["w"]),
        ];
        let mut w = wanted(&["x", "z"], &["y", "v"]);
        w.iter_mut()
            .for_each(|s| s.spec.pool.resource_slice_count = 3);
        w.push(slice("c", 0, 3, &["w"]));
        let p = plan_pool(&current, w, 7);
        assert_eq!(names(&p), [("a", 8), ("b", 8), ("c", 8)]);
        assert!(p.delete.is_empty());
        // One slice changed, but the pool is behind what this process wrote: it moves on.
        let current = [slice("a", 7, 2, &["x"]), slice("b", 7, 2, &["y"])];
        let p = plan_pool(&current, wanted(&["x", "z"], &["y"]), 9);
        assert_eq!(names(&p), [("a", 10), ("b", 10)]);
    }

    #[test]
    fn a_generation_begun_and_not_finished_is_finished_at_that_generation() {
        // A pass wrote `a` at 8 and ran out of time before `b`.
        let current = [slice("a", 8, 2, &["x", "z"]), slice("b", 7, 2, &["y"])];
        let p = plan_pool(&current, wanted(&["x", "z"], &["y"]), 8);
        assert_eq!(names(&p), [("b", 8)]);
        // The node changed again meanwhile: the pool moves on.
        let p = plan_pool(&current, wanted(&["x"], &["y"]), 8);
        assert_eq!(names(&p), [("a", 9), ("b", 9)]);
    }

    #[test]
    fn slices_deleted_by_another_client_come_back_above_any_generation_seen() {
        // Every slice gone (kubelet's wipe): one above the last written.
        let p = plan_pool(&[], wanted(&["x"], &["y"]), 8);
        assert_eq!(names(&p), [("a", 9), ("b", 9)]);
        // One of them gone: the other is still right, the missing one is put back beside it.
        let p = plan_pool(&[slice("a", 8, 2, &["x"])], wanted(&["x"], &["y"]), 8);
        assert_eq!(names(&p), [("b", 8)]);
        // What is left is older than what this process wrote: all of it, one above.
        let p = plan_pool(&[slice("a", 5, 2, &["x"])], wanted(&["x"], &["y"]), 8);
        assert_eq!(names(&p), [("a", 9), ("b", 9)]);
    }

    #[test]
    fn slices_not_published_any_more_are_deleted_and_the_rest_moves_on() {
        let current = [
            slice("a", 3, 3, &["x"]),
            slice("b", 3, 3, &["y"]),
            slice("c", 3, 3, &["w"]),
        ];
        let p = plan_pool(&current, wanted(&["x"], &["y"]), 3);
        assert_eq!(p.delete, [("c".to_string(), Some("30".to_string()))]);
        // The count of the pool's slices changed: every slice says so.
        assert_eq!(names(&p), [("a", 4), ("b", 4)]);
    }

    #[test]
    fn each_pool_is_planned_alone_and_a_pool_gone_is_deleted() {
        let in_pool = |pool: &str, mut s: ResourceSlice| {
            s.spec.pool.name = pool.into();
            s
        };
        let current = [
            in_pool("node-a", slice("a", 7, 1, &["x"])),
            in_pool("node-a/gpu-1", slice("g1", 2, 1, &["y"])),
            in_pool("node-a/gpu-2", slice("g2", 5, 1, &["z"])),
        ];
        let wanted = vec![
            in_pool("node-a", slice("a", 0, 1, &["x"])),
            in_pool("node-a/gpu-1", slice("g1", 0, 2, &["y", "v"])),
            in_pool("node-a/gpu-1", slice("g1-counters", 0, 2, &[])),
        ];
        let last = BTreeMap::from([("node-a/gpu-1".to_string(), 3)]);
        let p = plan(&current, wanted, &last);
        // The node's pool is right: not written. GPU 1's pool changed: one above the last
        // written. GPU 2's pool is gone: deleted.
        let applied: Vec<(&str, &str, i64)> = p
            .apply
            .iter()
            .map(|s| {
                (
                    pool_name(s),
                    s.metadata.name.as_deref().unwrap_or(""),
                    generation(s),
                )
            })
            .collect();
        assert_eq!(
            applied,
            [
                ("node-a/gpu-1", "g1", 4),
                ("node-a/gpu-1", "g1-counters", 4)
            ]
        );
        assert_eq!(p.delete, [("g2".to_string(), Some("50".to_string()))]);
        assert_eq!(
            p.generations,
            BTreeMap::from([("node-a".to_string(), 7), ("node-a/gpu-1".to_string(), 4)])
        );
    }
}
