//! One shape for the daemons' reconcile loops: a [`Trigger`] that says when to make a pass, and
//! backoff after a pass that failed.
//!
//! A daemon keeps the node (or its API objects) the way it wants them by passes: read, compare,
//! write. [`Trigger::wait`] returns when a pass is due, with what asked for it ([`Wake`]):
//!
//! - the first call: the pass at start (unless [`Settings::without_first_pass`]);
//! - changes sent through a [`Changes`] handle, from any thread (the uevent thread, a file
//!   watcher's thread, a task). A change waits [`Settings::settle`] for others to join it, so
//!   that a burst (a driver's unbind, probe and bind; a ConfigMap's symlink swap) is one pass;
//! - the resync interval ([`Settings::resync`]): the safety net for what no event announced.
//!   Its ticks keep their period whatever else wakes the loop, so a steady trickle of changes
//!   cannot put it off;
//! - the retry of a failed pass ([`Trigger::retry`]), after an exponential backoff with jitter:
//!   `backon`'s [`ExponentialBuilder`], doubling from `retry_min` up to `retry_max`, each delay
//!   lengthened by a random part of itself (up to as much again), so that nodes failing together
//!   do not retry together. Changes that come meanwhile wait at least `retry_min` after the
//!   failure, so that a pass whose own writes raise events is not repeated in a tight loop. A
//!   pass that ends well ([`Trigger::done`]) starts the backoff over.
//!
//! Changes are queued, at most [`Settings::capacity`] of them: a sender never blocks, and the
//! queue's memory is bounded. When more come than fit (a storm: a thousand VFs enabled at once)
//! or a source says it lost some ([`Changes::lost`]: a uevent socket's or an inotify queue's
//! overflow), the changes are dropped and the next pass is a resync ([`Wake::resync`]), which
//! reads everything again. That is logged once per pass.
//!
//! ```ignore
//! let (mut trigger, changes) = Trigger::new(Settings::new("vfio-manager").with_resync(period));
//! let _monitor = Monitor::start(&["pci"], move |ev| changes.send(ev.subject));
//! while let Some(wake) = trigger.wait(&shutdown).await {
//!     match pass().await {
//!         Ok(()) => trigger.done(),
//!         Err(e) => tracing::error!(retry_in = ?trigger.retry(), "pass failed: {e:#}"),
//!     }
//! }
//! ```

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use backon::{BackoffBuilder as _, ExponentialBackoff, ExponentialBuilder};
use tokio::sync::{Notify, mpsc};
use tokio::time::{Instant, Interval, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

/// How long a change waits for others to join it, unless a daemon says otherwise: a driver's
/// unbind, probe and bind, or a symlink swap, come within it.
pub const SETTLE: Duration = Duration::from_millis(100);

/// When a [`Trigger`] wakes its loop.
#[derive(Clone, Debug)]
pub struct Settings {
    name: &'static str,
    resync: Option<Duration>,
    settle: Duration,
    retry_min: Duration,
    retry_max: Duration,
    capacity: usize,
    first_pass: bool,
}

impl Settings {
    /// `name` says whose changes they are in the logs (`vfio-manager`, `slices`). No resync,
    /// [`SETTLE`], a backoff from 1 s to 30 s, 1024 changes queued, a first pass at once.
    pub fn new(name: &'static str) -> Settings {
        Settings {
            name,
            resync: None,
            settle: SETTLE,
            retry_min: Duration::from_secs(1),
            retry_max: Duration::from_secs(30),
            capacity: 1024,
            first_pass: true,
        }
    }

    /// A pass at least every `period`, whatever else happens.
    pub fn with_resync(mut self, period: Duration) -> Settings {
        self.resync = Some(period.max(Duration::from_millis(1)));
        self
    }

    /// How long a change waits for others to join it (zero: not at all).
    pub fn with_settle(mut self, settle: Duration) -> Settings {
        self.settle = settle;
        self
    }

    /// The first and the longest delay before a failed pass is retried (the longest is never
    /// shorter than the first).
    pub fn with_retry(mut self, min: Duration, max: Duration) -> Settings {
        self.retry_min = min;
        self.retry_max = max.max(min);
        self
    }

    /// How many changes may wait; more make the next pass a resync.
    pub fn with_capacity(mut self, capacity: usize) -> Settings {
        self.capacity = capacity.max(1);
        self
    }

    /// No pass at start: the daemon made it before its loop.
    pub fn without_first_pass(mut self) -> Settings {
        self.first_pass = false;
        self
    }

    fn backoff(&self) -> Backoff {
        Backoff::new(self.retry_min, self.retry_max)
    }
}

/// The delays between retries of something that failed, the same for every loop of the
/// daemons: `backon`'s [`ExponentialBuilder`], doubling from `min` up to `max`, each delay
/// lengthened by a random part of itself (up to as much again), so that nodes (or a node's
/// resources) failing together do not retry together. [`Trigger`] retries its passes with it;
/// a loop of its own (a registration with kubelet, a label write) uses it directly.
#[derive(Debug)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    delays: ExponentialBackoff,
}

