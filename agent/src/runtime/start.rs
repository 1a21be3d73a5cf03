//! How the engine flags become a running engine: weights → backend on the chosen device → KV cache
//! sized from a memory budget → engine thread, with multi-LoRA when asked for.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use clap::ValueEnum;
use peregrine_engine::backend::cpu::calibrate::{self, CalibrationPlan};
use peregrine_engine::backend::cpu::tp::CpuTpBackend;
use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::{Backend, KvCacheShape};
use peregrine_engine::config::ModelConfig;
use peregrine_engine::engine::{Engine, EngineConfig, EngineHandle};
use peregrine_engine::model;
use peregrine_engine::model::rotate::AdapterRotation;
use peregrine_engine::tokenizer::Tokenizer;

use super::flags::{DeviceArg, EngineArgs, KvCacheDtypeArg, LoadFormatArg};
#[cfg(test)]
use super::flags::QuantizationArg;

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

    /// `--device`, or its default: cuda when usable, else cpu. Asking for cuda where it cannot run
    /// is an error naming the reason, never a silent fallback.
    pub fn device(&self) -> anyhow::Result<DeviceArg> {
        match self.device {
            Some(DeviceArg::Cpu) => Ok(DeviceArg::Cpu),
            Some(DeviceArg::Cuda) => match cuda_available() {
                Ok(()) => Ok(DeviceArg::Cuda),
                Err(why) => anyhow::bail!("--device cuda: no usable CUDA device: {why}"),
            },
            None => Ok(default_device()),
        }
    }

    fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len,
            block_size: self.block_size,
            enable_prefix_caching: !self.disable_prefix_caching,
            kv_lookahead: !self.disable_kv_lookahead,
            seed: self.seed,
        }
    }

    /// `--quantization-rotation`: the residual stream and each head's values rotated, in the host
    /// weights, before a backend quantizes them; what adapters then need to be rotated alike.
    fn rotate(&self, weights: &mut model::ModelWeights) -> anyhow::Result<Option<Arc<AdapterRotation>>> {
        if !self.quantization_rotation {
            return Ok(None);
        }
        tracing::info!("rotating the residual stream (--quantization-rotation)");
        let rotation = model::rotate::rotate_residual_stream(weights, model::rotate::ROTATION_SEED).context("--quantization-rotation")?;
        Ok(Some(Arc::new(rotation)))
    }

    /// `--quantization-gptq`: the linear weights rounded with GPTQ on the host, after any rotation.
    fn calibrate(&self, weights: &mut model::ModelWeights) -> anyhow::Result<()> {
        let (true, Some(q)) = (self.quantization_gptq, self.quantization) else { return Ok(()) };
        tracing::info!("quantizing with GPTQ (--quantization-gptq): calibrating on the CPU");
        let started = std::time::Instant::now();
        calibrate::quantize_with_calibration(weights, q.into(), CalibrationPlan::default(), self.threads()).context("--quantization-gptq")?;
        tracing::info!("GPTQ quantization done in {:.1} s", started.elapsed().as_secs_f64());
        Ok(())
    }

    /// Loads the model, builds the backend, starts the engine thread and loads `--lora-modules`.
    pub fn start(&self) -> anyhow::Result<Runtime> {
        if let Some(n) = self.mask_threads {
            // Before any mask: the pool starts with the first one and keeps its size.
            peregrine_engine::structured::set_mask_threads(n);
        }
        let tp = self.tensor_parallel_size as usize;
        // Refused before the device is probed: with N > 1 on cuda, nothing (not even whether N
        // GPUs exist) is checked.
        if self.device == Some(DeviceArg::Cuda) {
            refuse_cuda_tp(tp)?;
        }
        let device = self.device()?;
        if device == DeviceArg::Cuda {
            refuse_cuda_tp(tp)?;
        }
        if device == DeviceArg::Cpu && self.kv_cache_dtype != KvCacheDtypeArg::Auto {
            let asked = self.kv_cache_dtype.to_possible_value().map_or_else(String::new, |v| v.get_name().to_string());
            anyhow::bail!("--kv-cache-dtype {asked}: the CPU backend keeps its KV cache in f32 (only auto); bf16 and fp8 caches are for --device cuda");
        }
        if self.quantization_rotation {
            if self.quantization.is_none() {
                anyhow::bail!("--quantization-rotation rotates the model for --quantization fp8|int8; without it there is nothing to gain");
            }
            // Random weights on the GPU (benchmarks) run the rotation's online half, so its cost is
            // measured; random host weights would only be rotated for nothing.
            if self.load_format == LoadFormatArg::Dummy && device == DeviceArg::Cpu {
                anyhow::bail!("--quantization-rotation needs real weights (not --load-format dummy) on the CPU; on cuda, dummy weights measure what its online rotation costs");
            }
        }
        if self.quantization_gptq {
            if self.quantization.is_none() {
                anyhow::bail!("--quantization-gptq rounds the weights --quantization fp8|int8 makes; without it there is nothing to round");
            }
            if self.load_format == LoadFormatArg::Dummy {
                anyhow::bail!("--quantization-gptq needs real weights (not --load-format dummy): it calibrates on text the model writes");
            }
        }
        let tokenizer = match &self.tokenizer {
            Some(path) => Some(Tokenizer::for_model(path).with_context(|| format!("loading --tokenizer {}", path.display()))?),
            None => load_tokenizer(&self.model, self.load_format)?,
        };
        let loading = || format!("loading model {}", self.model.display());
        let mut rotation = None;
        let (config, backend): (ModelConfig, Box<dyn Backend>) = match device {
            // Random weights of a big model are made on the GPU; a host copy would not even fit.
            DeviceArg::Cuda if self.load_format == LoadFormatArg::Dummy => {
                let config = model::dummy_config(&self.model).with_context(loading)?;
                (config.clone(), self.cuda_backend(ModelSource::Random(config))?)
            }
            DeviceArg::Cuda => {
                let mut loaded = model::load(&self.model, self.load_format.into()).with_context(loading)?;
                rotation = self.rotate(&mut loaded.weights)?;
                // GPTQ's codes are kept by the backend as they are (it quantizes only float weights).
                self.calibrate(&mut loaded.weights)?;
                (loaded.config.clone(), self.cuda_backend(ModelSource::Host(&loaded.weights))?)
            }
            DeviceArg::Cpu => {
                let mut loaded = model::load(&self.model, self.load_format.into()).with_context(loading)?;
                rotation = self.rotate(&mut loaded.weights)?;
                self.calibrate(&mut loaded.weights)?;
                if let Some(q) = self.quantization {
                    model::quantize::quantize_linear_weights(&mut loaded.weights, q.into())?;
                }
                let num_blocks = self.num_blocks(&loaded.config)?;
                let kv_shape = KvCacheShape { num_blocks, block_size: self.block_size };
                let backend: Box<dyn Backend> = if tp > 1 {
                    Box::new(CpuTpBackend::new(loaded.weights, kv_shape, self.threads(), tp)?)
                } else {
                    Box::new(CpuBackend::new(loaded.weights, kv_shape, self.threads())?)
                };
                (loaded.config, backend)
            }
        };
        if let Some(t) = tokenizer.as_ref().filter(|t| t.vocab_size() > config.vocab_size) {
            anyhow::bail!("the tokenizer has {} tokens, more than the model's vocabulary of {}", t.vocab_size(), config.vocab_size);
        }
        let backend_name = backend.name();
        let kv_shape = backend.kv_shape();
        let engine = match self.lora_config() {
            // Over a rotated model every adapter is rotated alike as it is read.
            Some(lora) => match rotation {
                Some(r) => Engine::start_with_lora_rotated(backend, self.engine_config(), lora, r),
                None => Engine::start_with_lora(backend, self.engine_config(), lora),
            }
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
            kv_cache_dtype: match self.kv_cache_dtype.fp8_hadamard() {
                None => KvCacheDtype::Bf16,
                Some(_) if self.kv_cache_dtype.int8() => KvCacheDtype::Int8PerHead,
                Some(_) if self.kv_cache_dtype.fp8_head_scales() => KvCacheDtype::Fp8E4m3PerHead,
                Some(_) => KvCacheDtype::Fp8E4m3,
            },
            kv_hadamard: self.kv_cache_dtype.fp8_hadamard().unwrap_or(false),
            kv_hadamard_v: self.kv_cache_dtype.fp8_hadamard_v(),
            // The backend quantizes host weights itself (the CPU's values) or makes dummy ones 8-bit.
            quantization: self.quantization.map(Into::into),
            random_down_rotation: self.quantization_rotation,
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

/// The CUDA backend drives one GPU: tensor parallelism over NCCL is not built yet.
fn refuse_cuda_tp(tp: usize) -> anyhow::Result<()> {
    if tp > 1 {
        anyhow::bail!(
            "--tensor-parallel-size {tp} with --device cuda: multi-GPU tensor parallelism (the NCCL path) is not built yet; \
             the CUDA backend runs on one GPU, so use 1 (--device cpu runs a {tp}-rank fake TP that checks the sharding)"
        );
    }
    Ok(())
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

/// cuda when a CUDA device is usable, else cpu (`--device`'s default).
pub fn default_device() -> DeviceArg {
    if cuda_available().is_ok() { DeviceArg::Cuda } else { DeviceArg::Cpu }
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

    use peregrine_engine::lora::LoraConfig;

    use super::super::flags::LoraModule;
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
    fn quantization_flag() {
        assert_eq!(parse(&[]).unwrap().quantization, None);
        assert_eq!(parse(&["--quantization", "fp8"]).unwrap().quantization, Some(QuantizationArg::Fp8));
        assert_eq!(parse(&["--quantization", "int8"]).unwrap().quantization, Some(QuantizationArg::Int8));
        assert!(parse(&["--quantization", "int4"]).is_err());
        assert!(parse(&["--quantization", "int8", "--quantization-rotation"]).unwrap().quantization_rotation);
        assert!(!parse(&["--quantization", "int8"]).unwrap().quantization_rotation);
        assert!(parse(&["--quantization", "fp8", "--quantization-gptq"]).unwrap().quantization_gptq);
        assert!(!parse(&["--quantization", "fp8"]).unwrap().quantization_gptq);
    }

    #[test]
    fn kv_cache_dtype_flag() {
        assert_eq!(parse(&[]).unwrap().kv_cache_dtype, KvCacheDtypeArg::Auto);
        assert_eq!(parse(&["--kv-cache-dtype", "fp8"]).unwrap().kv_cache_dtype, KvCacheDtypeArg::Fp8);
        assert_eq!(parse(&["--kv-cache-dtype", "fp8_e4m3"]).unwrap().kv_cache_dtype, KvCacheDtypeArg::Fp8, "vLLM's long name");
        assert_eq!(parse(&["--kv-cache-dtype", "bf16"]).unwrap().kv_cache_dtype, KvCacheDtypeArg::Bf16);
        assert_eq!(parse(&["--kv-cache-dtype", "fp8-hadamard"]).unwrap().kv_cache_dtype.fp8_hadamard(), Some(true));
        assert_eq!(parse(&["--kv-cache-dtype", "fp8-plain"]).unwrap().kv_cache_dtype.fp8_hadamard(), Some(false));
        let qkv = parse(&["--kv-cache-dtype", "fp8-hadamard-qkv"]).unwrap().kv_cache_dtype;
        assert_eq!((qkv.fp8_hadamard(), qkv.fp8_hadamard_v()), (Some(true), true));
        assert!(!KvCacheDtypeArg::Fp8Hadamard.fp8_hadamard_v() && !KvCacheDtypeArg::Fp8Plain.fp8_hadamard_v());
        let scaled = parse(&["--kv-cache-dtype", "fp8-scaled"]).unwrap().kv_cache_dtype;
        assert_eq!((scaled.fp8_hadamard(), scaled.fp8_hadamard_v(), scaled.fp8_head_scales()), (Some(true), false, true));
        let scaled_plain = parse(&["--kv-cache-dtype", "fp8-scaled-plain"]).unwrap().kv_cache_dtype;
        assert_eq!((scaled_plain.fp8_hadamard(), scaled_plain.fp8_head_scales()), (Some(false), true));
        assert!(!KvCacheDtypeArg::Fp8Hadamard.fp8_head_scales() && !KvCacheDtypeArg::Bf16.fp8_head_scales());
        // fp8 means whatever FP8_KV_DEFAULT names, and that is one of the fp8 options.
        let default = super::super::FP8_KV_DEFAULT;
        assert_eq!(KvCacheDtypeArg::Fp8.fp8_hadamard(), default.fp8_hadamard());
        assert_eq!(KvCacheDtypeArg::Fp8.fp8_hadamard_v(), default.fp8_hadamard_v());
        assert_eq!(KvCacheDtypeArg::Fp8.fp8_head_scales(), default.fp8_head_scales());
        assert!(default.fp8_hadamard().is_some() && default != KvCacheDtypeArg::Fp8);
        assert_eq!(KvCacheDtypeArg::Bf16.fp8_hadamard(), None);
        let int8 = parse(&["--kv-cache-dtype", "int8"]).unwrap().kv_cache_dtype;
        assert_eq!((int8.fp8_hadamard(), int8.fp8_hadamard_v(), int8.int8(), int8.fp8_head_scales()), (Some(true), false, true, false));
        let int8_plain = parse(&["--kv-cache-dtype", "int8-plain"]).unwrap().kv_cache_dtype;
        assert_eq!((int8_plain.fp8_hadamard(), int8_plain.int8()), (Some(false), true));
        assert!(!KvCacheDtypeArg::Fp8Scaled.int8() && !KvCacheDtypeArg::Fp8.int8());
        assert!(parse(&["--kv-cache-dtype", "int4"]).is_err());
    }

    #[test]
    fn cpu_refuses_a_kv_cache_type_it_does_not_keep() {
        let a = parse(&["--device", "cpu", "--kv-cache-dtype", "fp8"]).unwrap();
        let e = a.start().err().expect("fp8 on the CPU is refused").to_string();
        assert!(e.contains("--kv-cache-dtype") && e.contains("cuda"), "{e}");
    }

    #[test]
    fn quantization_options_are_refused_where_they_cannot_apply() {
        for (args, flag, why) in [
            (&["--device", "cpu", "--quantization-rotation"][..], "--quantization-rotation", "--quantization fp8|int8"),
            (&["--device", "cpu", "--quantization", "int8", "--quantization-rotation", "--load-format", "dummy"][..], "--quantization-rotation", "dummy"),
            (&["--device", "cpu", "--quantization-gptq"][..], "--quantization-gptq", "--quantization fp8|int8"),
            (&["--device", "cpu", "--quantization", "int8", "--quantization-gptq", "--load-format", "dummy"][..], "--quantization-gptq", "dummy"),
        ] {
            let e = parse(args).unwrap().start().err().expect("refused").to_string();
            assert!(e.contains(flag) && e.contains(why), "{args:?}: {e}");
        }
    }

    #[test]
    fn tensor_parallel_size_flag() {
        assert_eq!(parse(&[]).unwrap().tensor_parallel_size, 1, "one rank unless asked");
        assert_eq!(parse(&["--tensor-parallel-size", "4"]).unwrap().tensor_parallel_size, 4);
        assert!(parse(&["--tensor-parallel-size", "0"]).is_err());
        assert!(parse(&["--tensor-parallel-size", "65"]).is_err(), "bounded");
    }

    #[test]
    fn cuda_refuses_tensor_parallelism_without_looking_for_gpus() {
        let a = parse(&["--device", "cuda", "--tensor-parallel-size", "2"]).unwrap();
        let e = a.start().err().expect("TP on cuda is refused").to_string();
        assert!(e.contains("--tensor-parallel-size 2") && e.contains("NCCL") && e.contains("not built"), "{e}");
        assert!(!e.contains("no usable CUDA device"), "refused before probing the device: {e}");
    }

    /// A 4-head, 2-KV-head dummy model folder (no tokenizer: dummy weights need none).
    fn dummy_folder() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"model_type":"llama","hidden_size":64,"intermediate_size":96,"num_hidden_layers":2,
               "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"max_position_embeddings":64,
               "rms_norm_eps":1e-5,"rope_theta":10000.0,"tie_word_embeddings":true,"bos_token_id":1,"eos_token_id":2}"#,
        )
        .unwrap();
        dir
    }

    #[test]
    fn cpu_runs_the_fake_tp_and_names_what_does_not_divide() {
        let dir = dummy_folder();
        let model = dir.path().to_str().unwrap();
        let flags = |tp: &str| {
            let args = ["test", "--model", model, "--load-format", "dummy", "--device", "cpu", "--threads", "1", "--num-kv-blocks", "8"];
            Cli::try_parse_from(args.into_iter().chain(["--tensor-parallel-size", tp])).unwrap().engine
        };
        let runtime = flags("2").start().unwrap();
        assert!(runtime.backend_name.contains("fake-tp2"), "{}", runtime.backend_name);
        assert_eq!(runtime.model_config.num_attention_heads, 4, "the engine sees the whole model");
        let one = flags("1").start().unwrap();
        assert!(!one.backend_name.contains("tp"), "TP=1 is the plain CPU backend: {}", one.backend_name);
        let e = format!("{:#}", flags("3").start().err().expect("3 divides neither heads nor vocabulary"));
        assert!(e.contains("attention heads (4)") && e.contains("KV heads (2)") && e.contains("vocabulary (100)"), "{e}");
        assert!(!e.contains("intermediate"), "only what does not divide is named: {e}");
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
