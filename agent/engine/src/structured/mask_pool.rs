//! The threads that compute grammar masks: a pool of their own, bounded, apart from rayon's global
//! pool.
//!
//! Why not the global pool: a step with 256 constrained sequences queues 256 mask tasks at once,
//! and anything else on the global pool (the CUDA backend converts LoRA slots there, on the engine
//! thread's path) would wait behind them. A pool of `cores - 1` threads also leaves one core to the
//! engine thread, which commits tokens and launches the next step while the masks are computed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use rayon::iter::{IndexedParallelIterator, IntoParallelIterator, ParallelIterator};

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
    match pool() {
        Some(pool) => pool.spawn(task),
        None => rayon::spawn(task),
    }
}

fn pool() -> &'static Option<rayon::ThreadPool> {
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(planned_threads())
            .thread_name(|i| format!("grammar-mask-{i}"))
            .build()
            .ok()
    })
}

/// Constrained rows from which a step's commits run on the mask threads ([`install`]) rather than
/// one by one on the engine thread (below, handing the work over costs more than it saves).
pub const PARALLEL_COMMIT_MIN_ROWS: usize = 16;

/// Runs `work` on the mask threads and waits for it: for the step's commits, which the engine
/// thread would otherwise make one by one while the device waits for the next step. The pool is
/// idle then (every mask of the step was gathered before sampling).
pub fn install<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    match pool() {
        Some(pool) => pool.install(work),
        None => work(),
    }
}

/// A mask task waiting for [`start_queued`].
type Task = Box<dyn FnOnce() + Send>;

/// Tasks queued since the last [`start_queued`]. One queue for the process: whichever thread
/// starts it runs every engine's tasks, and a sequence waiting for its mask starts it first (see
/// `GrammarState::write_mask`), so no task is left behind.
static QUEUED: Mutex<Vec<Task>> = Mutex::new(Vec::new());

/// Queues `task` for the next [`start_queued`]. Why not [`spawn`] at once: each spawn from outside
/// the pool wakes a sleeping mask thread, a system call of a few microseconds on the caller's
/// thread; for a step's 256 sequences that is most of the engine thread's commit loop, between the
/// step's tokens coming back and the next forward pass. Queued, the loop only consumes the tokens
/// and the pool's own threads wake each other.
pub(super) fn queue(task: impl FnOnce() + Send + 'static) {
    QUEUED.lock().unwrap_or_else(PoisonError::into_inner).push(Box::new(task));
}

/// Starts every queued task on the mask pool, as one job that the pool's threads share (each task
/// its own piece of work: they are of uneven length). Cheap when nothing is queued.
pub fn start_queued() {
    let tasks = std::mem::take(&mut *QUEUED.lock().unwrap_or_else(PoisonError::into_inner));
    match tasks.len() {
        0 => {}
        1 => tasks.into_iter().for_each(spawn),
        _ => spawn(move || tasks.into_par_iter().with_max_len(1).for_each(|t| t())),
    }
}

/// Whether the current thread is one of the mask pool's.
pub fn on_mask_thread() -> bool {
    matches!(POOL.get(), Some(Some(pool)) if pool.current_thread_index().is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    use std::time::Duration;

    /// Queued tasks wait for a start, then all run, on the mask pool.
    #[test]
    fn queued_tasks_run_once_started_and_on_the_mask_threads() {
        let ran = Arc::new(AtomicUsize::new(0));
        let (done_tx, done) = crossbeam_channel::unbounded();
        for _ in 0..40 {
            let (ran, done_tx) = (ran.clone(), done_tx.clone());
            queue(move || {
                ran.fetch_add(1, Ordering::SeqCst);
                let _ = done_tx.send(on_mask_thread());
            });
        }
        // Other tests share the queue and may start it; otherwise nothing runs until the start.
        start_queued();
        for _ in 0..40 {
            let on_pool = done.recv_timeout(Duration::from_secs(60)).expect("a queued task never ran");
            assert!(on_pool, "a queued task ran off the mask pool");
        }
        assert_eq!(ran.load(Ordering::SeqCst), 40);
        start_queued(); // nothing queued: a no-op
        assert!(done.recv_timeout(Duration::from_millis(50)).is_err(), "a task ran twice");
    }
}