impl Backoff {
    /// Delays from `min` doubling to `max` (never shorter than `min`), with jitter.
    pub fn new(min: Duration, max: Duration) -> Backoff {
        let max = max.max(min);
        Backoff {
            min,
            max,
            delays: Self::delays(min, max),
        }
    }

    fn delays(min: Duration, max: Duration) -> ExponentialBackoff {
        ExponentialBuilder::new()
            .with_min_delay(min)
            .with_max_delay(max)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .build()
    }

    /// The delay before the next try.
    pub fn next_delay(&mut self) -> Duration {
        self.delays.next().unwrap_or(self.max)
    }

    /// Something succeeded: the next failure waits the shortest delay again.
    pub fn reset(&mut self) {
        self.delays = Self::delays(self.min, self.max);
    }
}

/// Why a pass is due.
#[derive(Debug, PartialEq, Eq)]
pub struct Wake<C> {
    /// The changes sent since the last pass, in the order they came.
    pub changes: Vec<C>,
    /// Read everything again: the pass at start, the resync interval passed, or changes were
    /// lost (the queue overflowed, or a source lost some).
    pub resync: bool,
    /// The retry of a failed pass.
    pub retry: bool,
    /// The pass at start.
    pub first: bool,
}

/// What the senders and the trigger share.
#[derive(Debug, Default)]
struct Shared {
    /// Changes dropped (the queue was full, or a source lost them) since the trigger last looked.
    lost: AtomicUsize,
    /// Wakes the trigger when changes are lost: no queued change may be left to do it.
    wake: Notify,
}

/// Where a change is sent: cheap to clone, usable from any thread, never blocks.
pub struct Changes<C> {
    tx: mpsc::Sender<C>,
    shared: Arc<Shared>,
}

impl<C> Clone for Changes<C> {
    fn clone(&self) -> Self {
        Changes {
            tx: self.tx.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<C> fmt::Debug for Changes<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Changes")
            .field("closed", &self.tx.is_closed())
            .finish()
    }
}

impl<C> Changes<C> {
    /// Queues `change` for the next pass; when the queue is full it is dropped and the next
    /// pass is a resync. `false` once the trigger is gone (a source's thread may then end).
    pub fn send(&self, change: C) -> bool {
        match self.tx.try_send(change) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => self.lost(),
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    /// Changes were lost on the way (a uevent socket's buffer, an inotify queue overflowed):
    /// the next pass is a resync. `false` once the trigger is gone.
    pub fn lost(&self) -> bool {
        if self.shared.lost.fetch_add(1, Ordering::SeqCst) == 0 {
            self.shared.wake.notify_one();
        }
        !self.tx.is_closed()
    }
}

/// Says when a loop makes its next pass; see the [module](self).
pub struct Trigger<C> {
    settings: Settings,
    rx: mpsc::Receiver<C>,
    /// Some sender is left.
    open: bool,
    shared: Arc<Shared>,
    /// Changes for the next pass, and when the first of them came.
    batch: Vec<C>,
    since: Option<Instant>,
    /// The next pass reads everything again.
    resync: bool,
    /// Changes were dropped since the last pass: told once.
    told_lost: bool,
    first: bool,
    ticker: Option<Interval>,
    backoff: Backoff,
    /// A failed pass is retried then.
    retry_at: Option<Instant>,
    /// After a failed pass, no change starts one before this.
    not_before: Option<Instant>,
}

impl<C> fmt::Debug for Trigger<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Trigger")
            .field("settings", &self.settings)
            .field("queued", &self.batch.len())
            .field("resync", &self.resync)
            .field("retry_at", &self.retry_at)
            .finish_non_exhaustive()
    }
}

