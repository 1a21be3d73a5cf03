//! `peregrine-agent serve`: the OpenAI-compatible HTTP server in front of the engine.
//!
//! Request path: [`routes`] (auth, per-tenant request limits) → [`handlers`] (parse, validate,
//! shape JSON/SSE) → [`generation`] (model resolution, admission, tokenizing on a worker pool,
//! length checks, token limits, metrics and trace events) → an [`backend::InferenceBackend`].

pub mod adapter_roots;
pub mod admission;
pub mod args;
pub mod auth;
pub mod backend;
pub mod body_limits;
pub mod connections;
pub mod encoder_backend;
pub mod encoder_serve;
pub mod engine_backend;
pub mod error;
pub mod generation;
pub mod grpc;
pub mod handlers;
pub mod lifecycle;
pub mod loading;
pub mod metrics;
pub mod parse;
pub mod rate_limit;
pub mod routes;
pub mod sse;
pub mod state;
pub mod telemetry;
pub mod tenant;
pub mod tools;
pub mod vllm;

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
    serve_with(listener, state, axum::Router::new(), drain, signal).await
}

/// [`serve`] with extra authenticated routes (the encoder endpoints).
pub async fn serve_with<B: InferenceBackend>(
    listener: TcpListener,
    state: Arc<AppState<B>>,
    extra: axum::Router<Arc<AppState<B>>>,
    drain: DrainConfig,
    signal: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = routes::router_with(state.clone(), extra);
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
    let server = connections::serve_connections(
        listener,
        app,
        state.config.connections,
        state.metrics.connections.clone(),
        stop_accepting,
    );
    tokio::pin!(server);
    let mut signalled = signalled_rx;
    let deadline = async {
        // Only starts counting once the signal has arrived.
        let _ = signalled.wait_for(|s| *s).await;
        tokio::time::sleep(drain.delay + drain.grace_period).await;
    };
    tokio::select! {
        () = &mut server => Ok(()),
        () = deadline => {
            let running: i64 = state.metrics.totals.running.get();
            tracing::warn!(running, "grace period over with requests still in flight; ending them with 503");
            state.lifecycle.cut_off();
            // Time for the handlers to write their last event and the connections to close.
            let _ = tokio::time::timeout(CUT_OFF_FLUSH, &mut server).await;
            Ok(())
        }
    }
}

/// After the grace period, how long cut-off requests get to send their final error.
const CUT_OFF_FLUSH: Duration = Duration::from_millis(500);

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

/// The API and admin keys with their per-tenant limits, from the flags.
fn key_store(args: &ServeArgs) -> anyhow::Result<auth::KeyStore> {
    let limits = tenant::Limits { requests_per_minute: args.rate_limit_rpm, tokens_per_minute: args.rate_limit_tpm };
    Ok(auth::KeyStore::new(&args.api_keys, args.api_keys_file.as_deref(), limits)?.with_admin_keys(&args.admin_api_keys))
}

/// The server's limits (bodies, queue, connections) and adapter roots, from the flags.
fn server_config(args: &ServeArgs) -> anyhow::Result<state::ServerConfig> {
    Ok(state::ServerConfig {
        max_body_bytes: args.max_body_bytes,
        max_waiting_requests: args.max_waiting_requests,
        connections: args.connection_limits(),
        adapter_roots: adapter_roots::AdapterRoots::new(&args.lora_roots)?,
        // Resolved against the chat template once the model is loaded.
        tool_call_format: None,
    })
}

