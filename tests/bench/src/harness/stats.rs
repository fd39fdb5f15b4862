//! Summaries of repeated measurements.

use std::time::Duration;

/// Median, min, max (and p99 where asked) of a set of durations.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    /// Median.
    pub median: Duration,
    /// Smallest.
    pub min: Duration,
    /// Largest.
    pub max: Duration,
    /// 99th percentile (nearest rank).
    pub p99: Duration,
    /// How many runs.
    pub n: usize,
}

/// Summarises `samples`; `None` when there are none.
pub fn summarize(samples: &[Duration]) -> Option<Summary> {
    if samples.is_empty() {
        return None;
    }
    let mut v = samples.to_vec();
    v.sort();
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2
    };
    let rank = ((0.99 * n as f64).ceil() as usize).clamp(1, n);
    Some(Summary {
        median,
        min: v[0],
        max: v[n - 1],
        p99: v[rank - 1],
        n,
    })
}

/// The median and the p99 of `samples` for a table; `None` when there are none.
pub fn fmt_p50_p99(samples: &[Duration]) -> Option<(String, String)> {
    let s = summarize(samples)?;
    Some((fmt_duration(s.median), fmt_duration(s.p99)))
}

/// A duration for a table: `0.142 ms`, `12.3 ms`, `1.52 s`.
pub fn fmt_duration(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms < 1.0 {
        format!("{ms:.3} ms")
    } else if ms < 100.0 {
        format!("{ms:.1} ms")
    } else if ms < 10_000.0 {
        format!("{:.0} ms", ms)
    } else {
        format!("{:.2} s", d.as_secs_f64())
    }
}

/// `median (min–max)`.
pub fn fmt_summary(s: &Summary) -> String {
    format!(
        "{} ({}–{})",
        fmt_duration(s.median),
        fmt_duration(s.min),
        fmt_duration(s.max)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn median_min_max_p99() {
        let s = summarize(&[ms(5), ms(1), ms(3)]).unwrap();
        assert_eq!((s.median, s.min, s.max, s.n), (ms(3), ms(1), ms(5), 3));
        let s = summarize(&[ms(4), ms(1), ms(3), ms(2)]).unwrap();
        assert_eq!(s.median, Duration::from_micros(2500));
        let many: Vec<Duration> = (1..=1000).map(ms).collect();
        assert_eq!(summarize(&many).unwrap().p99, ms(990));
        assert!(summarize(&[]).is_none());
    }

    #[test]
    fn formats() {
        assert_eq!(fmt_duration(Duration::from_micros(142)), "0.142 ms");
        assert_eq!(fmt_duration(ms(12)), "12.0 ms");
        assert_eq!(fmt_duration(ms(1520)), "1520 ms");
        assert_eq!(fmt_duration(ms(15200)), "15.20 s");
    }
}
