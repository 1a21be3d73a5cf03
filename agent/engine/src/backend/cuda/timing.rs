//! GPU time of steps, for `bench`'s idle-time figure.

use super::{gpu_err, CudaBackend};
use crate::Result;

/// GPU time of steps, measured with events around each step (for the idle-time figure of `bench`).
pub(super) struct StepTiming {
    pub(super) start: SendEvent,
    pub(super) end: SendEvent,
    pub(super) busy_seconds: f64,
}

pub(super) struct SendEvent(pub(super) peregrine_kernels::cudarc::driver::CudaEvent);
// SAFETY: as SendGraph: used only through `&mut CudaBackend`.
unsafe impl Send for SendEvent {}

impl CudaBackend {
    /// Starts or stops measuring the GPU time of each step (see [`CudaBackend::gpu_busy_seconds`]).
    pub fn set_step_timing(&mut self, on: bool) -> Result<()> {
        self.timing = if on {
            let flags = Some(peregrine_kernels::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            let ev = || self.cuda.gpu.ctx.new_event(flags).map(SendEvent).map_err(|e| gpu_err(e.into()));
            Some(StepTiming { start: ev()?, end: ev()?, busy_seconds: 0.0 })
        } else {
            None
        };
        Ok(())
    }

    /// GPU time (first to last operation of each step, events on the stream) summed over the steps
    /// since timing was switched on.
    pub fn gpu_busy_seconds(&self) -> Option<f64> {
        self.timing.as_ref().map(|t| t.busy_seconds)
    }

    /// After a step's results reached the host: adds its GPU span to the timing.
    pub(super) fn account_step(&mut self) -> Result<()> {
        if let Some(t) = &mut self.timing {
            t.end.0.record(&self.cuda.gpu.stream).map_err(|e| gpu_err(e.into()))?;
            t.end.0.synchronize().map_err(|e| gpu_err(e.into()))?;
            t.busy_seconds += t.start.0.elapsed_ms(&t.end.0).map_err(|e| gpu_err(e.into()))? as f64 / 1e3;
        }
        Ok(())
    }
}
