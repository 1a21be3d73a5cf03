//! The threads that compute grammar masks: a pool of their own, bounded, apart from rayon's global
//! pool.
//!
//! Why not the global pool: a step with 256 constrained sequences queues 256 mask tasks at once,
//! and anything else on the global pool (the CUDA backend converts LoRA slots there, on the engine
//! thread's path) would wait behind them. A pool of `cores - 1` threads also leaves one core to the
//! engine thread, which commits tokens and launches the next step while the masks are computed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// The most mask threads (a bound on a mistaken setting; more than the cores never helps).
pub const MAX_MASK_THREADS: usize = 256;

/// 0: not set, the default applies.
static REQUESTED: AtomicUsize = AtomicUsize::new(0);
static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();

/// Sets the number of mask threads; takes effect only before the first mask is computed (the pool
/// starts then and keeps its size). Clamped to `1..=MAX_MASK_THREADS`. False where the pool had
/// already started.
pub fn set_mask_threads(threads: usize) -> bool {
    REQUESTED.store(threads.clamp(1, MAX_MASK_THREADS), Ordering::Relaxed);
    POOL.get().is_none()
}

/// The mask pool's size: the setting, else one fewer than the cores (at least 1).
pub fn mask_threads() -> usize {
    match POOL.get() {
        Some(Some(pool)) => pool.current_num_threads(),
        _ => planned_threads(),
    }
}

fn planned_threads() -> usize {
    match REQUESTED.load(Ordering::Relaxed) {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1)).clamp(1, MAX_MASK_THREADS),
        n => n,
    }
}

/// Runs `task` on the mask pool (on rayon's global pool where the mask threads could not be
/// started: masks are still computed, only without their own threads).
pub(super) fn spawn(task: impl FnOnce() + Send + 'static) {
    let pool = POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(planned_threads())
            .thread_name(|i| format!("grammar-mask-{i}"))
            .build()
            .ok()
    });
    match pool {
        Some(pool) => pool.spawn(task),
        None => rayon::spawn(task),
    }
}

/// Whether the current thread is one of the mask pool's.
pub fn on_mask_thread() -> bool {
    matches!(POOL.get(), Some(Some(pool)) if pool.current_thread_index().is_some())
}
