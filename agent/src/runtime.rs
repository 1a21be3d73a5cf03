//! What every subcommand that runs the model shares: the engine flags and how a model path becomes a
//! running engine (weights → backend on the chosen device → KV cache sized from a memory budget →
//! engine thread, with multi-LoRA when asked for).

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, ValueEnum};
use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::{Backend, KvCacheShape};
use peregrine_engine::config::ModelConfig;
use peregrine_engine::engine::{Engine, EngineConfig, EngineHandle};
use peregrine_engine::lora::LoraConfig;
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

/// `--kv-cache-dtype` (vLLM's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvCacheDtypeArg {
    /// The backend's own: bf16 on cuda, f32 on cpu.
    Auto,
    Bf16,
    /// e4m3 bytes, scale 1 (cuda, compute capability 8.9+).
    #[value(alias = "fp8_e4m3")]
    Fp8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    Cpu,
    Cuda,
}

impl DeviceArg {
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceArg::Cpu => "cpu",
            DeviceArg::Cuda => "cuda",
        }
    }
}

/// `--lora-modules name=path`: an adapter loaded at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraModule {
    pub name: String,
    pub path: PathBuf,
}

impl std::str::FromStr for LoraModule {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once('=') {
            Some((name, path)) if !name.is_empty() && !path.is_empty() => {
                Ok(LoraModule { name: name.to_string(), path: PathBuf::from(path) })
            }
            _ => Err(format!("expected name=path, got {s:?}")),
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
    /// Where the model runs (default: cuda when a CUDA device is usable, else cpu).
    #[arg(long, value_enum, env = "PEREGRINE_DEVICE")]
    pub device: Option<DeviceArg>,
    /// Fraction of the GPU's memory to use for weights, activations and KV cache (cuda only).
    #[arg(long, env = "PEREGRINE_GPU_MEMORY_UTILIZATION", default_value_t = 0.9)]
    pub gpu_memory_utilization: f32,
    /// KV cache element type. fp8 (cuda only, compute capability 8.9+): e4m3 with scale 1, twice the
    /// tokens in the same memory and half the bytes decode attention reads, at fp8's precision.
    #[arg(long, value_enum, env = "PEREGRINE_KV_CACHE_DTYPE", default_value = "auto")]
    pub kv_cache_dtype: KvCacheDtypeArg,
    /// Serve LoRA adapters (implied by --lora-modules).
    #[arg(long, env = "PEREGRINE_ENABLE_LORA")]
    pub enable_lora: bool,
    /// LoRA adapters to load at start, as name=path (PEFT folders).
    #[arg(long, num_args = 1.., value_name = "NAME=PATH")]
    pub lora_modules: Vec<LoraModule>,
    /// Adapters that can run in one batch.
    #[arg(long, env = "PEREGRINE_MAX_LORAS", default_value_t = 4)]
    pub max_loras: usize,
    /// Largest accepted adapter rank.
    #[arg(long, env = "PEREGRINE_MAX_LORA_RANK", default_value_t = 64)]
    pub max_lora_rank: usize,
    /// Adapters kept in host memory; idle ones beyond this are re-read from disk when next used.
    #[arg(long, env = "PEREGRINE_MAX_CPU_LORAS", default_value_t = 16)]
    pub max_cpu_loras: usize,
}

/// A started engine and what callers need beside it.
pub struct Runtime {
    pub engine: EngineHandle,
    pub model_config: ModelConfig,
    /// None for `--load-format dummy` without a tokenizer in the folder.
    pub tokenizer: Option<Tokenizer>,
    pub backend_name: String,
    pub kv_shape: KvCacheShape,
    pub device: DeviceArg,
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

    /// The LoRA limits when LoRA is on (`--enable-lora` or any `--lora-modules`).
    pub fn lora_config(&self) -> Option<LoraConfig> {
        (self.enable_lora || !self.lora_modules.is_empty()).then_some(LoraConfig {
            max_loras: self.max_loras,
            max_lora_rank: self.max_lora_rank,
            max_cpu_loras: self.max_cpu_loras,
        })
    }

    /// `--device`, or its default: cuda when usable, else cpu. Asking for cuda where it cannot run
    /// is an error naming the reason, never a silent fallback.
    pub fn device(&self) -> anyhow::Result<DeviceArg> {
        match self.device {
            Some(DeviceArg::Cpu) => Ok(DeviceArg::Cpu),
            Some(DeviceArg::Cuda) => match cuda_available() {
                Ok(()) => Ok(DeviceArg::Cuda),
                Err(why) => anyhow::bail!("--device cuda: no usable CUDA device: {why}"),
            },
            None => Ok(if cuda_available().is_ok() { DeviceArg::Cuda } else { DeviceArg::Cpu }),
        }
    }

    fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len,
            block_size: self.block_size,
            enable_prefix_caching: !self.disable_prefix_caching,
            seed: self.seed,
        }
    }

    /// Loads the model, builds the backend, starts the engine thread and loads `--lora-modules`.
    pub fn start(&self) -> anyhow::Result<Runtime> {
        let device = self.device()?;
        if device == DeviceArg::Cpu && self.kv_cache_dtype != KvCacheDtypeArg::Auto {
            let asked = self.kv_cache_dtype.to_possible_value().map_or_else(String::new, |v| v.get_name().to_string());
            anyhow::bail!("--kv-cache-dtype {asked}: the CPU backend keeps its KV cache in f32 (only auto); bf16 and fp8 caches are for --device cuda");
        }
        let tokenizer = load_tokenizer(&self.model, self.load_format)?;
        let loading = || format!("loading model {}", self.model.display());
        let (config, backend): (ModelConfig, Box<dyn Backend>) = match device {
            // Random weights of a big model are made on the GPU; a host copy would not even fit.
            DeviceArg::Cuda if self.load_format == LoadFormatArg::Dummy => {
                let config = model::dummy_config(&self.model).with_context(loading)?;
                (config.clone(), self.cuda_backend(ModelSource::Random(config))?)
            }
            DeviceArg::Cuda => {
                let loaded = model::load(&self.model, self.load_format.into()).with_context(loading)?;
                (loaded.config.clone(), self.cuda_backend(ModelSource::Host(&loaded.weights))?)
            }
            DeviceArg::Cpu => {
                let loaded = model::load(&self.model, self.load_format.into()).with_context(loading)?;
                let num_blocks = self.num_blocks(&loaded.config)?;
                let kv_shape = KvCacheShape { num_blocks, block_size: self.block_size };
                (loaded.config, Box::new(CpuBackend::new(loaded.weights, kv_shape, self.threads())?))
            }
        };
        let backend_name = backend.name();
        let kv_shape = backend.kv_shape();
        let engine = match self.lora_config() {
            Some(lora) => Engine::start_with_lora(backend, self.engine_config(), lora)
                .with_context(|| format!("starting the engine with LoRA on {backend_name}"))?,
            None => Engine::start(backend, self.engine_config())?,
        };
        for module in &self.lora_modules {
            engine
                .load_adapter(&module.name, &module.path)
                .with_context(|| format!("--lora-modules {}={}", module.name, module.path.display()))?;
        }
        Ok(Runtime { engine, model_config: config, tokenizer, backend_name, kv_shape, device })
    }

    #[cfg(feature = "cuda")]
    fn cuda_backend(&self, source: ModelSource<'_>) -> anyhow::Result<Box<dyn Backend>> {
        use peregrine_engine::backend::cuda::{CudaBackend, CudaOptions, KvCacheDtype, LoraCapacity, WeightInit};
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            anyhow::bail!("--gpu-memory-utilization must be in (0, 1]");
        }
        let config = match &source {
            ModelSource::Host(w) => &w.config,
            ModelSource::Random(c) => c,
        };
        let opts = CudaOptions {
            block_size: self.block_size,
            gpu_memory_utilization: self.gpu_memory_utilization,
            max_model_len: self.max_model_len.unwrap_or(config.max_position_embeddings),
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            num_blocks: self.num_kv_blocks,
            // Reserved before the KV cache takes the rest of the memory.
            lora: self.lora_config().map(|l| LoraCapacity { max_loras: l.max_loras, max_rank: l.max_lora_rank }),
            kv_cache_dtype: match self.kv_cache_dtype {
                KvCacheDtypeArg::Auto | KvCacheDtypeArg::Bf16 => KvCacheDtype::Bf16,
                KvCacheDtypeArg::Fp8 => KvCacheDtype::Fp8E4m3,
            },
            ..CudaOptions::default()
        };
        let init = match source {
            ModelSource::Host(w) => WeightInit::Host(w),
            ModelSource::Random(config) => WeightInit::Random { config, seed: model::DUMMY_SEED },
        };
        Ok(Box::new(CudaBackend::new(init, &opts).context("starting the CUDA backend")?))
    }

    #[cfg(not(feature = "cuda"))]
    fn cuda_backend(&self, _source: ModelSource<'_>) -> anyhow::Result<Box<dyn Backend>> {
        anyhow::bail!("this build has no CUDA support (built without the `cuda` feature)")
    }
}

