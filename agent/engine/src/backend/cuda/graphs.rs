//! CUDA graphs of decode steps: captured once per batch shape, replayed after.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use peregrine_kernels::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::{gpu_err, CudaBackend};
use crate::Result;

/// A decode graph's key: (batch size, with LoRA or not).
type Key = (usize, bool);

/// CUDA graphs of decode steps, one per key, captured the second time a key is seen (the first run
/// is eager, so cuBLAS and the driver have done their lazy set-up before capture). A step is one
/// graph, or with [`GraphOptions::segment_layers`] several launched back to back.
pub(super) struct Graphs {
    pub(super) max_batch: usize,
    pub(super) seen: HashSet<Key>,
    pub(super) by_batch: HashMap<Key, Vec<SendGraph>>,
    options: GraphOptions,
    /// Host time spent in launches, per key: (launches, seconds) since the last report.
    launch_host: HashMap<Key, (u64, f64)>,
}

/// How decode graphs are captured and instantiated. The defaults are what the tree measured best;
/// the variables exist to compare (docs/benchmarks.md, session 28: a decode graph with LoRA's 128
/// fork/joins costs ~0.7 ms a step more than one without, whatever the batch).
#[derive(Debug, Clone, Copy)]
pub(super) struct GraphOptions {
    /// Instantiate with per-node priorities (the LoRA side path of one-to-four-token steps runs on a
    /// high-priority stream; cuda/lora.rs). `PEREGRINE_GRAPH_NODE_PRIORITY=0`: without.
    node_priority: bool,
    /// Split a step into graphs of this many layers (0: one graph), so that the GPU starts on the
    /// first part while the host launches the next. `PEREGRINE_GRAPH_SEGMENT_LAYERS=N`.
    segment_layers: usize,
}

impl GraphOptions {
    /// `segment_layers` as the backend's options say, unless the environment says otherwise.
    fn new(segment_layers: usize) -> GraphOptions {
        let node_priority = std::env::var("PEREGRINE_GRAPH_NODE_PRIORITY").map_or(true, |v| v != "0");
        let segment_layers = std::env::var("PEREGRINE_GRAPH_SEGMENT_LAYERS").ok().and_then(|v| v.parse().ok()).unwrap_or(segment_layers);
        GraphOptions { node_priority, segment_layers }
    }

    fn instantiate_flags(self) -> CUgraphInstantiate_flags {
        if self.node_priority {
            CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
        } else {
            CUgraphInstantiate_flags(0)
        }
    }

    /// Whether a new graph starts at layer `l` (never at the first: the step's start is there).
    pub(super) fn splits_at(self, l: usize) -> bool {
        self.segment_layers > 0 && l > 0 && l.is_multiple_of(self.segment_layers)
    }
}

impl Graphs {
    pub(super) fn new(max_batch: usize, segment_layers: usize) -> Graphs {
        let options = GraphOptions::new(segment_layers);
        if options.segment_layers > 0 || !options.node_priority {
            tracing::info!(?options, "CUDA graph options from the environment");
        }
        Graphs { max_batch, seen: HashSet::new(), by_batch: HashMap::new(), options, launch_host: HashMap::new() }
    }

    /// Forgets every captured graph (their launches hold device addresses that are about to change).
    pub(super) fn clear(&mut self) {
        self.seen.clear();
        self.by_batch.clear();
        self.launch_host.clear();
    }

