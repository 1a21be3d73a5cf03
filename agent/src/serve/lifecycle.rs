//! Readiness and draining: `/ready` is 503 until the model is warm and again once SIGTERM arrives;
//! when the grace period runs out, requests still running are cut off cleanly (see [`Lifecycle::cut_off`]).

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;

#[derive(Debug)]
pub struct Lifecycle {
    ready: AtomicBool,
    draining: AtomicBool,
    /// Turns true when the grace period is over.
    cut_off: watch::Sender<bool>,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle { ready: AtomicBool::new(false), draining: AtomicBool::new(false), cut_off: watch::Sender::new(false) }
    }
}

impl Lifecycle {
    /// The grace period is over: every running request ends now with `503` + `Retry-After` (or,
    /// mid-stream, an SSE error event and `[DONE]`) instead of being dropped with the process.
    pub fn cut_off(&self) {
        self.cut_off.send_replace(true);
    }

    /// Completes once [`Self::cut_off`] was called.
    pub fn cut_off_signal(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.cut_off.subscribe();
        async move {
            let _ = rx.wait_for(|c| *c).await;
        }
    }

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
