//! `peregrine-agent serve`: the OpenAI-compatible HTTP server in front of the engine.
//!
//! Request path: [`routes`] (auth, per-tenant request limits) → [`handlers`] (parse, validate,
//! shape JSON/SSE) → [`generation`] (model resolution, admission, tokenizing on a worker pool,
//! length checks, token limits, metrics and trace events) → an [`backend::InferenceBackend`].

pub mod admission;
pub mod args;
pub mod auth;
pub mod backend;
pub mod error;
pub mod generation;
pub mod handlers;
pub mod lifecycle;
pub mod metrics;
pub mod parse;
pub mod rate_limit;
pub mod routes;
pub mod sse;
pub mod state;
pub mod telemetry;

#[cfg(test)]
mod tests;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

pub use args::ServeArgs;
use backend::InferenceBackend;
use state::AppState;

/// How the server stops after the shutdown signal.
#[derive(Debug, Clone, Copy)]
pub struct DrainConfig {
    /// Keep accepting this long after the signal while `/ready` reports 503.
    pub delay: Duration,
    /// Then wait at most this long for in-flight requests.
    pub grace_period: Duration,
}

/// Serves until `signal` completes, then drains: `/ready` turns 503, new connections stop after
/// `drain.delay`, in-flight requests finish within `drain.grace_period`. Returns normally either way
/// (the process exits 0), logging how many requests were cut off if the grace period ran out.
pub async fn serve<B: InferenceBackend>(
    listener: TcpListener,
    state: Arc<AppState<B>>,
    drain: DrainConfig,
    signal: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = routes::router(state.clone());
    let (signalled_tx, signalled_rx) = tokio::sync::watch::channel(false);
    let lifecycle_state = state.clone();
    let stop_accepting = async move {
        signal.await;
        lifecycle_state.lifecycle.start_draining();
        let _ = signalled_tx.send(true);
        tracing::info!(delay_s = drain.delay.as_secs_f64(), "shutdown signal: draining");
        tokio::time::sleep(drain.delay).await;
        tracing::info!("no longer accepting connections");
    };
    let server = axum::serve(listener, app).with_graceful_shutdown(stop_accepting);
    let server = std::future::IntoFuture::into_future(server);
    tokio::pin!(server);
    let mut signalled = signalled_rx;
    let deadline = async {
        // Only starts counting once the signal has arrived.
        let _ = signalled.wait_for(|s| *s).await;
        tokio::time::sleep(drain.delay + drain.grace_period).await;
    };
    tokio::select! {
        result = &mut server => result,
        () = deadline => {
            let running: i64 = state.metrics.running.get_or_create(&metrics::Metrics::label(state.backend.model_name())).get();
            tracing::warn!(running, "grace period over with requests still in flight; exiting");
            Ok(())
        }
    }
}

/// SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// Loads the model, starts the engine and serves until SIGTERM.
pub fn run(_args: ServeArgs) -> anyhow::Result<()> {
    // Wired to the real engine once the engine, tokenizer and model loader are merged into main.
    anyhow::bail!("serve: the engine is not wired in this build yet")
}