impl<C> Trigger<C> {
    /// A trigger, and the handle its changes are sent through. Call it inside a tokio runtime
    /// (the resync timer starts here: its first tick is one period away).
    pub fn new(settings: Settings) -> (Trigger<C>, Changes<C>) {
        let (tx, rx) = mpsc::channel(settings.capacity);
        let shared = Arc::new(Shared::default());
        let ticker = settings.resync.map(|period| {
            let mut t = tokio::time::interval_at(Instant::now() + period, period);
            t.set_missed_tick_behavior(MissedTickBehavior::Delay);
            t
        });
        let trigger = Trigger {
            backoff: settings.backoff(),
            first: settings.first_pass,
            settings,
            rx,
            open: true,
            shared: shared.clone(),
            batch: Vec::new(),
            since: None,
            resync: false,
            told_lost: false,
            ticker,
            retry_at: None,
            not_before: None,
        };
        (trigger, Changes { tx, shared })
    }

    /// Waits until a pass is due and says why; `None` once `shutdown` is cancelled. Cancel-safe:
    /// what came before a cancelled wait is kept for the next.
    pub async fn wait(&mut self, shutdown: &CancellationToken) -> Option<Wake<C>> {
        loop {
            if shutdown.is_cancelled() {
                return None;
            }
            while let Ok(c) = self.rx.try_recv() {
                self.add(c);
            }
            self.count_lost();
            let now = Instant::now();
            if self.first {
                return Some(self.take(now));
            }
            let work = if self.resync {
                Some(now)
            } else {
                self.since.map(|t| t + self.settings.settle)
            };
            let work = work.map(|t| self.not_before.map_or(t, |nb| t.max(nb)));
            let at = match (work, self.retry_at) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            if at.is_some_and(|at| at <= now) {
                return Some(self.take(now));
            }
            let Trigger {
                rx,
                open,
                shared,
                ticker,
                ..
            } = self;
            let tick = async {
                match ticker {
                    Some(t) => t.tick().await,
                    None => std::future::pending().await,
                }
            };
            let sleep = async {
                match at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return None,
                _ = shared.wake.notified() => {}
                c = rx.recv(), if *open => match c {
                    Some(c) => self.add(c),
                    None => self.open = false,
                },
                _ = tick => self.resync = true,
                _ = sleep => {}
            }
        }
    }

    /// The changes that came since the last pass, without waiting: for a daemon that looks
    /// again once more of a pass is known (an empty `changes` when none came).
    pub fn take_queued(&mut self) -> Wake<C> {
        while let Ok(c) = self.rx.try_recv() {
            self.add(c);
        }
        self.count_lost();
        let resync = std::mem::take(&mut self.resync);
        self.since = None;
        Wake {
            changes: std::mem::take(&mut self.batch),
            resync,
            retry: false,
            first: false,
        }
    }

    /// The pass ended with nothing to retry (it succeeded, or only a change can mend what
    /// failed): the backoff starts over.
    pub fn done(&mut self) {
        self.backoff.reset();
        self.retry_at = None;
        self.not_before = None;
    }

