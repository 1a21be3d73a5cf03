//! Progress of the weight load, for people (a log line at a steady cadence: bytes and tensors done,
//! rate, ETA) and for machines (the server's `peregrine_load_progress` gauge, which the operator
//! shows in a ModelDeployment's `Progressing` condition).
//!
//! A process loads one model, so the loaders report to one process-wide [`weights()`]; the server
//! reads it while the load runs on another thread. Counters are atomics and the log cadence sits
//! behind a mutex taken once per tensor, which is nothing next to reading the tensor.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// At most one progress line per this interval...
pub const LOG_INTERVAL: Duration = Duration::from_secs(2);
/// ...and one at least every this fraction of the bytes (whichever comes first).
pub const LOG_STEP: f64 = 0.10;

/// What has been read so far.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Snapshot {
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub tensors_done: u64,
    pub tensors_total: u64,
    pub elapsed: Duration,
    /// No load started yet, or the last one finished.
    pub finished: bool,
}

impl Snapshot {
    /// 0–1 by bytes (tensors when the byte total is unknown); 1 once finished.
    pub fn fraction(&self) -> f64 {
        if self.finished {
            return 1.0;
        }
        let (done, total) =
            if self.bytes_total > 0 { (self.bytes_done, self.bytes_total) } else { (self.tensors_done, self.tensors_total) };
        if total == 0 {
            return 0.0;
        }
        (done as f64 / total as f64).clamp(0.0, 1.0)
    }

    /// Bytes per second since the load began.
    pub fn rate(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            self.bytes_done as f64 / secs
        } else {
            0.0
        }
    }

    /// Time left at the rate so far; None before anything was read.
    pub fn eta(&self) -> Option<Duration> {
        let rate = self.rate();
        if rate <= 0.0 || self.bytes_total == 0 {
            return None;
        }
        let left = self.bytes_total.saturating_sub(self.bytes_done) as f64;
        Duration::try_from_secs_f64(left / rate).ok()
    }
}

/// When the last progress line was written.
#[derive(Debug, Clone, Copy)]
struct LastLog {
    at: Instant,
    fraction: f64,
}

/// Whether a progress line is due: [`LOG_INTERVAL`] since the last one, or a further [`LOG_STEP`]
/// of the bytes read.
pub fn log_due(last_at: Instant, last_fraction: f64, now: Instant, fraction: f64) -> bool {
    now.saturating_duration_since(last_at) >= LOG_INTERVAL || fraction - last_fraction >= LOG_STEP
}

#[derive(Debug)]
pub struct LoadProgress {
    bytes_done: AtomicU64,
    bytes_total: AtomicU64,
    tensors_done: AtomicU64,
    tensors_total: AtomicU64,
    /// When the running load began; None when none runs.
    started: Mutex<Option<(Instant, LastLog)>>,
}

impl Default for LoadProgress {
    fn default() -> Self {
        LoadProgress {
            bytes_done: AtomicU64::new(0),
            bytes_total: AtomicU64::new(0),
            tensors_done: AtomicU64::new(0),
            tensors_total: AtomicU64::new(0),
            started: Mutex::new(None),
        }
    }
}

impl LoadProgress {
    /// A load of `tensors_total` tensors holding `bytes_total` bytes begins.
    pub fn begin(&self, what: &str, bytes_total: u64, tensors_total: u64) {
        self.bytes_done.store(0, Ordering::Relaxed);
        self.tensors_done.store(0, Ordering::Relaxed);
        self.bytes_total.store(bytes_total, Ordering::Relaxed);
        self.tensors_total.store(tensors_total, Ordering::Relaxed);
        let now = Instant::now();
        *self.started.lock() = Some((now, LastLog { at: now, fraction: 0.0 }));
        tracing::info!(model = what, bytes = bytes_total, tensors = tensors_total, "loading weights");
    }

    /// One tensor of `bytes` bytes was read; writes a progress line when one is due.
    pub fn tensor_done(&self, bytes: u64) {
        self.bytes_done.fetch_add(bytes, Ordering::Relaxed);
        self.tensors_done.fetch_add(1, Ordering::Relaxed);
        let mut started = self.started.lock();
        let Some((t0, last)) = started.as_mut() else { return };
        let now = Instant::now();
        let snapshot = self.counters(now.saturating_duration_since(*t0), false);
        if !log_due(last.at, last.fraction, now, snapshot.fraction()) {
            return;
        }
        *last = LastLog { at: now, fraction: snapshot.fraction() };
        drop(started);
        log_line(&snapshot);
    }

