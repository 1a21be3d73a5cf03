//! `PEREGRINE_STEP_PROFILE=1`: where the engine thread's time goes, by phase of a step, printed to
//! stderr when the engine stops. The forward phase includes waiting for the device, so comparing it
//! with the wall time tells host overhead (scheduling, delivering tokens) from device time. For
//! benchmarks (`peregrine-agent throughput`); off by default, and then it costs one branch per step.

use std::time::{Duration, Instant};

pub(super) struct StepProfile {
    started: Instant,
    steps: u64,
    schedule: Duration,
    forward: Duration,
    emit: Duration,
}

impl StepProfile {
    pub(super) fn from_env() -> Option<Self> {
        std::env::var("PEREGRINE_STEP_PROFILE").is_ok_and(|v| v == "1").then(|| StepProfile {
            started: Instant::now(),
            steps: 0,
            schedule: Duration::ZERO,
            forward: Duration::ZERO,
            emit: Duration::ZERO,
        })
    }

    /// One step whose scheduling began at `schedule` (scheduling, admission bookkeeping, LoRA
    /// placement), whose forward pass began at `forward` (the backend's forward and sampling, waiting
    /// for the device included) and whose tokens were delivered from `emit` until now.
    pub(super) fn record_step(&mut self, schedule: Instant, forward: Instant, emit: Instant) {
        self.steps += 1;
        self.schedule += forward.saturating_duration_since(schedule);
        self.forward += emit.saturating_duration_since(forward);
        self.emit += emit.elapsed();
    }

    pub(super) fn report(&self) -> String {
        let wall = self.started.elapsed();
        let s = |d: Duration| d.as_secs_f64();
        let per = |d: Duration| 1e3 * s(d) / self.steps.max(1) as f64;
        format!(
            "step profile: {} steps in {:.2} s of engine-thread wall time: schedule {:.3} s ({:.3} ms/step), \
             forward {:.3} s ({:.3} ms/step), emit {:.3} s ({:.3} ms/step), other {:.3} s",
            self.steps,
            s(wall),
            s(self.schedule),
            per(self.schedule),
            s(self.forward),
            per(self.forward),
            s(self.emit),
            per(self.emit),
            (s(wall) - s(self.schedule) - s(self.forward) - s(self.emit)).max(0.0),
        )
    }
}
