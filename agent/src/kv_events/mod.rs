//! KV-cache events for prefix-aware routers (llm-d's precise prefix-cache scorer and others that
//! read vLLM's): every block the engine's prefix cache registers or evicts, published over ZeroMQ
//! in vLLM's msgpack layout with vLLM's block hashes. Off unless `--kv-events-endpoint` is given.
//!
//! Path: the engine thread records changes per step and hands them to a bounded channel without
//! waiting ([`peregrine_engine::engine::EngineHandle::subscribe_kv_events`]); a `kv-events` thread
//! turns them into routers' hashes ([`translate`]) and msgpack ([`wire`]); a task on the server's
//! runtime publishes them ([`publisher`]).

pub mod hash;
pub mod publisher;
pub mod translate;
pub mod wire;

use clap::Args;
use crossbeam_channel::Receiver;
use peregrine_engine::kv::KvEventBatch;
use tokio::sync::mpsc;

use translate::HashTranslator;

/// Engine batches queued for the `kv-events` thread before the engine drops new ones.
const ENGINE_QUEUE: usize = 4096;
/// Encoded batches queued for the socket task.
const SOCKET_QUEUE: usize = 1024;

/// The flags, named after vLLM's `--kv-events-config` fields.
#[derive(Args, Debug, Clone)]
pub struct KvEventsArgs {
    /// Publish KV-cache events on this ZeroMQ endpoint: `tcp://*:5557` binds, `tcp://host:5557`
    /// connects (to a router's SUB socket). Off when unset.
    #[arg(long, env = "PEREGRINE_KV_EVENTS_ENDPOINT")]
    pub kv_events_endpoint: Option<String>,
    /// A ROUTER endpoint (bound) where subscribers ask for missed batches by sequence number.
    #[arg(long, env = "PEREGRINE_KV_EVENTS_REPLAY_ENDPOINT")]
    pub kv_events_replay_endpoint: Option<String>,
    /// Topic of every message (default `kv@<POD_IP or HOSTNAME>@<served model name>`, as llm-d reads).
    #[arg(long, env = "PEREGRINE_KV_EVENTS_TOPIC")]
    pub kv_events_topic: Option<String>,
    /// Batches kept for replay.
    #[arg(long, env = "PEREGRINE_KV_EVENTS_BUFFER_STEPS", default_value_t = 10_000)]
    pub kv_events_buffer_steps: usize,
    /// Seed of the block-hash chain: vLLM's PYTHONHASHSEED, llm-d's `hashSeed` (the same on both sides).
    #[arg(long, env = "PYTHONHASHSEED", default_value = "")]
    pub kv_events_hash_seed: String,
}

impl KvEventsArgs {
    pub fn topic(&self, served_model: &str) -> String {
        self.kv_events_topic.clone().unwrap_or_else(|| {
            let pod = std::env::var("POD_IP")
                .or_else(|_| std::env::var("HOSTNAME"))
                .unwrap_or_else(|_| "localhost".to_string());
            format!("kv@{pod}@{served_model}")
        })
    }
}

/// Opens the sockets and starts publishing what `batches` brings. Call on the server's runtime.
pub async fn start(args: &KvEventsArgs, served_model: &str, batches: Receiver<KvEventBatch>) -> anyhow::Result<()> {
    let Some(endpoint) = args.kv_events_endpoint.as_deref() else { return Ok(()) };
    let topic = args.topic(served_model);
    let publisher =
        publisher::Publisher::open(endpoint, args.kv_events_replay_endpoint.as_deref(), &topic, args.kv_events_buffer_steps).await?;
    let (tx, rx) = mpsc::channel(SOCKET_QUEUE);
    let seed = args.kv_events_hash_seed.clone();
    std::thread::Builder::new()
        .name("kv-events".into())
        .spawn(move || translate_loop(&seed, batches, tx))
        .map_err(|e| anyhow::anyhow!("cannot start the kv-events thread: {e}"))?;
    tokio::spawn(publisher.run(rx));
    tracing::info!(endpoint, topic, "publishing KV-cache events");
    Ok(())
}

/// Capacity the engine should give its event channel.
pub fn engine_queue() -> usize {
    ENGINE_QUEUE
}

/// Engine batches → encoded payloads, until either side goes away.
fn translate_loop(seed: &str, batches: Receiver<KvEventBatch>, payloads: mpsc::Sender<Vec<u8>>) {
    let mut translator = HashTranslator::new(seed);
    for batch in batches {
        let events: Vec<wire::WireEvent> =
            batch.events.into_iter().filter_map(|e| translator.translate(e, batch.block_size)).collect();
        if events.is_empty() {
            continue;
        }
        match wire::encode_batch(batch.ts, &events, 0) {
            Ok(payload) => {
                if payloads.blocking_send(payload).is_err() {
                    return;
                }
            }
            Err(e) => tracing::warn!(error = %e, "KV-event batch not encoded"),
        }
    }
}

#[cfg(test)]
mod tests;
