//! CUDA graphs of decode steps: captured once per batch shape, replayed after.

use super::{gpu_err, CudaBackend};
use crate::Result;

/// CUDA graphs of decode steps, one per (batch size, with LoRA or not), captured the second time a
/// key is seen (the first run is eager, so cuBLAS and the driver have done their lazy set-up before
/// capture).
pub(super) struct Graphs {
    pub(super) max_batch: usize,
    pub(super) seen: std::collections::HashSet<(usize, bool)>,
    pub(super) by_batch: std::collections::HashMap<(usize, bool), SendGraph>,
}

/// A captured graph. cudarc's `CudaGraph` is not `Send` (raw handles); the backend is owned by one
/// thread at a time and never shares it, which is all CUDA asks of graph objects.
pub(super) struct SendGraph(pub(super) peregrine_kernels::cudarc::driver::CudaGraph);
// SAFETY: see above; every use goes through `&mut CudaBackend`.
unsafe impl Send for SendGraph {}

impl CudaBackend {
    /// Records the launches of a decode step of `n` sequences into a graph (nothing runs).
    pub(super) fn capture(&mut self, key: (usize, bool), rows: usize) -> Result<()> {
        let (n, with_lora) = key;
        let t0 = std::time::Instant::now();
        let stream = self.cuda.gpu.stream.clone();
        stream
            .begin_capture(peregrine_kernels::cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| gpu_err(e.into()))?;
        let enqueued = self.step(n, n, rows, with_lora);
        // End the capture whatever happened, or the stream stays unusable.
        // Per-node priorities: the LoRA side stream's launches keep their higher priority in the
        // graph (cuda/lora.rs) instead of taking the priority of the stream the graph is launched on.
        let graph = stream.end_capture(peregrine_kernels::cudarc::driver::sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY);
        enqueued.map_err(gpu_err)?;
        match graph.map_err(|e| gpu_err(e.into()))? {
            Some(g) => {
                self.graphs.by_batch.insert(key, SendGraph(g));
                // Captures happen on the first decode steps of each batch size: one line each, with
                // how many of the possible shapes are done, so a slow warm-up is visibly progressing.
                tracing::info!(
                    batch = n,
                    lora = with_lora,
                    ms = format_args!("{:.1}", t0.elapsed().as_secs_f64() * 1e3),
                    captured = self.graphs.by_batch.len(),
                    of_at_most = 2 * self.graphs.max_batch,
                    "CUDA graph captured"
                );
            }
            None => tracing::warn!("CUDA graph capture of a {n}-sequence decode step produced no graph"),
        }
        Ok(())
    }
}
