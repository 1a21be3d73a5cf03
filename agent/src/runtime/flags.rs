//! The engine flags every model-running subcommand shares (`--model`, `--device`, KV cache,
//! scheduler and LoRA limits), apart from what starting an engine does with them.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use peregrine_engine::lora::LoraConfig;
use peregrine_engine::model::rowquant::RowFormat;
use peregrine_engine::model::LoadFormat;

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
    /// e4m3 bytes, scale 1 (cuda, compute capability 8.9+), rotated as [`FP8_KV_DEFAULT`] says (the
    /// figures of `peregrine-agent eval` chose it).
    #[value(alias = "fp8_e4m3")]
    Fp8,
    /// fp8 with q and k rotated by the normalized Walsh–Hadamard matrix per head before k is
    /// stored: scores unchanged, k's outlier dimensions spread before rounding.
    Fp8Hadamard,
    /// fp8 with q, k and v rotated, and each head of the attention output rotated back before
    /// o_proj (H is its own inverse): v's rounding error is spread over the head too.
    Fp8HadamardQkv,
    /// fp8 without the rotation.
    Fp8Plain,
    /// fp8 with one scale per token and KV head (`max |x| / 448`, 4 bytes per head beside its 64–128
    /// codes) instead of scale 1, and q and k rotated as `fp8-hadamard`: the head vector uses e4m3's
    /// whole range instead of its subnormals.
    Fp8Scaled,
    /// fp8 with per-head scales, without the rotation.
    Fp8ScaledPlain,
    /// int8 with one scale per token and KV head (`max |x| / 127`, 4 bytes per head beside its
    /// codes), q and k rotated as `fp8-hadamard`: a uniform grid over each head vector's range, which
    /// keeps near-Gaussian K and V several times closer than e4m3's 3-bit mantissa (cuda, compute
    /// capability 8.9+, as the fp8 caches).
    Int8,
    /// int8 with per-head scales, without the rotation.
    Int8Plain,
}

/// What `--kv-cache-dtype fp8` means: `fp8-hadamard` (q and k rotated). From `peregrine-agent eval` on
/// the CPU (SmolLM2 against the f32 cache; docs/benchmarks.md, "fp8 KV: rotating v too"): rotating
/// q and k is what counts, KL over the text's 1198 positions 0.0144 → 0.0055 nats (paired z ≈ 6).
/// Rotating v as well (`fp8-hadamard-qkv`) halves the KL at the prompts' 36 short-context positions
/// (0.0069 → 0.0035, mean |Δlogit| 0.30 → 0.19) but leaves the text's unchanged (0.00545 vs 0.00546,
/// z 0.02) and its perplexity within noise (+0.86 % vs +0.66 %, z 0.7): over many keys the softmax
/// averages v's rounding away, over few it does not. It costs one more kernel per layer (the output
/// rotated back) and, with W8A8 weights, measured no better (prompts' mean |Δ| 1.15 vs 0.87). So
/// the cheaper rotation stays the default; `fp8-hadamard-qkv` is there for short-context work.
///
/// Per-head scales (`fp8-scaled`: one f32 per token and KV head, q/k rotated) are not the default
/// either. On the H200 (docs/benchmarks.md, "fp8 KV with one scale per token and KV head, on the
/// GPU") they improve every KL and perplexity column a little (prompts' KL 0.0047 → 0.0037, text KL
/// 0.0050 → 0.0046, perplexity +0.67 % → +0.40 %, within that text's noise) and the mean |Δ| against
/// transformers 2.94 → 2.67 × the bf16 cache's, but decode at contexts of 1–2k tokens loses 4–6 %
/// (each key's score and probability scaled in the attention kernels) and the cache 3 % of its
/// tokens (d = 128). Users who weigh fidelity over that choose it by name.
///
/// No e4m3 cache meets the bound (mean |Δ| ≤ 1.5 × the bf16 cache's against transformers;
/// the best is 2.67 ×). `int8` does (1.23 ×, text KL 0.00064 against fp8's 0.0050; docs/benchmarks.md,
/// "int8 KV cache"), at `fp8-scaled`'s decode cost, but it is not fp8, so `fp8` keeps meaning e4m3.
pub const FP8_KV_DEFAULT: KvCacheDtypeArg = KvCacheDtypeArg::Fp8Hadamard;

