//! The API server as the publisher knows it without asking: this node's ResourceSlices of this
//! driver, followed by a kube-runtime reflector (one list, then a watch with a field selector),
//! and the writes of this process the watch has not shown yet.
//!
//! A write's answer comes before the watch shows it: until then the cache holds the slice as
//! the write left it (client-go's mutation cache does the same for the upstream ResourceSlice
//! controller), so a pass right after a write does not write it again. The watch shows the
//! write once it delivers that slice at the write's resourceVersion or later (resourceVersions
//! compared as integers, as that mutation cache does; a server whose versions are not integers
//! gets no such overlay, and at worst a slice written twice); a write the watch has not shown
//! within [`PENDING_TTL`] is forgotten, and the cache is what the watch says.
//!
//! Whether an event is this process's own write echoed, or another client's change (a slice
//! deleted or edited, kubelet's wipe of the node's slices at its start, the garbage collector's
//! after the Node was deleted): only the latter asks for a pass.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher::Event;
use tokio::time::Instant;

/// How long a write of this process may go unseen on the watch before the cache forgets it.
pub const PENDING_TTL: Duration = Duration::from_secs(60);

/// A write of this process the watch has not shown yet.
#[derive(Debug)]
enum Pending {
    /// Applied: the slice as the API server answered.
    Applied {
        version: u64,
        slice: Box<ResourceSlice>,
        at: Instant,
    },
    /// Deleted at this resourceVersion (the one it had when it was deleted).
    Deleted { version: u64, at: Instant },
}

impl Pending {
    fn at(&self) -> Instant {
        match self {
            Pending::Applied { at, .. } | Pending::Deleted { at, .. } => *at,
        }
    }
}

fn version(s: &ResourceSlice) -> Option<u64> {
    s.metadata.resource_version.as_deref()?.parse().ok()
}

fn name(s: &ResourceSlice) -> Option<&str> {
    s.metadata.name.as_deref()
}

/// See the [module](self).
#[derive(Debug)]
pub struct Cache {
    slices: Store<ResourceSlice>,
    listed: bool,
    /// Writes the slice watch has not shown yet, by slice name.
    pending: BTreeMap<String, Pending>,
}

impl Cache {
    /// A cache over the reflector's store.
    pub fn new(slices: Store<ResourceSlice>) -> Cache {
        Cache {
            slices,
            listed: false,
            pending: BTreeMap::new(),
        }
    }

    /// Whether the slices have been listed once: before that, the cache cannot say what is
    /// there.
    pub fn listed(&self) -> bool {
        self.listed
    }

    /// The node's slices as the API server holds them, this process's writes included, by name.
    pub fn slices(&mut self) -> Vec<ResourceSlice> {
        let now = Instant::now();
        self.pending
            .retain(|_, p| now.duration_since(p.at()) < PENDING_TTL);
        let mut by_name: BTreeMap<String, ResourceSlice> = self
            .slices
            .state()
            .iter()
            .filter_map(|s| Some((name(s)?.to_string(), (**s).clone())))
            .collect();
        for (n, p) in &self.pending {
            let stored = by_name.get(n).and_then(version);
            match p {
                Pending::Applied {
                    version: v, slice, ..
                } => {
                    if stored.is_none_or(|s| s < *v) {
                        by_name.insert(n.clone(), (**slice).clone());
                    }
                }
                Pending::Deleted { version: v, .. } => {
                    if stored.is_some_and(|s| s <= *v) {
                        by_name.remove(n);
                    }
                }
            }
        }
        by_name.into_values().collect()
    }

    /// This process applied a slice; `slice` is the API server's answer.
    pub fn applied(&mut self, slice: ResourceSlice) {
        let (Some(n), Some(v)) = (name(&slice).map(str::to_string), version(&slice)) else {
            return;
        };
        let stored = self
            .slices
            .get(&ObjectRef::new(&n))
            .and_then(|s| version(&s));
        if stored.is_some_and(|s| s >= v) {
            // Nothing changed on the server (or the watch showed it already).
            self.pending.remove(&n);
            return;
        }
        self.pending.insert(
            n,
            Pending::Applied {
                version: v,
                slice: Box::new(slice),
                at: Instant::now(),
            },
        );
    }

    /// This process deleted slice `n`, whose resourceVersion was `was` (or found it gone).
    pub fn deleted(&mut self, n: &str, was: Option<&str>) {
        match was.and_then(|v| v.parse().ok()) {
            Some(version) => {
                self.pending.insert(
                    n.to_string(),
                    Pending::Deleted {
                        version,
                        at: Instant::now(),
                    },
                );
            }
            None => {
                self.pending.remove(n);
            }
        }
    }

    /// Takes in an event of the slice watch (the store already has it); whether it is another
    /// client's change, for which a pass is due.
    pub fn slice_event(&mut self, ev: &Event<ResourceSlice>) -> bool {
        let (s, deleted) = match ev {
            Event::Init | Event::InitApply(_) => return false,
            Event::InitDone => {
                self.listed = true;
                self.forget_shown();
                return true;
            }
            Event::Apply(s) => (s, false),
            Event::Delete(s) => (s, true),
        };
        let Some(n) = name(s) else { return false };
        let v = version(s);
        let Some(p) = self.pending.get(n) else {
            return true;
        };
        let (ours, shown) = match (p, deleted) {
            // The write itself, or a later change.
            (Pending::Applied { version: w, .. }, false) => {
                (v == Some(*w), v.is_some_and(|v| v >= *w))
            }
            // Deleted after the write (or the slice it replaced, deleted before it: older).
            (Pending::Applied { version: w, .. }, true) => (false, v.is_some_and(|v| v >= *w)),
            // The delete itself.
            (Pending::Deleted { .. }, true) => (true, true),
            // Written again after the delete, or an older change.
            (Pending::Deleted { version: w, .. }, false) => (false, v.is_some_and(|v| v > *w)),
        };
        if shown {
            self.pending.remove(n);
        }
        shown && !ours
    }

