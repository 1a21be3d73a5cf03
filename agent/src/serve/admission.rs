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
}