impl KvCacheDtypeArg {
    /// The 8-bit cache's rotation of q and k, or None for a 16-bit cache.
    pub fn fp8_hadamard(self) -> Option<bool> {
        match self {
            KvCacheDtypeArg::Auto | KvCacheDtypeArg::Bf16 => None,
            KvCacheDtypeArg::Fp8 => FP8_KV_DEFAULT.fp8_hadamard(),
            KvCacheDtypeArg::Fp8Hadamard | KvCacheDtypeArg::Fp8HadamardQkv | KvCacheDtypeArg::Fp8Scaled | KvCacheDtypeArg::Int8 => Some(true),
            KvCacheDtypeArg::Fp8Plain | KvCacheDtypeArg::Fp8ScaledPlain | KvCacheDtypeArg::Int8Plain => Some(false),
        }
    }

    /// Whether the fp8 cache keeps one scale per token and KV head.
    pub fn fp8_head_scales(self) -> bool {
        match self {
            KvCacheDtypeArg::Fp8 => FP8_KV_DEFAULT.fp8_head_scales(),
            KvCacheDtypeArg::Fp8Scaled | KvCacheDtypeArg::Fp8ScaledPlain => true,
            KvCacheDtypeArg::Auto | KvCacheDtypeArg::Bf16 | KvCacheDtypeArg::Fp8Hadamard | KvCacheDtypeArg::Fp8HadamardQkv | KvCacheDtypeArg::Fp8Plain => false,
            KvCacheDtypeArg::Int8 | KvCacheDtypeArg::Int8Plain => false,
        }
    }

    /// Whether the 8-bit cache holds int8 codes (with a scale per token and KV head).
    pub fn int8(self) -> bool {
        matches!(self, KvCacheDtypeArg::Int8 | KvCacheDtypeArg::Int8Plain)
    }

    /// Whether v is rotated too (and the attention output rotated back).
    pub fn fp8_hadamard_v(self) -> bool {
        match self {
            KvCacheDtypeArg::Fp8 => FP8_KV_DEFAULT.fp8_hadamard_v(),
            KvCacheDtypeArg::Fp8HadamardQkv => true,
            KvCacheDtypeArg::Auto | KvCacheDtypeArg::Bf16 | KvCacheDtypeArg::Fp8Hadamard | KvCacheDtypeArg::Fp8Plain | KvCacheDtypeArg::Fp8Scaled | KvCacheDtypeArg::Fp8ScaledPlain => false,
            KvCacheDtypeArg::Int8 | KvCacheDtypeArg::Int8Plain => false,
        }
    }
}

/// `--quantization`: 8-bit linear weights made at load, one scale per output row, with activations
/// quantized per token at run time (W8A8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum QuantizationArg {
    /// OCP e4m3 weights and activations.
    Fp8,
    /// Symmetric int8 weights and activations.
    Int8,
}