    /// Replays the step's graphs for `key`; None if none was captured yet.
    pub(super) fn launch(&mut self, key: Key) -> Option<Result<()>> {
        let graphs = self.by_batch.get(&key)?;
        // The host's share of a replay: with the engine waiting for each step's tokens, the GPU
        // idles while it lasts (timed only with RUST_LOG=peregrine_engine=debug; logged every 64).
        let t0 = tracing::enabled!(tracing::Level::DEBUG).then(Instant::now);
        for g in graphs {
            if let Err(e) = g.0.launch() {
                return Some(Err(gpu_err(e.into())));
            }
        }
        let Some(t0) = t0 else { return Some(Ok(())) };
        let (launches, seconds) = self.launch_host.entry(key).or_default();
        *launches += 1;
        *seconds += t0.elapsed().as_secs_f64();
        if *launches == 64 {
            tracing::debug!(batch = key.0, lora = key.1, graphs = graphs.len(), host_us = format_args!("{:.1}", *seconds / 64.0 * 1e6), "CUDA graph launch, mean host time");
            (*launches, *seconds) = (0, 0.0);
        }
        Some(Ok(()))
    }
}

/// A captured graph. cudarc's `CudaGraph` is not `Send` (raw handles); the backend is owned by one
/// thread at a time and never shares it, which is all CUDA asks of graph objects.
pub(super) struct SendGraph(pub(super) peregrine_kernels::cudarc::driver::CudaGraph);
// SAFETY: see above; every use goes through `&mut CudaBackend`.
unsafe impl Send for SendGraph {}

impl CudaBackend {
    /// Records the launches of a decode step of `n` sequences into graphs (nothing runs).
    pub(super) fn capture(&mut self, key: Key, rows: usize) -> Result<()> {
        let (n, with_lora) = key;
        let t0 = Instant::now();
        let stream = self.cuda.gpu.stream.clone();
        let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        let options = self.graphs.options;
        // Per-node priorities: the LoRA side stream's launches keep their higher priority in the
        // graph (cuda/lora.rs) instead of taking the priority of the stream the graph is launched on.
        let flags = options.instantiate_flags();
        stream.begin_capture(mode).map_err(|e| gpu_err(e.into()))?;
        let parts = std::cell::RefCell::new(Vec::new());
        // At a layer boundary every LoRA side path has joined the main stream (each projection's
        // update is consumed before the next layer), so the capture can end and start again there.
        let split = |l: usize| -> peregrine_kernels::Result<()> {
            if options.splits_at(l) {
                parts.borrow_mut().push(stream.end_capture(flags)?);
                stream.begin_capture(mode)?;
            }
            Ok(())
        };
        let enqueued = self.step(n, n, rows, with_lora, &split);
        // End the capture whatever happened, or the stream stays unusable.
        let last = stream.end_capture(flags);
        enqueued.map_err(gpu_err)?;
        let mut parts = parts.into_inner();
        parts.push(last.map_err(|e| gpu_err(e.into()))?);
        let graphs: Vec<SendGraph> = parts.into_iter().flatten().map(SendGraph).collect();
        if graphs.is_empty() {
            tracing::warn!("CUDA graph capture of a {n}-sequence decode step produced no graph");
            return Ok(());
        }
        let count = graphs.len();
        self.graphs.by_batch.insert(key, graphs);
        // Captures happen on the first decode steps of each batch size: one line each, with
        // how many of the possible shapes are done, so a slow warm-up is visibly progressing.
        tracing::info!(
            batch = n,
            lora = with_lora,
            graphs = count,
            ms = format_args!("{:.1}", t0.elapsed().as_secs_f64() * 1e3),
            captured = self.graphs.by_batch.len(),
            of_at_most = 2 * self.graphs.max_batch,
            "CUDA graph captured"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::GraphOptions;

    #[test]
    fn segments_start_at_multiples_of_the_segment_length_but_never_at_the_first_layer() {
        let every_8 = GraphOptions { node_priority: true, segment_layers: 8 };
        let starts: Vec<usize> = (0..32).filter(|&l| every_8.splits_at(l)).collect();
        assert_eq!(starts, vec![8, 16, 24]);
        let one_graph = GraphOptions { node_priority: true, segment_layers: 0 };
        assert!((0..32).all(|l| !one_graph.splits_at(l)));
        let every_layer = GraphOptions { node_priority: true, segment_layers: 1 };
        assert_eq!((0..4).filter(|&l| every_layer.splits_at(l)).count(), 3);
    }
}