    /// The pass failed: it is retried after the backoff's next delay, which is returned (to
    /// log). Changes wait at least the first delay.
    pub fn retry(&mut self) -> Duration {
        let delay = self.backoff.next_delay();
        let now = Instant::now();
        self.retry_at = Some(now + delay);
        self.not_before = Some(now + self.settings.retry_min.min(delay));
        delay
    }

    /// Whether a failed pass waits for its retry.
    pub fn retrying(&self) -> bool {
        self.retry_at.is_some()
    }

    fn add(&mut self, c: C) {
        if self.resync {
            // The pass reads everything: this change is in it.
            return;
        }
        if self.batch.len() >= self.settings.capacity {
            self.shared.lost.fetch_add(1, Ordering::SeqCst);
            return;
        }
        self.since.get_or_insert_with(Instant::now);
        self.batch.push(c);
    }

    /// Turns changes lost since the last look into a resync, told once per pass.
    fn count_lost(&mut self) {
        let lost = self.shared.lost.swap(0, Ordering::SeqCst);
        if lost == 0 {
            return;
        }
        if !self.told_lost {
            tracing::warn!(
                source = self.settings.name,
                capacity = self.settings.capacity,
                "changes came faster than they could be queued, or a source lost some: the next pass reads everything again"
            );
            self.told_lost = true;
        }
        self.resync = true;
        self.batch.clear();
        self.since = None;
        while self.rx.try_recv().is_ok() {}
    }