    /// The load ended (successfully or not): the fraction reads 1 from now on.
    pub fn finish(&self) {
        let started = self.started.lock().take();
        if let Some((t0, _)) = started {
            let s = self.counters(t0.elapsed(), true);
            tracing::info!(
                bytes = s.bytes_done,
                tensors = s.tensors_done,
                seconds = format_args!("{:.1}", t0.elapsed().as_secs_f64()),
                mib_per_s = format_args!("{:.1}", s.bytes_done as f64 / (1 << 20) as f64 / t0.elapsed().as_secs_f64().max(1e-9)),
                "weights loaded"
            );
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        let t0 = self.started.lock().map(|(t0, _)| t0);
        match t0 {
            Some(t0) => self.counters(t0.elapsed(), false),
            None => self.counters(Duration::ZERO, true),
        }
    }

    fn counters(&self, elapsed: Duration, finished: bool) -> Snapshot {
        Snapshot {
            bytes_done: self.bytes_done.load(Ordering::Relaxed),
            bytes_total: self.bytes_total.load(Ordering::Relaxed),
            tensors_done: self.tensors_done.load(Ordering::Relaxed),
            tensors_total: self.tensors_total.load(Ordering::Relaxed),
            elapsed,
            finished,
        }
    }
}

fn log_line(s: &Snapshot) {
    const MIB: f64 = (1 << 20) as f64;
    tracing::info!(
        percent = format_args!("{:.0}", s.fraction() * 100.0),
        mib = format_args!("{:.0}/{:.0}", s.bytes_done as f64 / MIB, s.bytes_total as f64 / MIB),
        tensors = format_args!("{}/{}", s.tensors_done, s.tensors_total),
        mib_per_s = format_args!("{:.1}", s.rate() / MIB),
        eta_s = format_args!("{:.0}", s.eta().map_or(0.0, |d| d.as_secs_f64())),
        "loading weights"
    );
}

/// The process's weight load.
pub fn weights() -> &'static LoadProgress {
    static WEIGHTS: OnceLock<LoadProgress> = OnceLock::new();
    WEIGHTS.get_or_init(LoadProgress::default)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fraction_rate_and_eta() {
        let s = Snapshot {
            bytes_done: 250,
            bytes_total: 1000,
            tensors_done: 1,
            tensors_total: 4,
            elapsed: Duration::from_secs(5),
            finished: false,
        };
        assert_eq!(s.fraction(), 0.25);
        assert_eq!(s.rate(), 50.0);
        assert_eq!(s.eta(), Some(Duration::from_secs(15)));
        // Unknown byte total: by tensors; nothing yet: 0 and no ETA.
        let by_tensors = Snapshot { bytes_total: 0, ..s };
        assert_eq!(by_tensors.fraction(), 0.25);
        let empty = Snapshot { bytes_done: 0, tensors_done: 0, elapsed: Duration::ZERO, ..s };
        assert_eq!((empty.fraction(), empty.eta()), (0.0, None));
        // More read than announced never reads above 1.
        assert_eq!(Snapshot { bytes_done: 2000, ..s }.fraction(), 1.0);
        assert_eq!(Snapshot { finished: true, ..empty }.fraction(), 1.0);
    }

    #[test]
    fn log_cadence_is_time_or_ten_percent() {
        let t0 = Instant::now();
        assert!(!log_due(t0, 0.0, t0 + Duration::from_millis(500), 0.05));
        assert!(log_due(t0, 0.0, t0 + Duration::from_millis(500), 0.10));
        assert!(log_due(t0, 0.3, t0 + LOG_INTERVAL, 0.31));
        assert!(!log_due(t0, 0.3, t0 + Duration::from_secs(1), 0.39));
    }

    #[test]
    fn a_load_goes_from_zero_to_one() {
        let p = LoadProgress::default();
        assert_eq!(p.snapshot().fraction(), 1.0, "no load running");
        p.begin("m", 100, 2);
        assert_eq!(p.snapshot().fraction(), 0.0);
        p.tensor_done(40);
        let s = p.snapshot();
        assert_eq!((s.bytes_done, s.tensors_done, s.fraction()), (40, 1, 0.4));
        p.tensor_done(60);
        assert_eq!(p.snapshot().fraction(), 1.0);
        p.finish();
        assert!(p.snapshot().finished);
    }
}