/// Loads the model, starts the engine and serves until SIGTERM; exits 0 after draining.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let encoder_folder = peregrine_engine::encoder::is_encoder_folder(&args.engine.model);
    match args.task {
        Some(args::ServeTask::Generate) if encoder_folder => {
            anyhow::bail!("--task generate: this model is an encoder (embeddings, rerank, classify)")
        }
        Some(args::ServeTask::Embed) => return encoder_serve::run(args),
        _ if encoder_folder => return encoder_serve::run(args),
        _ => {}
    }
    if args.grpc_port.is_some() {
        anyhow::bail!("--grpc-port serves the encoder endpoints (an encoder, or a decoder with --task embed); generation is served over HTTP only");
    }
    let workers = args.http_workers(args.engine.device()?);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(workers).enable_all().build()?;
    runtime.block_on(async move {
        let _telemetry = telemetry::init(args.otlp_endpoint.as_deref(), args.json_logs())?;
        // Keys and limits are checked before the (slow) model load, so a bad flag fails at once.
        let keys = key_store(&args)?;
        let mut config = server_config(&args)?;
        // Bound before the load: probes and `/metrics` (with the load's progress) answer while the
        // weights are read, from a duplicate of the socket the real server accepts on afterwards.
        let listener = TcpListener::bind((args.host, args.port)).await?.into_std()?;
        let loading = loading::start(TcpListener::from_std(listener.try_clone()?)?, config.connections);
        let listener = TcpListener::from_std(listener)?;
        tracing::info!(addr = %listener.local_addr()?, "listening; loading the model");
        let load_args = args.clone();
        let backend = tokio::task::spawn_blocking(move || load_engine(&load_args)).await??;
        let backend = Arc::new(backend);
        loading.stop().await;
        config.tool_call_format = args.tool_call_parser.resolve(backend.chat_template_source().as_deref());
        tracing::info!(format = ?config.tool_call_format, "tool-call parser");
        if args.kv_events.kv_events_endpoint.is_some() {
            let batches = backend.engine().subscribe_kv_events(crate::kv_events::engine_queue())?;
            crate::kv_events::start(&args.kv_events, backend.model_name(), batches).await?;
        }
        let state = Arc::new(AppState::new(backend.clone(), keys, config));
        tracing::info!(
            addr = %listener.local_addr()?,
            model = backend.model_name(),
            max_model_len = backend.max_model_len(),
            api_keys = state.keys.len(),
            "listening"
        );
        // Probes answer while the model warms up; `/ready` turns 200 after one real generation.
        let warm_state = state.clone();
        tokio::spawn(async move {
            match warm_up(&warm_state).await {
                Ok(()) => {
                    warm_state.lifecycle.set_ready();
                    tracing::info!("ready");
                }
                Err(e) => tracing::error!(error = %e, "warm-up failed; /ready stays 503"),
            }
        });
        let drain = DrainConfig { delay: args.drain_delay, grace_period: args.shutdown_grace_period };
        serve(listener, state, drain, shutdown_signal()).await?;
        backend.engine().shutdown();
        tracing::info!("stopped");
        Ok(())
    })
}

fn load_engine(args: &ServeArgs) -> anyhow::Result<engine_backend::EngineBackend> {
    let t0 = std::time::Instant::now();
    let runtime = args.engine.start()?;
    let tokenizer = runtime.tokenizer.clone().ok_or_else(|| {
        anyhow::anyhow!("{} has no tokenizer; serving needs one", args.engine.model.display())
    })?;
    let name =
        args.served_model_name.clone().unwrap_or_else(|| engine_backend::default_model_name(&args.engine.model));
    tracing::info!(
        model = %name,
        backend = %runtime.backend_name,
        kv_blocks = runtime.kv_shape.num_blocks,
        load_s = t0.elapsed().as_secs_f64(),
        "model loaded"
    );
    let max_model_len = runtime.engine.max_model_len();
    let shape = backend::EngineShape {
        kv_block_size: runtime.kv_shape.block_size,
        num_kv_blocks: runtime.kv_shape.num_blocks,
        max_loras: args.engine.lora_config().map(|l| l.max_loras),
    };
    // The CPU pool is host memory, touched at start (so it is in the process's RSS already).
    let kv_cache_bytes = matches!(runtime.device, crate::runtime::DeviceArg::Cpu).then(|| {
        let per_block = peregrine_engine::backend::cpu::CpuBackend::kv_bytes_per_block(&runtime.model_config, runtime.kv_shape.block_size);
        (runtime.kv_shape.num_blocks as u64).saturating_mul(per_block as u64)
    });
    Ok(engine_backend::EngineBackend::new(name, runtime.backend_name, max_model_len, runtime.engine, tokenizer)
        .with_engine_shape(shape)
        .with_kv_cache_bytes(kv_cache_bytes))
}

/// One short generation through the whole path, so the first client does not pay for cold caches.
async fn warm_up<B: InferenceBackend>(state: &AppState<B>) -> Result<(), error::ApiError> {
    use futures::StreamExt;
    let prompt = state.backend.prepare(backend::PromptInput::Text("Hello".into())).await?;
    let mut events = state.backend.generate(backend::GenerateInput {
        request_id: state.next_request_id(),
        prompt,
        params: peregrine_engine::request::SamplingParams::greedy(2),
        stop: Vec::new(),
        skip_special_tokens: true,
        adapter: None,
        follows: None,
    })?;
    while let Some(event) = events.next().await {
        match event {
            backend::GenerateEvent::Finished { .. } => return Ok(()),
            backend::GenerateEvent::Error(e) => return Err(e),
            _ => {}
        }
    }
    Err(error::ApiError::EngineStopped)
}