    fn take(&mut self, now: Instant) -> Wake<C> {
        let first = std::mem::take(&mut self.first);
        let retry = self.retry_at.is_some_and(|t| t <= now);
        if retry {
            self.retry_at = None;
        }
        self.since = None;
        self.told_lost = false;
        Wake {
            changes: std::mem::take(&mut self.batch),
            resync: std::mem::take(&mut self.resync) || first,
            retry,
            first,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trigger(s: Settings) -> (Trigger<u32>, Changes<u32>, CancellationToken) {
        let (t, c) = Trigger::new(s);
        (t, c, CancellationToken::new())
    }

    async fn next(t: &mut Trigger<u32>, stop: &CancellationToken) -> Wake<u32> {
        t.wait(stop).await.expect("a wake")
    }

    #[test]
    fn backoff_doubles_to_its_longest_with_jitter_and_starts_over() {
        let (min, max) = (Duration::from_secs(1), Duration::from_secs(30));
        let within = |d: Duration, base: Duration| d >= base && d <= base * 2;
        let mut b = Backoff::new(min, max);
        let first = b.next_delay();
        assert!(within(first, min), "{first:?}");
        for _ in 0..10 {
            b.next_delay();
        }
        let late = b.next_delay();
        assert!(within(late, max), "{late:?}");
        b.reset();
        let again = b.next_delay();
        assert!(within(again, min), "{again:?}");
        // Jitter: retries that fail together (every resource of a node, every node) do not
        // come back together.
        let firsts: std::collections::BTreeSet<Duration> = (0..20)
            .map(|_| Backoff::new(min, max).next_delay())
            .collect();
        assert!(firsts.len() > 1, "no jitter: {firsts:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_pass_is_at_once_then_changes_come_together() {
        let (mut t, tx, stop) = trigger(Settings::new("test"));
        let w = next(&mut t, &stop).await;
        assert!(w.first && w.resync && !w.retry && w.changes.is_empty());
        t.done();
        // A burst sent from another thread is one pass, in order.
        std::thread::spawn(move || {
            for i in 0..5 {
                assert!(tx.send(i));
            }
        })
        .join()
        .unwrap();
        let w = next(&mut t, &stop).await;
        assert_eq!(w.changes, [0, 1, 2, 3, 4]);
        assert!(!w.first && !w.resync && !w.retry);
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_first_pass_nothing_wakes_before_a_change() {
        let (mut t, tx, stop) = trigger(Settings::new("test").without_first_pass());
        tx.send(7);
        let w = next(&mut t, &stop).await;
        assert_eq!((w.first, w.changes), (false, vec![7]));
        let idle = tokio::time::timeout(Duration::from_secs(3600), t.wait(&stop)).await;
        assert!(idle.is_err(), "no resync and no change: no pass");
    }

    #[tokio::test(start_paused = true)]
    async fn the_resync_interval_wakes_without_changes() {
        let s = Settings::new("test").with_resync(Duration::from_secs(30));
        let (mut t, _tx, stop) = trigger(s);
        next(&mut t, &stop).await;
        for _ in 0..3 {
            let w = next(&mut t, &stop).await;
            assert!(w.resync && w.changes.is_empty() && !w.first);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_becomes_a_resync_and_the_senders_never_block() {
        let (mut t, tx, stop) = trigger(Settings::new("test").with_capacity(4));
        next(&mut t, &stop).await;
        for i in 0..100 {
            assert!(tx.send(i), "the trigger is still there");
        }
        let w = next(&mut t, &stop).await;
        assert!(w.resync, "changes were dropped: everything is read again");
        assert!(w.changes.is_empty(), "{:?}", w.changes);
        // The storm is over: changes are delivered again.
        tx.send(1);
        let w = next(&mut t, &stop).await;
        assert_eq!((w.resync, w.changes), (false, vec![1]));
    }

    #[tokio::test(start_paused = true)]
    async fn a_source_that_lost_changes_makes_a_resync() {
        let (mut t, tx, stop) = trigger(Settings::new("test"));
        next(&mut t, &stop).await;
        tx.send(1);
        assert!(tx.lost());
        let w = next(&mut t, &stop).await;
        assert!(w.resync && w.changes.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_pass_is_retried_without_any_change_and_holds_changes_back() {
        let s = Settings::new("test").with_retry(Duration::from_secs(2), Duration::from_secs(60));
        let (mut t, tx, stop) = trigger(s);
        next(&mut t, &stop).await;
        let first = t.retry();
        assert!(t.retrying());
        // Jitter lengthens a delay by up to as much again.
        assert!((Duration::from_secs(2)..=Duration::from_secs(4)).contains(&first));
        let w = next(&mut t, &stop).await;
        assert!(w.retry && w.changes.is_empty() && !w.resync);
        assert!(!t.retrying());
        // It fails again: the delay grows.
        let second = t.retry();
        assert!(second >= Duration::from_secs(4), "{second:?}");
        // A change right after the failure waits out the first delay, then starts a pass of
        // its own before the retry.
        tx.send(9);
        let early = tokio::time::timeout(Duration::from_secs(1), t.wait(&stop)).await;
        assert!(
            early.is_err(),
            "a change started a pass right after a failure"
        );
        let w = next(&mut t, &stop).await;
        assert_eq!((w.retry, w.changes), (false, vec![9]));
        // That pass ends well: the backoff starts over, and nothing is retried.
        t.done();
        assert!(!t.retrying());
        assert!(t.retry() <= Duration::from_secs(4));
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_ends_the_wait_and_closed_senders_do_not_spin() {
        let (mut t, tx, stop) = trigger(Settings::new("test"));
        next(&mut t, &stop).await;
        drop(tx);
        let s = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            s.cancel();
        });
        assert!(t.wait(&stop).await.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_wait_keeps_its_changes() {
        let s = Settings::new("test").with_settle(Duration::from_secs(1));
        let (mut t, tx, stop) = trigger(s);
        next(&mut t, &stop).await;
        tx.send(1);
        // Cancelled while the change settles.
        let _ = tokio::time::timeout(Duration::from_millis(10), t.wait(&stop)).await;
        tx.send(2);
        assert_eq!(next(&mut t, &stop).await.changes, [1, 2]);
        assert!(tx.send(3));
        assert_eq!(t.take_queued().changes, [3]);
    }
}
