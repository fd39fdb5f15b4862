//! The recorder's book of series: aggregation, bounds, when it writes, notes cut to size.

use super::*;

fn key(reason: &str, note: &str) -> Key {
    Key {
        type_: Type::Warning,
        reason: reason.into(),
        action: "Apply".into(),
        note: note.into(),
    }
}

fn job(book: &Book, now: Instant, gap: Duration) -> Option<Job> {
    match book.next(now, gap) {
        Next::Write(j) => Some(j),
        _ => None,
    }
}

const GAP: Duration = Duration::from_secs(30);

#[test]
fn the_same_note_is_one_event_with_a_count_and_another_note_its_own() {
    let mut b = Book::new(16);
    let now = Instant::now();
    let t = Timestamp::now();
    b.record(key("ProfileApplied", "A10-4Q applied"), t);
    b.record(key("ProfileApplied", "A10-4Q applied"), t);
    b.record(key("ProfileApplied", "A10-8Q applied"), t);
    assert_eq!(b.backlog().held, 2);
    // The oldest first, with both its occurrences.
    let j = job(&b, now, GAP).unwrap();
    assert_eq!((j.key.note.as_str(), j.count), ("A10-4Q applied", 2));
    assert!(j.name.is_none(), "a first write creates");
    b.written(&j, "n.1".into(), now);
    let j = job(&b, now, GAP).unwrap();
    assert_eq!((j.key.note.as_str(), j.count), ("A10-8Q applied", 1));
    b.written(&j, "n.2".into(), now);
    assert!(matches!(b.next(now, GAP), Next::Idle));
    assert_eq!(b.backlog().unsent, 0);
}

#[test]
fn repeats_are_written_together_at_most_once_per_gap() {
    let mut b = Book::new(16);
    let now = Instant::now();
    let k = key("BindRefused", "0000:41:00.0 in use by pid 7");
    b.record(k.clone(), Timestamp::now());
    let j = job(&b, now, GAP).unwrap();
    b.written(&j, "n.1".into(), now);
    for _ in 0..5 {
        b.record(k.clone(), Timestamp::now());
    }
    match b.next(now, GAP) {
        Next::At(t) => assert_eq!(t, now + GAP),
        other => panic!("{other:?}"),
    }
    let j = job(&b, now + GAP, GAP).unwrap();
    assert_eq!((j.name.as_deref(), j.count), (Some("n.1"), 6));
    // A repeat while the write was on its way is written next time.
    b.record(k.clone(), Timestamp::now());
    b.written(&j, "n.1".into(), now + GAP);
    assert_eq!(b.backlog().unsent, 1);
}

#[test]
fn a_full_book_forgets_written_events_first_then_drops_the_oldest_unsent() {
    let mut b = Book::new(3);
    let now = Instant::now();
    let t = Timestamp::now();
    b.record(key("A", "1"), t);
    let j = job(&b, now, GAP).unwrap();
    b.written(&j, "n.1".into(), now);
    b.record(key("B", "2"), t);
    b.record(key("C", "3"), t);
    b.record(key("C", "3"), t);
    // Full: the written one goes, nothing is dropped.
    b.record(key("D", "4"), t);
    assert_eq!(
        b.backlog(),
        Backlog {
            held: 3,
            unsent: 4,
            dropped: 0
        }
    );
    // Full of unsent: the least recently said goes (B), with what it carried.
    b.record(key("E", "5"), t);
    assert_eq!(b.backlog().dropped, 1);
    assert!(!b.series.contains_key(&key("B", "2")));
    // Many more while the API server is away: the book stays bounded.
    for i in 0..10_000 {
        b.record(key("F", &i.to_string()), t);
    }
    let bl = b.backlog();
    assert_eq!(bl.held, 3);
    // B, then C (twice said), D and E, then all but the last three F.
    assert_eq!(bl.dropped, 1 + 2 + 1 + 1 + 9_997, "{bl:?}");
    assert_eq!(b.take_untold(), bl.dropped);
    assert_eq!(b.take_untold(), 0, "told once");
}

#[test]
fn a_write_for_a_forgotten_series_changes_nothing() {
    let mut b = Book::new(1);
    let now = Instant::now();
    let t = Timestamp::now();
    b.record(key("A", "1"), t);
    let j = job(&b, now, GAP).unwrap();
    // Forgotten while on its way, and said again: a new series.
    b.record(key("B", "2"), t);
    b.record(key("A", "1"), t);
    b.written(&j, "n.1".into(), now);
    let s = &b.series[&key("A", "1")];
    assert_eq!((s.name.as_deref(), s.written), (None, 0));
}

#[test]
fn a_gone_event_is_created_again_with_its_whole_count() {
    let mut b = Book::new(4);
    let now = Instant::now();
    let k = key("A", "1");
    b.record(k.clone(), Timestamp::now());
    let j = job(&b, now, GAP).unwrap();
    b.written(&j, "n.1".into(), now);
    b.record(k.clone(), Timestamp::now());
    let j = job(&b, now + GAP, GAP).unwrap();
    assert_eq!(j.name.as_deref(), Some("n.1"));
    b.gone(&j);
    let j = job(&b, now + GAP, GAP).unwrap();
    assert_eq!((j.name, j.count), (None, 2));
}

#[tokio::test]
async fn sending_never_waits_and_disabled_events_hold_nothing() {
    let off = NodeEvents::disabled();
    off.warning("X", "Y", "z");
    assert_eq!(off.backlog(), Backlog::default());
    // A client to an address nobody answers: the sends return at once, bounded.
    let config = kube::Config::new("https://127.0.0.1:9".parse().unwrap());
    let client = kube::Client::try_from(config).unwrap();
    let tuning = Tuning {
        capacity: 8,
        ..Tuning::default()
    };
    let ev = NodeEvents::start_tuned(client, "node-a", "test", tuning);
    for i in 0..1000 {
        ev.warning("Refused", "Bind", format!("refusal {i}"));
    }
    let bl = ev.backlog();
    assert_eq!(bl.held, 8, "{bl:?}");
    assert_eq!(bl.dropped, 992, "{bl:?}");
}

#[test]
fn a_long_note_is_cut_below_the_api_servers_limit() {
    let h = Handle {
        shared: Arc::new(Shared {
            book: Mutex::new(Book::new(2)),
            wake: Notify::new(),
        }),
        closed: CancellationToken::new(),
    };
    let ev = NodeEvents {
        inner: Some(Arc::new(h)),
    };
    ev.normal("R", "A", "é".repeat(1000));
    let inner = ev.inner.as_ref().unwrap();
    let book = inner.shared.book();
    let note = &book.series.keys().next().unwrap().note;
    assert!(
        note.len() <= MAX_NOTE && note.ends_with(" …"),
        "{}",
        note.len()
    );
}
