//! vLLM's KV-event wire layout: msgspec msgpack with `array_like` structs, events as tagged unions
//! (the tag is the first array element). As vLLM's `vllm/distributed/kv_events.py` (v0.10 series,
//! the types its `examples/online_serving/kv_events_subscriber.py` decodes) and llm-d's
//! `kvevents` decoder read it:
//!
//! - `KVEventBatch` = `[ts: float64, events: [event...], data_parallel_rank: int]`
//! - `BlockStored` = `["BlockStored", block_hashes: [uint], parent_block_hash: uint | nil,
//!   token_ids: [uint], block_size: int, lora_id: int | nil, medium: "GPU"]`
//! - `BlockRemoved` = `["BlockRemoved", block_hashes: [uint], medium: "GPU"]`
//! - `AllBlocksCleared` = `["AllBlocksCleared"]`

use rmp::encode;

/// Where the blocks live (vLLM's `MEDIUM_GPU`; also what it reports for its only KV pool).
pub const MEDIUM: &str = "GPU";

/// One event with its hashes already in the routers' scheme.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireEvent {
    Stored { hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, block_size: usize, lora_id: Option<u64> },
    Removed { hashes: Vec<u64> },
    AllCleared,
}

type Result<T> = std::result::Result<T, encode::ValueWriteError>;

fn uints(out: &mut Vec<u8>, values: impl ExactSizeIterator<Item = u64>) -> Result<()> {
    encode::write_array_len(out, values.len() as u32)?;
    for v in values {
        encode::write_uint(out, v)?;
    }
    Ok(())
}

fn opt_uint(out: &mut Vec<u8>, v: Option<u64>) -> Result<()> {
    match v {
        Some(v) => encode::write_uint(out, v).map(|_| ()),
        None => encode::write_nil(out).map_err(encode::ValueWriteError::InvalidMarkerWrite),
    }
}

fn event(out: &mut Vec<u8>, e: &WireEvent) -> Result<()> {
    match e {
        WireEvent::Stored { hashes, parent, tokens, block_size, lora_id } => {
            encode::write_array_len(out, 7)?;
            encode::write_str(out, "BlockStored")?;
            uints(out, hashes.iter().copied())?;
            opt_uint(out, *parent)?;
            uints(out, tokens.iter().map(|&t| u64::from(t)))?;
            encode::write_uint(out, *block_size as u64)?;
            opt_uint(out, *lora_id)?;
            encode::write_str(out, MEDIUM)?;
        }
        WireEvent::Removed { hashes } => {
            encode::write_array_len(out, 3)?;
            encode::write_str(out, "BlockRemoved")?;
            uints(out, hashes.iter().copied())?;
            encode::write_str(out, MEDIUM)?;
        }
        WireEvent::AllCleared => {
            encode::write_array_len(out, 1)?;
            encode::write_str(out, "AllBlocksCleared")?;
        }
    }
    Ok(())
}

/// One batch's payload. Encoding into memory cannot fail short of a length beyond msgpack's 2^32.
pub fn encode_batch(ts: f64, events: &[WireEvent], data_parallel_rank: u32) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(64 + events.len() * 32);
    let write = |out: &mut Vec<u8>| -> Result<()> {
        encode::write_array_len(out, 3)?;
        encode::write_f64(out, ts)?;
        encode::write_array_len(out, events.len() as u32)?;
        for e in events {
            event(out, e)?;
        }
        encode::write_uint(out, u64::from(data_parallel_rank))?;
        Ok(())
    };
    write(&mut out).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(out)
}
