//! `serve --model <encoder folder>` (or a decoder with `--task embed`): loads a BERT-family encoder
//! (or the decoder's embedder), starts its batching thread and serves the encoder endpoints beside
//! the usual probes, behind the same auth, limits and drain.

use std::sync::Arc;

use axum::routing::post;
use axum::Router;
use anyhow::Context;
use peregrine_engine::backend::cpu::encoder::CpuEncoder;
use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::{EncoderBackend, KvCacheShape};
use peregrine_engine::encoder::decoder::DecoderEmbedder;
use peregrine_engine::encoder::{is_encoder_folder, EncoderHandle, EncoderJobKind, EncoderModel, EncoderServiceConfig};
use peregrine_engine::model;
use peregrine_engine::tokenizer::Tokenizer;
use tokio::net::TcpListener;

use crate::serve::backend::InferenceBackend;
use super::encoder_backend::EncoderOnly;
use super::grpc;
use super::handlers::{classify, embeddings, rerank, tei};
use super::state::AppState;
use super::{engine_backend, shutdown_signal, telemetry, DrainConfig, ServeArgs};
use crate::runtime::DeviceArg;

/// After HTTP has stopped, how long the gRPC server may still take to close.
const GRPC_STOP_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// The encoder endpoints, and TEI's `/embed` and `/rerank` with TEI's own bodies.
pub fn encoder_routes() -> Router<Arc<AppState<EncoderOnly>>> {
    Router::new()
        .route("/v1/embeddings", post(embeddings::handle))
        .route("/v1/rerank", post(rerank::rerank))
        .route("/v2/rerank", post(rerank::rerank))
        .route("/v1/score", post(rerank::score))
        .route("/classify", post(classify::handle))
        .route("/embed", post(tei::embed))
        .route("/rerank", post(tei::rerank))
}

fn load(args: &ServeArgs) -> anyhow::Result<EncoderOnly> {
    let t0 = std::time::Instant::now();
    let device = args.engine.device()?;
    let encoder_folder = is_encoder_folder(&args.engine.model);
    // Decoder embeddings have no CUDA path: refused when cuda is asked for, the CPU when it is only
    // the default of a GPU machine.
    if args.engine.device == Some(DeviceArg::Cuda) && !encoder_folder {
        anyhow::bail!("decoder embeddings (--task embed) run on the CPU backend only for now (--device cpu); BERT-family encoders run on cuda too");
    }
    let (model, backend) = if encoder_folder { load_encoder(args, device)? } else { load_decoder(args)? };
    let name = args.served_model_name.clone().unwrap_or_else(|| engine_backend::default_model_name(&args.engine.model));
    let config = EncoderServiceConfig { max_num_batched_tokens: args.engine.max_num_batched_tokens };
    let handle = EncoderHandle::start(backend, Arc::new(model), config)?;
    tracing::info!(model = %name, backend = handle.backend_name(), task = ?handle.model().task, load_s = t0.elapsed().as_secs_f64(), "encoder loaded");
    Ok(EncoderOnly::new(name, handle))
}

/// A BERT-family folder.
fn load_encoder(args: &ServeArgs, device: DeviceArg) -> anyhow::Result<(EncoderModel, Box<dyn EncoderBackend>)> {
    let (mut model, weights) = EncoderModel::load(&args.engine.model)?;
    // --max-model-len overrides Sentence-Transformers' max_seq_length (up to the position table).
    if let Some(n) = args.engine.max_model_len {
        model.set_max_seq_length(n)?;
    }
    // --quantization int8: the CPU encoder's linears in int8 (W8A8); fp8 and the CUDA encoder have
    // no such path and refuse it rather than serve f32 under a quantized flag.
    let quantization = args.engine.quantization.map(Into::into);
    let backend: Box<dyn EncoderBackend> = match device {
        DeviceArg::Cpu => Box::new(CpuEncoder::with_quantization(model.config.clone(), weights, args.engine.threads(), quantization)?),
        DeviceArg::Cuda if quantization.is_some() => {
            anyhow::bail!("--quantization on an encoder runs on the CPU encoder only (int8): use --device cpu")
        }
        DeviceArg::Cuda => cuda_encoder(&model, weights)?,
    };
    Ok((model, backend))
}

