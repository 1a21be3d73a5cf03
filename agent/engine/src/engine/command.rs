//! The handle ⇄ engine-thread protocol: every message a caller (or a loader thread) sends the
//! engine thread. Its own module so `handle`, `lora` and `worker` share it without depending on
//! each other.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Sender;
use tokio::sync::mpsc::UnboundedSender;

use crate::lora::{AdapterId, AdapterInfo, LoadOutcome, LoraAdapter};
use crate::request::{GenerationRequest, RequestEvent, RequestId};
use crate::Result;

/// What flows into the engine thread.
pub(super) enum Command {
    /// `follows`: another choice of the same prompt (`n > 1`), whose prompt blocks this one forks.
    Submit { request: GenerationRequest, events: UnboundedSender<RequestEvent>, arrival: Instant, follows: Option<RequestId> },
    /// The `n` choices of one request in one message, so that the engine queues them together
    /// and admits them as a whole: the first computes the prompt, the others follow it.
    SubmitChoices { requests: Vec<(GenerationRequest, UnboundedSender<RequestEvent>)>, arrival: Instant },
    Abort(RequestId),
    Shutdown,
    /// A parsed adapter to register under `name` (parsing happened on the caller's thread).
    LoadAdapter {
        name: String,
        source: PathBuf,
        adapter: Arc<LoraAdapter>,
        reply: Sender<(LoadOutcome, AdapterInfo)>,
    },
    UnloadAdapter { name: String, reply: Sender<Result<AdapterInfo>> },
    ListAdapters { reply: Sender<Vec<AdapterInfo>> },
    /// Start recording prefix-cache changes and send each step's batch here.
    SubscribeKvEvents { events: Sender<crate::kv::KvEventBatch> },
    /// A loader thread re-read an adapter evicted from host memory.
    AdapterReloaded { id: AdapterId, result: Result<Arc<LoraAdapter>> },
}
