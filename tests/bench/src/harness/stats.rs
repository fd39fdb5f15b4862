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

/// The growth exponent between two sizes, `ln(b/a) / ln(n_b/n_a)`: 1 is linear, above 1 grows
/// faster than the node. `None` when a figure is zero or the sizes are equal.
pub fn growth_exponent(a: Duration, b: Duration, na: usize, nb: usize) -> Option<f64> {
    if a.is_zero() || b.is_zero() || na == nb || na == 0 || nb == 0 {
        return None;
    }
    Some((b.as_secs_f64() / a.as_secs_f64()).ln() / (nb as f64 / na as f64).ln())
}

/// The growth exponent fitted over every size: the least-squares slope of ln t against ln n.
/// `None` with fewer than two usable points (zero figures are left out).
pub fn fitted_exponent(points: &[(usize, Duration)]) -> Option<f64> {
    let xy: Vec<(f64, f64)> = points
        .iter()
        .filter(|(n, t)| *n > 0 && !t.is_zero())
        .map(|(n, t)| ((*n as f64).ln(), t.as_secs_f64().ln()))
        .collect();
    let k = xy.len() as f64;
    let (mx, my) = (
        xy.iter().map(|p| p.0).sum::<f64>() / k,
        xy.iter().map(|p| p.1).sum::<f64>() / k,
    );
    let sxx: f64 = xy.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = xy.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (xy.len() >= 2 && sxx > 0.0).then(|| sxy / sxx)
}

/// An exponent for a table: `1.25`, or `–`.
pub fn fmt_exponent(e: Option<f64>) -> String {
    e.map(|e| format!("{e:.2}")).unwrap_or_else(|| "–".into())
}

/// A short duration in microseconds: `4.6 µs`, `330.1 µs`.
pub fn fmt_micros(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
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
    fn exponents() {
        // t = n²: 2 between any two sizes and over the fit.
        let sq = |n: u64| ms(n * n);
        assert_eq!(growth_exponent(sq(4), sq(8), 4, 8), Some(2.0));
        let pts: Vec<(usize, Duration)> = [1, 2, 4, 8, 16]
            .iter()
            .map(|&n| (n, sq(n as u64)))
            .collect();
        assert!((fitted_exponent(&pts).unwrap() - 2.0).abs() < 1e-9);
        // Constant: 0.
        assert_eq!(growth_exponent(ms(5), ms(5), 1, 16), Some(0.0));
        assert_eq!(growth_exponent(ms(0), ms(5), 1, 16), None);
        assert_eq!(fitted_exponent(&[(1, ms(3))]), None);
        assert_eq!(fmt_exponent(Some(0.6049)), "0.60");
        assert_eq!(fmt_exponent(None), "–");
    }

    #[test]
    fn formats() {
        assert_eq!(fmt_duration(Duration::from_micros(142)), "0.142 ms");
        assert_eq!(fmt_duration(ms(12)), "12.0 ms");
        assert_eq!(fmt_duration(ms(1520)), "1520 ms");
        assert_eq!(fmt_duration(ms(15200)), "15.20 s");
        assert_eq!(fmt_micros(Duration::from_nanos(4_630)), "4.6 µs");
    }
}
