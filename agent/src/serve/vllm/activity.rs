//! Which requests wait and which run, in total and per adapter: the scheduler's view that inference
//! gateways read from vLLM (`vllm:num_requests_waiting`/`_running`, `vllm:lora_requests_info`).
//! Each request holds an [`ActivityGuard`] that moves it waiting → running → gone; `/metrics` reads
//! a [`ActivitySnapshot`]. A request counts as waiting from admission (tokenizing included, as the
//! server's own queue is where a gateway's extra request would wait too) until first scheduled.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

#[derive(Debug, Default)]
pub struct RequestActivity {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    waiting: usize,
    running: usize,
    /// Only adapters with a live request: bounded by the admission queue plus the running batch.
    adapters: BTreeMap<String, Counts>,
    /// Unix seconds of the last transition (0 before the first).
    changed_at: f64,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    waiting: usize,
    running: usize,
}

/// What `/metrics` reports, read under one lock so the figures agree with each other.
#[derive(Debug, Clone, PartialEq)]
pub struct ActivitySnapshot {
    pub waiting: usize,
    pub running: usize,
    /// Adapter names with a waiting (or running) request, sorted.
    pub waiting_adapters: Vec<String>,
    pub running_adapters: Vec<String>,
    pub changed_at: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Waiting,
    Running,
    Done,
}

fn unix_seconds() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

impl Inner {
    fn counts(&mut self, adapter: &Option<String>) -> Option<&mut Counts> {
        adapter.as_ref().map(|name| self.adapters.entry(name.clone()).or_default())
    }

    fn forget_idle(&mut self, adapter: &Option<String>) {
        if let Some(name) = adapter {
            if self.adapters.get(name).is_some_and(|c| c.waiting == 0 && c.running == 0) {
                self.adapters.remove(name);
            }
        }
    }
}

impl RequestActivity {
    /// A new request, waiting; `adapter` is None for the base model.
    pub fn enter(self: &Arc<Self>, adapter: Option<String>) -> ActivityGuard {
        let mut inner = self.inner.lock();
        inner.waiting += 1;
        if let Some(c) = inner.counts(&adapter) {
            c.waiting += 1;
        }
        inner.changed_at = unix_seconds();
        drop(inner);
        ActivityGuard { activity: self.clone(), adapter, phase: Phase::Waiting }
    }

    pub fn snapshot(&self) -> ActivitySnapshot {
        let inner = self.inner.lock();
        let names = |pick: fn(&Counts) -> usize| -> Vec<String> {
            inner.adapters.iter().filter(|(_, c)| pick(c) > 0).map(|(n, _)| n.clone()).collect()
        };
        ActivitySnapshot {
            waiting: inner.waiting,
            running: inner.running,
            waiting_adapters: names(|c| c.waiting),
            running_adapters: names(|c| c.running),
            changed_at: inner.changed_at,
        }
    }

    fn transition(&self, adapter: &Option<String>, from: Phase, to: Phase) {
        let mut inner = self.inner.lock();
        match from {
            Phase::Waiting => inner.waiting = inner.waiting.saturating_sub(1),
            Phase::Running => inner.running = inner.running.saturating_sub(1),
            Phase::Done => {}
        }
        if to == Phase::Running {
            inner.running += 1;
        }
        if let Some(c) = inner.counts(adapter) {
            match from {
                Phase::Waiting => c.waiting = c.waiting.saturating_sub(1),
                Phase::Running => c.running = c.running.saturating_sub(1),
                Phase::Done => {}
            }
            if to == Phase::Running {
                c.running += 1;
            }
        }
        inner.forget_idle(adapter);
        inner.changed_at = unix_seconds();
    }
}

/// One request's place in [`RequestActivity`]; dropping it removes the request.
#[derive(Debug)]
pub struct ActivityGuard {
    activity: Arc<RequestActivity>,
    adapter: Option<String>,
    phase: Phase,
}

impl ActivityGuard {
    /// First scheduled by the engine (later calls do nothing).
    pub fn scheduled(&mut self) {
        if self.phase == Phase::Waiting {
            self.activity.transition(&self.adapter, Phase::Waiting, Phase::Running);
            self.phase = Phase::Running;
        }
    }

    /// Finished, failed or aborted (idempotent; also on drop).
    pub fn finish(&mut self) {
        if self.phase != Phase::Done {
            self.activity.transition(&self.adapter, self.phase, Phase::Done);
            self.phase = Phase::Done;
        }
    }
}

impl Drop for ActivityGuard {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn requests_move_waiting_to_running_to_gone_per_adapter() {
        let a = Arc::new(RequestActivity::default());
        assert_eq!(a.snapshot().changed_at, 0.0);
        let before = unix_seconds();
        let mut base = a.enter(None);
        let mut b1 = a.enter(Some("b".into()));
        let mut a1 = a.enter(Some("a".into()));
        let a2 = a.enter(Some("a".into()));
        let s = a.snapshot();
        assert_eq!((s.waiting, s.running), (4, 0));
        assert_eq!(s.waiting_adapters, names(&["a", "b"]), "sorted, base model never listed");
        assert!(s.running_adapters.is_empty());
        assert!(s.changed_at >= before);

        a1.scheduled();
        a1.scheduled(); // idempotent
        base.scheduled();
        let s = a.snapshot();
        assert_eq!((s.waiting, s.running), (2, 2));
        assert_eq!(s.running_adapters, names(&["a"]));
        assert_eq!(s.waiting_adapters, names(&["a", "b"]), "a2 still waits");

        drop(a2); // aborted while waiting
        b1.scheduled();
        let s = a.snapshot();
        assert_eq!(s.waiting_adapters, Vec::<String>::new());
        assert_eq!(s.running_adapters, names(&["a", "b"]));

        a1.finish();
        drop(a1); // finish then drop counts once
        base.finish();
        let s = a.snapshot();
        assert_eq!((s.waiting, s.running), (0, 1));
        assert_eq!(s.running_adapters, names(&["b"]));
        drop(b1);
        drop(base);
        let s = a.snapshot();
        assert_eq!((s.waiting, s.running), (0, 0));
        assert!(s.running_adapters.is_empty() && s.waiting_adapters.is_empty());
        assert!(a.inner.lock().adapters.is_empty(), "idle adapters are forgotten (bounded map)");
    }
}
