//! A bounded waiting queue. A request counts as waiting from admission (before tokenizing) until
//! the engine first schedules it; beyond `max_waiting` it is refused with 429 + `Retry-After`, so
//! a flood costs a counter increment, not memory.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;

use super::error::ApiError;

#[derive(Debug)]
pub struct Admission {
    waiting: Arc<AtomicUsize>,
    max_waiting: usize,
}

impl Admission {
    pub fn new(max_waiting: usize) -> Self {
        Admission { waiting: Arc::new(AtomicUsize::new(0)), max_waiting }
    }

    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Takes a waiting slot or refuses. `gauges` (the model's and the server's waiting gauges) are
    /// kept in step.
    pub fn try_admit(&self, gauges: Vec<Gauge>) -> Result<WaitingSlot, ApiError> {
        let taken = self.waiting.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
            (w < self.max_waiting).then_some(w + 1)
        });
        match taken {
            Ok(_) => {
                gauges.iter().for_each(|g| {
                    g.inc();
                });
                Ok(WaitingSlot { waiting: Some(self.waiting.clone()), gauges })
            }
            Err(w) => Err(ApiError::QueueFull { waiting: w, retry_after: Duration::from_secs(1) }),
        }
    }
}

impl Admission {
    /// Takes `n` slots at once for the `n` choices of one request (each choice waits, and runs, as
    /// a request of its own), or none: 429 when they are not all free now, 400 when `n` exceeds
    /// the queue itself (the request could never be admitted, retrying would not help). Taking
    /// them one by one would let a large `n` hold part of the queue only to give it back.
    pub fn try_admit_many(&self, n: usize, gauges: Vec<Gauge>) -> Result<Vec<WaitingSlot>, ApiError> {
        if n > self.max_waiting {
            return Err(ApiError::invalid(
                None,
                format!("{n} choices cannot be queued together: this server queues at most {} requests", self.max_waiting),
            ));
        }
        let taken = self.waiting.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
            (w.saturating_add(n) <= self.max_waiting).then_some(w + n)
        });
        match taken {
            Ok(_) => Ok((0..n)
                .map(|_| {
                    gauges.iter().for_each(|g| {
                        g.inc();
                    });
                    WaitingSlot { waiting: Some(self.waiting.clone()), gauges: gauges.clone() }
                })
                .collect()),
            Err(w) => Err(ApiError::QueueFull { waiting: w, retry_after: Duration::from_secs(1) }),
        }
    }
}

/// Held while a request waits; released when it is scheduled, fails or is dropped.
#[derive(Debug)]
pub struct WaitingSlot {
    waiting: Option<Arc<AtomicUsize>>,
    gauges: Vec<Gauge>,
}

impl WaitingSlot {
    pub fn release(&mut self) {
        if let Some(w) = self.waiting.take() {
            w.fetch_sub(1, Ordering::AcqRel);
            self.gauges.iter().for_each(|g| {
                g.dec();
            });
        }
    }
}

impl Drop for WaitingSlot {
    fn drop(&mut self) {
        self.release();
    }
}

/// Held while a request runs in the engine (scheduled, not finished), keeping the running gauge.
#[derive(Debug)]
pub struct RunningSlot {
    gauges: Vec<Gauge>,
}

impl RunningSlot {
    pub fn new(gauges: Vec<Gauge>) -> Self {
        gauges.iter().for_each(|g| {
            g.inc();
        });
        RunningSlot { gauges }
    }
}

impl Drop for RunningSlot {
    fn drop(&mut self) {
        self.gauges.iter().for_each(|g| {
            g.dec();
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_and_released() {
        let a = Admission::new(2);
        let g = Gauge::default();
        let s1 = a.try_admit(vec![g.clone()]).unwrap();
        let mut s2 = a.try_admit(vec![g.clone()]).unwrap();
        assert!(matches!(a.try_admit(vec![g.clone()]), Err(ApiError::QueueFull { waiting: 2, .. })));
        assert_eq!(g.get(), 2);
        s2.release();
        s2.release(); // idempotent
        assert_eq!(a.waiting(), 1);
        drop(s1);
        drop(s2);
        assert_eq!(a.waiting(), 0);
        assert_eq!(g.get(), 0);
        assert!(a.try_admit(vec![g]).is_ok());
    }

    #[test]
    fn choices_take_their_slots_all_or_none() {
        let a = Admission::new(4);
        let g = Gauge::default();
        let one = a.try_admit(vec![g.clone()]).unwrap();
        // 3 free: 3 choices fit, 4 do not (and take nothing), 5 never could.
        assert!(matches!(a.try_admit_many(4, vec![g.clone()]), Err(ApiError::QueueFull { waiting: 1, .. })));
        assert_eq!((a.waiting(), g.get()), (1, 1));
        assert!(matches!(a.try_admit_many(5, vec![g.clone()]), Err(ApiError::InvalidRequest { .. })));
        let mut three = a.try_admit_many(3, vec![g.clone()]).unwrap();
        assert_eq!((three.len(), a.waiting(), g.get()), (3, 4, 4));
        assert!(a.try_admit(vec![g.clone()]).is_err());
        // Each choice gives its own slot back when it is scheduled.
        three[0].release();
        assert_eq!((a.waiting(), g.get()), (3, 3));
        drop(three);
        drop(one);
        assert_eq!((a.waiting(), g.get()), (0, 0));
    }
}