impl From<QuantizationArg> for RowFormat {
    fn from(q: QuantizationArg) -> Self {
        match q {
            QuantizationArg::Fp8 => RowFormat::Fp8E4m3,
            QuantizationArg::Int8 => RowFormat::Int8,
        }
    }
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
    /// Tokenizer to use instead of the model's: a `tokenizer.json`, a folder with one (and
    /// `tokenizer_config.json` for the end-of-sequence token) or a GGUF file. For `--load-format
    /// dummy` shapes, which come without one; its vocabulary must fit the model's.
    #[arg(long, env = "PEREGRINE_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
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
    /// Admit requests on the KV blocks they need now only, without projecting how far the running
    /// ones will still grow (more preemptions under memory pressure; vLLM's policy).
    #[arg(long, env = "PEREGRINE_DISABLE_KV_LOOKAHEAD")]
    pub disable_kv_lookahead: bool,
    /// CPU backend threads (default: all cores).
    #[arg(long, env = "PEREGRINE_THREADS")]
    pub threads: Option<usize>,
    /// Seeds sampling of requests that bring no seed.
    #[arg(long, env = "PEREGRINE_SEED", default_value_t = 0)]
    pub seed: u64,
    /// Where the model runs (default: cuda when a CUDA device is usable, else cpu).
    #[arg(long, value_enum, env = "PEREGRINE_DEVICE")]
    pub device: Option<DeviceArg>,
    /// Tensor-parallel size: split the model's heads, MLP channels and vocabulary over N ranks
    /// (1: today's single-device path, unchanged). `--device cpu` with N > 1 runs the fake TP (N
    /// CPU ranks with host all-reduces): a correctness tool for the sharding, not a speed feature.
    /// `--device cuda` with N > 1 is refused: the NCCL path is not built yet.
    #[arg(long, env = "PEREGRINE_TENSOR_PARALLEL_SIZE", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=peregrine_engine::tp::MAX_TP_SIZE as i64))]
    pub tensor_parallel_size: u32,
    /// Fraction of the GPU's memory to use for weights, activations and KV cache (cuda only).
    #[arg(long, env = "PEREGRINE_GPU_MEMORY_UTILIZATION", default_value_t = 0.9)]
    pub gpu_memory_utilization: f32,
    /// KV cache element type. fp8 (cuda only, compute capability 8.9+): e4m3 with scale 1, twice the
    /// tokens in the same memory and half the bytes decode attention reads, at fp8's precision; q
    /// and k Hadamard-rotated per head first (= fp8-hadamard; fp8-hadamard-qkv: v too, the attention
    /// output rotated back; fp8-plain: not rotated). fp8-scaled: one scale per token and KV head
    /// instead of 1 (q/k rotated; fp8-scaled-plain: not rotated), closer to bf16, 4-6% slower decode.
    /// int8: int8 codes with one scale per token and KV head (q/k rotated; int8-plain: not rotated),
    /// the closest 8-bit cache to bf16, at fp8-scaled's decode cost.
    #[arg(long, value_enum, env = "PEREGRINE_KV_CACHE_DTYPE", default_value = "auto")]
    pub kv_cache_dtype: KvCacheDtypeArg,
    /// Quantize the decoder layers' linear weights to 8 bits at load (one scale per output row;
    /// activations per token at run time). Embedding, norms and LM head stay as loaded. An FP8
    /// checkpoint (config.json quant_method "fp8") is read as FP8 without this flag. cuda: fp8 needs
    /// compute capability 8.9+, int8 8.0+ (8-bit GEMV for decode, 8-bit tensor-core GEMM for prefill).
    #[arg(long, value_enum, env = "PEREGRINE_QUANTIZATION")]
    pub quantization: Option<QuantizationArg>,
    /// With --quantization: rotate the residual stream by a fixed orthogonal matrix, and each
    /// attention head's values by a Walsh-Hadamard matrix, folded into the weights at load, and
    /// down_proj's input by a block Walsh-Hadamard as it is quantized (the model's function is
    /// unchanged), so one scale per token spends less of its range on outlier channels. Helps int8
    /// (SmolLM2 on an H200: perplexity +2.09% -> +0.57%, text KL 0.028 -> 0.005); hurts fp8, whose
    /// per-value precision does not care about outliers until a rotation spreads them. LoRA
    /// adapters (trained on the unrotated model) are rotated alike as they are loaded. With
    /// --load-format dummy on cuda only the run-time rotation runs (to measure its cost).
    #[arg(long, env = "PEREGRINE_QUANTIZATION_ROTATION")]
    pub quantization_rotation: bool,
    /// With --quantization: round the weights with GPTQ's error feedback instead of to the nearest
    /// code, calibrated at load on 2048 tokens the model samples itself (no dataset); same format,
    /// same speed. SmolLM2 int8 rotated: perplexity +0.39% -> +0.15%, top-1 35 -> 36 of 36 (CPU).
    /// Runs on the CPU with the unquantized weights in host memory: seconds for SmolLM2; refused for
    /// a model whose input statistics would exceed 16 GiB (about 2B parameters and up).
    #[arg(long, env = "PEREGRINE_QUANTIZATION_GPTQ")]
    pub quantization_gptq: bool,
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
    /// Threads that compute structured-output token masks, a pool of their own (default: one fewer
    /// than the cores; at most 256).
    #[arg(long, env = "PEREGRINE_MASK_THREADS")]
    pub mask_threads: Option<usize>,
}

impl EngineArgs {
    pub fn threads(&self) -> usize {
        self.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)).max(1)
    }

    /// The LoRA limits when LoRA is on (`--enable-lora` or any `--lora-modules`).
    pub fn lora_config(&self) -> Option<LoraConfig> {
        (self.enable_lora || !self.lora_modules.is_empty()).then_some(LoraConfig {
            max_loras: self.max_loras,
            max_lora_rank: self.max_lora_rank,
            max_cpu_loras: self.max_cpu_loras,
        })
    }
}
