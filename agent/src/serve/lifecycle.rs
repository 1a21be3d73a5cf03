//! Readiness and draining: `/ready` is 503 until the model is warm and again once SIGTERM arrives.

use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Debug, Default)]
pub struct Lifecycle {
    ready: AtomicBool,
    draining: AtomicBool,
}

impl Lifecycle {
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Release);
    }

    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire) && !self.is_draining()
    }

    pub fn status(&self) -> &'static str {
        if self.is_draining() {
            "draining"
        } else if self.ready.load(Ordering::Acquire) {
            "ok"
        } else {
            "starting"
        }
    }
}