    /// After a list: the writes it shows are no longer pending.
    fn forget_shown(&mut self) {
        let slices = &self.slices;
        self.pending.retain(|n, p| {
            let stored = slices.get(&ObjectRef::new(n)).and_then(|s| version(&s));
            match p {
                Pending::Applied { version: w, .. } => stored.is_none_or(|s| s < *w),
                Pending::Deleted { version: w, .. } => stored.is_some_and(|s| s <= *w),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use kube::runtime::reflector::store;

    fn slice(name: &str, rv: u64, generation: i64) -> ResourceSlice {
        let mut s = ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                resource_version: Some(rv.to_string()),
                ..Default::default()
            },
            ..Default::default()
        };
        s.spec.pool.generation = generation;
        s
    }

    struct Fixture {
        cache: Cache,
        slices: kube::runtime::reflector::store::Writer<ResourceSlice>,
    }

    impl Fixture {
        fn new() -> Fixture {
            let (sr, sw) = store();
            Fixture {
                cache: Cache::new(sr),
                slices: sw,
            }
        }

        /// Delivers a slice event as the reflector does: the store first.
        fn slice(&mut self, ev: Event<ResourceSlice>) -> bool {
            self.slices.apply_watcher_event(&ev);
            self.cache.slice_event(&ev)
        }

        fn listed(&mut self, slices: Vec<ResourceSlice>) {
            assert!(!self.slice(Event::Init));
            for s in slices {
                assert!(!self.slice(Event::InitApply(s)));
            }
            assert!(self.slice(Event::InitDone), "a list asks for a pass");
        }

        fn generations(&mut self) -> Vec<(String, i64)> {
            self.cache
                .slices()
                .iter()
                .map(|s| (name(s).unwrap_or("").to_string(), s.spec.pool.generation))
                .collect()
        }
    }

    #[test]
    fn not_listed_until_the_watch_listed() {
        let mut f = Fixture::new();
        assert!(!f.cache.listed());
        f.listed(vec![]);
        assert!(f.cache.listed());
    }

    #[test]
    fn a_write_is_in_the_cache_before_the_watch_shows_it_and_its_echo_asks_for_nothing() {
        let mut f = Fixture::new();
        f.listed(vec![slice("a", 10, 1)]);
        f.cache.applied(slice("a", 12, 2));
        assert_eq!(f.generations(), [("a".to_string(), 2)]);
        // An older change on the watch (before the write): the write still stands.
        assert!(!f.slice(Event::Apply(slice("a", 11, 1))));
        assert_eq!(f.generations(), [("a".to_string(), 2)]);
        // The write itself: no pass.
        assert!(!f.slice(Event::Apply(slice("a", 12, 2))));
        assert_eq!(f.generations(), [("a".to_string(), 2)]);
        // Another client's edit after it: a pass.
        assert!(f.slice(Event::Apply(slice("a", 13, 1))));
        assert_eq!(f.generations(), [("a".to_string(), 1)]);
    }

    #[test]
    fn a_slice_deleted_after_this_process_wrote_it_is_gone_from_the_cache() {
        let mut f = Fixture::new();
        f.listed(vec![]);
        f.cache.applied(slice("a", 12, 2));
        assert_eq!(f.generations(), [("a".to_string(), 2)]);
        // kubelet's wipe, seen before the write's own event ever came.
        assert!(f.slice(Event::Delete(slice("a", 14, 2))));
        assert_eq!(f.generations(), []);
    }

    #[test]
    fn a_delete_hides_the_slice_until_its_echo_and_a_later_create_shows_again() {
        let mut f = Fixture::new();
        f.listed(vec![slice("old", 10, 1)]);
        f.cache.deleted("old", Some("10"));
        assert_eq!(f.generations(), []);
        assert!(!f.slice(Event::Delete(slice("old", 11, 1))), "the echo");
        assert_eq!(f.generations(), []);
        assert!(f.slice(Event::Apply(slice("old", 12, 1))), "created again");
        assert_eq!(f.generations(), [("old".to_string(), 1)]);
    }

    #[test]
    fn a_write_unseen_for_long_is_forgotten() {
        let mut f = Fixture::new();
        f.listed(vec![slice("a", 10, 1)]);
        f.cache.applied(slice("a", 12, 2));
        if let Some(Pending::Applied { at, .. }) = f.cache.pending.get_mut("a") {
            *at = Instant::now()
                .checked_sub(PENDING_TTL + Duration::from_secs(1))
                .unwrap_or_else(Instant::now);
        }
        assert_eq!(f.generations(), [("a".to_string(), 1)]);
    }

    #[test]
    fn a_list_after_the_write_ends_its_wait() {
        let mut f = Fixture::new();
        f.listed(vec![]);
        f.cache.applied(slice("a", 12, 2));
        f.listed(vec![slice("a", 12, 2)]);
        assert!(f.cache.pending.is_empty());
        // A list that predates the write keeps it.
        f.cache.applied(slice("a", 15, 3));
        f.listed(vec![slice("a", 12, 2)]);
        assert_eq!(f.generations(), [("a".to_string(), 3)]);
    }
}