/// The encoder on GPU 0: bf16 GEMMs with attention on the tensor cores, or the f32 reference path
/// with `PEREGRINE_ENCODER_GEMM=f32`. Pooling runs on the device, the classifier head on the host.
#[cfg(feature = "cuda")]
fn cuda_encoder(model: &EncoderModel, weights: peregrine_engine::encoder::weights::EncoderWeights) -> anyhow::Result<Box<dyn EncoderBackend>> {
    use peregrine_engine::backend::cuda::encoder::{CudaEncoder, EncoderGemm};
    Ok(Box::new(CudaEncoder::new(model.config.clone(), weights, 0, EncoderGemm::from_env())?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_encoder(_: &EncoderModel, _: peregrine_engine::encoder::weights::EncoderWeights) -> anyhow::Result<Box<dyn EncoderBackend>> {
    anyhow::bail!("this build has no CUDA backend (feature cuda): use --device cpu")
}

/// A decoder (`--task embed`): last-token embeddings from its final norm. Inputs are limited to
/// `--max-model-len`, by default the model's context or `--max-num-batched-tokens`, the smaller.
fn load_decoder(args: &ServeArgs) -> anyhow::Result<(EncoderModel, Box<dyn EncoderBackend>)> {
    let path = &args.engine.model;
    if args.engine.quantization_rotation {
        // The rotation moves the final norm's output (the embedding) by the rotation itself.
        anyhow::bail!("--quantization-rotation is for generation; --task embed serves the final hidden states, which it would rotate");
    }
    let mut loaded = model::load(path, args.engine.load_format.into()).with_context(|| format!("loading model {}", path.display()))?;
    if let Some(q) = args.engine.quantization {
        if args.engine.quantization_gptq {
            let plan = peregrine_engine::backend::cpu::calibrate::CalibrationPlan::default();
            peregrine_engine::backend::cpu::calibrate::quantize_with_calibration(&mut loaded.weights, q.into(), plan, args.engine.threads())
                .context("--quantization-gptq")?;
        }
        // Keeps the GPTQ codes; quantizes what is still floating point.
        model::quantize::quantize_linear_weights(&mut loaded.weights, q.into())?;
    } else if args.engine.quantization_gptq {
        anyhow::bail!("--quantization-gptq rounds the weights --quantization fp8|int8 makes; without it there is nothing to round");
    }
    let tokenizer = Tokenizer::for_model(path).with_context(|| format!("loading the tokenizer of {}", path.display()))?;
    let max_tokens = args.engine.max_num_batched_tokens;
    let max_seq_length = args.engine.max_model_len.unwrap_or(loaded.config.max_position_embeddings.min(max_tokens));
    let model = EncoderModel::for_decoder(&loaded.config, &tokenizer, max_seq_length)?;
    let block_size = args.engine.block_size;
    let kv = KvCacheShape { num_blocks: DecoderEmbedder::blocks_for(max_tokens, block_size), block_size };
    let backend = CpuBackend::new(loaded.weights, kv, args.engine.threads())?;
    Ok((model, Box::new(DecoderEmbedder::new(backend))))
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let workers = args.http_workers(args.engine.device()?);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(workers).enable_all().build()?;
    runtime.block_on(async move {
        let _telemetry = telemetry::init(args.otlp_endpoint.as_deref(), args.json_logs())?;
        let keys = super::key_store(&args)?;
        // An encoder serves no adapters: the admin endpoints refuse loads (EncoderOnly).
        let config = super::server_config(&args)?;
        let load_args = args.clone();
        let backend = Arc::new(tokio::task::spawn_blocking(move || load(&load_args)).await??);
        let state = Arc::new(AppState::new(backend.clone(), keys, config));
        let listener = TcpListener::bind((args.host, args.port)).await?;
        tracing::info!(addr = %listener.local_addr()?, model = state.backend.model_name(), "listening");
        // One embedding through the batching thread before `/ready` turns 200.
        let warm = state.clone();
        tokio::spawn(async move {
            let encoder = warm.backend.encoder().clone();
            let input = encoder.model().tokenizer.encode("Hello", true);
            let kind = if encoder.model().classifier.is_some() { EncoderJobKind::Classify } else { EncoderJobKind::Embed };
            let result = match input {
                Ok(i) => encoder.run(vec![i], kind).await.map(|_| ()),
                Err(e) => Err(e),
            };
            match result {
                Ok(()) => {
                    warm.lifecycle.set_ready();
                    tracing::info!("ready");
                }
                Err(e) => tracing::error!(error = %e, "warm-up failed; /ready stays 503"),
            }
        });
        let drain = DrainConfig { delay: args.drain_delay, grace_period: args.shutdown_grace_period };
        // One signal for both servers: HTTP drains as usual; gRPC keeps answering through the
        // drain delay too, then stops accepting and lets its calls finish.
        let (signalled, signal) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            shutdown_signal().await;
            let _ = signalled.send(true);
        });
        let when_signalled = |mut rx: tokio::sync::watch::Receiver<bool>, after: std::time::Duration| async move {
            let _ = rx.wait_for(|s| *s).await;
            tokio::time::sleep(after).await;
        };
        let grpc = match args.grpc_port {
            Some(port) => {
                let listener = TcpListener::bind((args.host, port)).await?;
                tracing::info!(addr = %listener.local_addr()?, "gRPC listening");
                Some(tokio::spawn(grpc::serve(listener, state.clone(), when_signalled(signal.clone(), drain.delay))))
            }
            None => None,
        };
        super::serve_with(listener, state, encoder_routes(), drain, when_signalled(signal, std::time::Duration::ZERO)).await?;
        if let Some(grpc) = grpc {
            // HTTP has drained (or cut off) its requests; gRPC's have had as long.
            match tokio::time::timeout(GRPC_STOP_WAIT, grpc).await {
                Ok(Ok(Err(e))) => tracing::error!(error = %e, "gRPC server failed"),
                Ok(_) => {}
                Err(_) => tracing::warn!("gRPC calls still in flight at exit"),
            }
        }
        tracing::info!("stopped");
        Ok(())
    })
}