/// Where the CUDA backend's weights come from.
enum ModelSource<'a> {
    Host(&'a model::ModelWeights),
    /// `--load-format dummy`: random weights of this shape, made on the device.
    Random(ModelConfig),
}

#[cfg(feature = "cuda")]
fn cuda_available() -> Result<(), String> {
    peregrine_engine::backend::cuda::available()
}

#[cfg(not(feature = "cuda"))]
fn cuda_available() -> Result<(), String> {
    Err("this build has no CUDA support".into())
}

/// The tokenizer of a model path; a dummy model may come without one.
fn load_tokenizer(path: &Path, format: LoadFormatArg) -> anyhow::Result<Option<Tokenizer>> {
    match Tokenizer::for_model(path) {
        Ok(t) => Ok(Some(t)),
        Err(_) if format == LoadFormatArg::Dummy => Ok(None),
        Err(e) => Err(e).with_context(|| format!("loading the tokenizer of {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
    }

    fn parse(extra: &[&str]) -> Result<EngineArgs, clap::Error> {
        let args = ["test", "--model", "/m.gguf"].into_iter().chain(extra.iter().copied());
        Cli::try_parse_from(args).map(|c| c.engine)
    }

    #[test]
    fn lora_flags_and_defaults() {
        let a = parse(&[]).unwrap();
        assert_eq!(a.lora_config(), None, "LoRA is off unless asked for");
        assert_eq!((a.max_loras, a.max_lora_rank, a.max_cpu_loras), (4, 64, 16));
        assert_eq!(a.gpu_memory_utilization, 0.9);
        assert_eq!(parse(&["--enable-lora"]).unwrap().lora_config(), Some(LoraConfig::default()));

        let a = parse(&["--lora-modules", "sql=/a/sql", "chat=/b", "--max-loras", "2", "--max-lora-rank", "16"]).unwrap();
        assert_eq!(
            a.lora_modules,
            [
                LoraModule { name: "sql".into(), path: "/a/sql".into() },
                LoraModule { name: "chat".into(), path: "/b".into() }
            ]
        );
        assert_eq!(a.lora_config(), Some(LoraConfig { max_loras: 2, max_lora_rank: 16, max_cpu_loras: 16 }), "implied by --lora-modules");
        assert!(parse(&["--lora-modules", "no-path"]).is_err());
        assert!(parse(&["--lora-modules", "=/p"]).is_err());
        assert!(parse(&["--device", "tpu"]).is_err());
    }

    #[test]
    fn kv_cache_dtype_flag() {
        assert_eq!(parse(&[]).unwrap().kv_cache_dtype, KvCacheDtypeArg::Auto);
        assert_eq!(parse(&["--kv-cache-dtype", "fp8"]).unwrap().kv_cache_dtype, KvCacheDtypeArg::Fp8);
        assert_eq!(parse(&["--kv-cache-dtype", "fp8_e4m3"]).unwrap().kv_cache_dtype, KvCacheDtypeArg::Fp8, "vLLM's long name");
        assert_eq!(parse(&["--kv-cache-dtype", "bf16"]).unwrap().kv_cache_dtype, KvCacheDtypeArg::Bf16);
        assert!(parse(&["--kv-cache-dtype", "int4"]).is_err());
    }

    #[test]
    fn cpu_refuses_a_kv_cache_type_it_does_not_keep() {
        let a = parse(&["--device", "cpu", "--kv-cache-dtype", "fp8"]).unwrap();
        let e = a.start().err().expect("fp8 on the CPU is refused").to_string();
        assert!(e.contains("--kv-cache-dtype") && e.contains("cuda"), "{e}");
    }

    #[test]
    fn device_defaults_to_cuda_only_when_usable() {
        assert_eq!(parse(&["--device", "cpu"]).unwrap().device().unwrap(), DeviceArg::Cpu);
        let asked = parse(&["--device", "cuda"]).unwrap().device();
        let default = parse(&[]).unwrap().device().unwrap();
        match cuda_available() {
            Ok(()) => {
                assert_eq!(asked.unwrap(), DeviceArg::Cuda);
                assert_eq!(default, DeviceArg::Cuda);
            }
            Err(why) => {
                let e = asked.unwrap_err().to_string();
                assert!(e.contains("--device cuda") && e.contains(&why), "{e}");
                assert_eq!(default, DeviceArg::Cpu);
            }
        }
    }
}
