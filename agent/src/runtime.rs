//! What every subcommand that runs the model shares: the engine flags and how a model path becomes a
//! running engine (weights → backend → KV cache sized from a memory budget → engine thread).

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, ValueEnum};
use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::{Backend, KvCacheShape};
use peregrine_engine::config::ModelConfig;
use peregrine_engine::engine::{Engine, EngineConfig, EngineHandle};
use peregrine_engine::model::{self, LoadFormat};
use peregrine_engine::tokenizer::Tokenizer;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LoadFormatArg {
    /// GGUF for a `.gguf` file, safetensors for a folder.
    Auto,
    Gguf,
    Safetensors,
    /// Random weights from the folder's `config.json` alone (benchmarks).
    Dummy,
}

impl From<LoadFormatArg> for LoadFormat {
    fn from(f: LoadFormatArg) -> Self {
        match f {
            LoadFormatArg::Auto => LoadFormat::Auto,
            LoadFormatArg::Gguf => LoadFormat::Gguf,
            LoadFormatArg::Safetensors => LoadFormat::Safetensors,
            LoadFormatArg::Dummy => LoadFormat::Dummy,
        }
    }
}

/// Engine flags, shared by `serve`, `generate` and `bench` (names follow vLLM's).
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Model: a GGUF file or a Hugging Face folder (config.json, *.safetensors, tokenizer.json).
    #[arg(long, env = "PEREGRINE_MODEL")]
    pub model: PathBuf,
    #[arg(long, value_enum, env = "PEREGRINE_LOAD_FORMAT", default_value = "auto")]
    pub load_format: LoadFormatArg,
    /// Context length (default: the model's, capped to what the KV cache holds).
    #[arg(long, env = "PEREGRINE_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,
    #[arg(long, env = "PEREGRINE_MAX_NUM_SEQS", default_value_t = 32)]
    pub max_num_seqs: usize,
    #[arg(long, env = "PEREGRINE_MAX_NUM_BATCHED_TOKENS", default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    #[arg(long, env = "PEREGRINE_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: usize,
    /// KV cache size in blocks (overrides --kv-cache-memory).
    #[arg(long, env = "PEREGRINE_NUM_KV_BLOCKS")]
    pub num_kv_blocks: Option<usize>,
    /// Memory for the KV cache, in GiB.
    #[arg(long, env = "PEREGRINE_KV_CACHE_MEMORY", default_value_t = 1.0)]
    pub kv_cache_memory: f64,
    #[arg(long, env = "PEREGRINE_DISABLE_PREFIX_CACHING")]
    pub disable_prefix_caching: bool,
    /// CPU backend threads (default: all cores).
    #[arg(long, env = "PEREGRINE_THREADS")]
    pub threads: Option<usize>,
    /// Seeds sampling of requests that bring no seed.
    #[arg(long, env = "PEREGRINE_SEED", default_value_t = 0)]
    pub seed: u64,
}

/// A started engine and what callers need beside it.
pub struct Runtime {
    pub engine: EngineHandle,
    pub model_config: ModelConfig,
    /// None for `--load-format dummy` without a tokenizer in the folder.
    pub tokenizer: Option<Tokenizer>,
    pub backend_name: String,
    pub kv_shape: KvCacheShape,
}

impl EngineArgs {
    pub fn threads(&self) -> usize {
        self.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)).max(1)
    }

    fn num_blocks(&self, config: &ModelConfig) -> anyhow::Result<usize> {
        if let Some(n) = self.num_kv_blocks {
            return Ok(n);
        }
        if !(self.kv_cache_memory.is_finite() && self.kv_cache_memory > 0.0) {
            anyhow::bail!("--kv-cache-memory must be a positive number of GiB");
        }
        let block_bytes = CpuBackend::kv_bytes_per_block(config, self.block_size).max(1);
        let budget = (self.kv_cache_memory * (1u64 << 30) as f64) as usize;
        Ok((budget / block_bytes).max(1))
    }

    /// Loads the model, builds the backend and starts the engine thread.
    pub fn start(&self) -> anyhow::Result<Runtime> {
        let loaded = model::load(&self.model, self.load_format.into())
            .with_context(|| format!("loading model {}", self.model.display()))?;
        let tokenizer = load_tokenizer(&self.model, self.load_format)?;
        let num_blocks = self.num_blocks(&loaded.config)?;
        let kv_shape = KvCacheShape { num_blocks, block_size: self.block_size };
        let config = loaded.config.clone();
        let backend = CpuBackend::new(loaded.weights, kv_shape, self.threads())?;
        let backend_name = backend.name();
        let engine = Engine::start(
            Box::new(backend),
            EngineConfig {
                max_num_seqs: self.max_num_seqs,
                max_num_batched_tokens: self.max_num_batched_tokens,
                max_model_len: self.max_model_len,
                block_size: self.block_size,
                enable_prefix_caching: !self.disable_prefix_caching,
                seed: self.seed,
            },
        )?;
        Ok(Runtime { engine, model_config: config, tokenizer, backend_name, kv_shape })
    }
}

/// The tokenizer of a model path; a dummy model may come without one.
fn load_tokenizer(path: &Path, format: LoadFormatArg) -> anyhow::Result<Option<Tokenizer>> {
    match Tokenizer::for_model(path) {
        Ok(t) => Ok(Some(t)),
        Err(_) if format == LoadFormatArg::Dummy => Ok(None),
        Err(e) => Err(e).with_context(|| format!("loading the tokenizer of {}", path.display())),
    }
}
