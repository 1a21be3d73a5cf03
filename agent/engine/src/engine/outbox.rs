//! Events for request streams, queued by the engine thread and sent together. Each send wakes the
//! stream's reader (a futex wake when its thread sleeps): a microsecond or more per event, so with a
//! thousand sequences in a step, over a millisecond during which the device would sit idle. Queued
//! here, a step's events go out while the device runs the next step (`Backend::forward_sample_with`).
//! Every event of an active request goes through the outbox, so a stream's events keep their order.

use tokio::sync::mpsc::UnboundedSender;

use crate::request::RequestEvent;

#[derive(Default)]
pub(super) struct Outbox {
    queued: Vec<(UnboundedSender<RequestEvent>, RequestEvent)>,
}

impl Outbox {
    pub(super) fn push(&mut self, to: &UnboundedSender<RequestEvent>, event: RequestEvent) {
        self.queued.push((to.clone(), event));
    }

    /// Sends everything queued, in order. A stream whose reader is gone drops its events; the engine
    /// notices the closed stream (`reap_disconnected`) and ends the request.
    pub(super) fn deliver(&mut self) {
        for (to, event) in self.queued.drain(..) {
            let _ = to.send(event);
        }
    }
}
