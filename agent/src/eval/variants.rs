//! The configurations `eval` compares (weights × KV cache), and the backend each one runs on.

use peregrine_engine::backend::cpu::kv_cache::{KvElem, KvFormat};
use peregrine_engine::backend::cpu::calibrate::{self, CalibrationPlan};
use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::{Backend, KvCacheShape};
use peregrine_engine::model::quantize::{quantize_linear_weights_with, Granularity};
use peregrine_engine::model::rotate::{rotate_residual_stream, ROTATION_SEED};
use peregrine_engine::model::rowquant::{Activations, RowFormat};
use peregrine_engine::model::ModelWeights;

use crate::runtime::{DeviceArg, KvCacheDtypeArg, FP8_KV_DEFAULT};

/// How the decoder's linear weights are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightOption {
    /// As loaded: f32 on the CPU, bf16 on CUDA.
    Unquantized,
    /// `rotated`: the residual stream rotated first (`model::rotate`), so per-token activations lose
    /// less. `gptq`: rounded with GPTQ's error feedback over calibration tokens the model samples
    /// (`--quantization-gptq`, per-row scales only) instead of to the nearest code.
    Quantized { format: RowFormat, granularity: Granularity, activations: Activations, rotated: bool, gptq: bool },
}

impl WeightOption {
    /// What `--quantization` does: one scale per output row, activations per token (W8A8).
    pub fn default_for(format: RowFormat) -> Self {
        WeightOption::Quantized { format, granularity: Granularity::PerRow, activations: Activations::PerToken, rotated: false, gptq: false }
    }

    fn label(&self, device: DeviceArg) -> String {
        match *self {
            WeightOption::Unquantized => match device {
                DeviceArg::Cpu => "weights f32".into(),
                DeviceArg::Cuda => "weights bf16".into(),
            },
            WeightOption::Quantized { format, granularity, activations, rotated, gptq } => format!(
                "{} {}, per {}{}{}",
                format.name(),
                match activations {
                    Activations::PerToken => "W8A8",
                    Activations::Float => "W8A16",
                },
                match granularity {
                    Granularity::PerRow => "row",
                    Granularity::PerTensor => "tensor",
                },
                if rotated { ", rotated" } else { "" },
                if gptq { ", GPTQ" } else { "" }
            ),
        }
    }
}

/// How the KV cache keeps K and V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvOption {
    /// The backend's own: f32 on the CPU, bf16 on CUDA.
    Native,
    /// As the CPU cache's format says (the CUDA cache runs the ones with one type for K and V).
    Typed(KvFormat),
}

impl KvOption {
    pub const BF16: KvOption = KvOption::Typed(KvFormat { k: KvElem::Bf16, v: KvElem::Bf16, hadamard: false, hadamard_v: false });

    pub fn fp8(hadamard: bool) -> KvOption {
        KvOption::Typed(KvFormat::both(KvElem::Fp8E4m3, hadamard))
    }

    /// fp8 with q, k and v rotated (`fp8-hadamard-qkv`).
    pub fn fp8_qkv() -> KvOption {
        KvOption::Typed(KvFormat { hadamard_v: true, ..KvFormat::both(KvElem::Fp8E4m3, true) })
    }

    /// What a `--kv-cache-dtype` value stores.
    pub fn from_flag(flag: KvCacheDtypeArg) -> KvOption {
        match flag {
            KvCacheDtypeArg::Auto => KvOption::Native,
            KvCacheDtypeArg::Bf16 => KvOption::BF16,
            KvCacheDtypeArg::Fp8 => KvOption::from_flag(FP8_KV_DEFAULT),
            KvCacheDtypeArg::Fp8Hadamard => KvOption::fp8(true),
            KvCacheDtypeArg::Fp8HadamardQkv => KvOption::fp8_qkv(),
            KvCacheDtypeArg::Fp8Plain => KvOption::fp8(false),
            KvCacheDtypeArg::Fp8Scaled => KvOption::Typed(KvFormat::both(KvElem::Fp8E4m3PerHead, true)),
            KvCacheDtypeArg::Fp8ScaledPlain => KvOption::Typed(KvFormat::both(KvElem::Fp8E4m3PerHead, false)),
            KvCacheDtypeArg::Int8 => KvOption::Typed(KvFormat::both(KvElem::Int8PerHead, true)),
            KvCacheDtypeArg::Int8Plain => KvOption::Typed(KvFormat::both(KvElem::Int8PerHead, false)),
        }
    }

    fn label(&self, device: DeviceArg) -> String {
        match self {
            KvOption::Native => match device {
                DeviceArg::Cpu => "KV f32".into(),
                DeviceArg::Cuda => "KV bf16".into(),
            },
            KvOption::Typed(format) => format!("KV {}", format.label()),
        }
    }
}

/// One configuration: weights × KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variant {
    pub weights: WeightOption,
    pub kv: KvOption,
}

impl Variant {
    pub fn label(&self, device: DeviceArg) -> String {
        format!("{} · {}", self.weights.label(device), self.kv.label(device))
    }
}

/// Every configuration worth comparing on `device`: each weight format with the native cache, each
/// cache with unquantized weights, and fp8 weights with the fp8 cache's default.
pub fn table(device: DeviceArg) -> Vec<Variant> {
    use Activations::{Float, PerToken};
    use Granularity::{PerRow, PerTensor};
    let native = |weights| Variant { weights, kv: KvOption::Native };
    let unquantized = |kv| Variant { weights: WeightOption::Unquantized, kv };
    let mut out = Vec::new();
    for format in [RowFormat::Fp8E4m3, RowFormat::Int8] {
        let combos: &[(Granularity, Activations)] = match device {
            // The CPU computes every combination with the same 8-bit values.
            DeviceArg::Cpu => &[(PerRow, PerToken), (PerTensor, PerToken), (PerRow, Float), (PerTensor, Float)],
            // The CUDA backend runs what `--quantization` does.
            DeviceArg::Cuda => &[(PerRow, PerToken)],
        };
        for &(granularity, activations) in combos {
            out.push(native(WeightOption::Quantized { format, granularity, activations, rotated: false, gptq: false }));
        }
        // W8A8 per row over the rotated residual stream.
        out.push(native(WeightOption::Quantized { format, granularity: PerRow, activations: PerToken, rotated: true, gptq: false }));
        // GPTQ's rounding instead of the nearest code: on the plain model, and on the rotated one.
        for rotated in [false, true] {
            out.push(native(WeightOption::Quantized { format, granularity: PerRow, activations: PerToken, rotated, gptq: true }));
        }
        if device == DeviceArg::Cpu {
            // GPTQ on the weights alone (W8A16): how far the rounding can go without the activations.
            out.push(native(WeightOption::Quantized { format, granularity: PerRow, activations: Float, rotated: false, gptq: true }));
        }
    }
    // The bf16 cache on both devices: on CUDA it is the reference itself (0 against it, and a check
    // that runs repeat), and its column against `--reference-logits` is the bf16 cache's own cost.
    out.push(unquantized(KvOption::BF16));
    // Every fp8 cache `--kv-cache-dtype` offers, on both devices.
    out.push(unquantized(KvOption::fp8(false)));
    out.push(unquantized(KvOption::fp8(true)));
    out.push(unquantized(KvOption::fp8_qkv()));
    if device == DeviceArg::Cpu {
        // The cheaper alternatives: only one of K and V in fp8 (CPU only so far).
        for hadamard in [false, true] {
            out.push(unquantized(KvOption::Typed(KvFormat { v: KvElem::Bf16, ..KvFormat::both(KvElem::Fp8E4m3, hadamard) })));
        }
        out.push(unquantized(KvOption::Typed(KvFormat { k: KvElem::Bf16, ..KvFormat::both(KvElem::Fp8E4m3, false) })));
        // Per-head scales on one of K and V only (q/k rotated): which half of `fp8-scaled`'s gain
        // each brings (the CUDA kernels pay more per key for V's scale than for K's).
        out.push(unquantized(KvOption::Typed(KvFormat { k: KvElem::Fp8E4m3PerHead, ..KvFormat::both(KvElem::Fp8E4m3, true) })));
        out.push(unquantized(KvOption::Typed(KvFormat { v: KvElem::Fp8E4m3PerHead, ..KvFormat::both(KvElem::Fp8E4m3, true) })));
        // K kept in bf16 (over the long text K's rounding is what costs), V per-head fp8.
        out.push(unquantized(KvOption::Typed(KvFormat { k: KvElem::Bf16, ..KvFormat::both(KvElem::Fp8E4m3PerHead, false) })));
    }
    // e4m3 with a scale per token and KV head instead of 1 (`fp8-scaled-plain`, `fp8-scaled`, and
    // with v rotated too).
    out.push(unquantized(KvOption::from_flag(KvCacheDtypeArg::Fp8ScaledPlain)));
    out.push(unquantized(KvOption::from_flag(KvCacheDtypeArg::Fp8Scaled)));
    out.push(unquantized(KvOption::Typed(KvFormat { hadamard_v: true, ..KvFormat::both(KvElem::Fp8E4m3PerHead, true) })));
    // int8 with a scale per token and KV head (`int8-plain`, `int8`).
    out.push(unquantized(KvOption::from_flag(KvCacheDtypeArg::Int8Plain)));
    out.push(unquantized(KvOption::from_flag(KvCacheDtypeArg::Int8)));
    out.push(Variant { weights: WeightOption::default_for(RowFormat::Fp8E4m3), kv: KvOption::from_flag(KvCacheDtypeArg::Fp8) });
    // Everything int8: rotated W8A8 weights and the int8 cache.
    out.push(Variant {
        weights: WeightOption::Quantized { format: RowFormat::Int8, granularity: PerRow, activations: PerToken, rotated: true, gptq: false },
        kv: KvOption::from_flag(KvCacheDtypeArg::Int8),
    });
    out
}

/// The weights a configuration runs with (a copy, rotated and quantized as it says; `calibration`
/// gives GPTQ's tokens, sampled once from the unquantized model).
pub fn weights_for(weights: &ModelWeights, option: WeightOption, calibration: &Calibration) -> anyhow::Result<ModelWeights> {
    let mut w = weights.clone();
    if let WeightOption::Quantized { format, granularity, activations, rotated, gptq } = option {
        if rotated {
            rotate_residual_stream(&mut w, ROTATION_SEED)?;
        }
        if gptq {
            if granularity != Granularity::PerRow {
                anyhow::bail!("GPTQ keeps round-to-nearest's per-row scales");
            }
            let inputs = calibrate::linear_inputs(&w, calibration.tokens(weights)?, calibration.threads)?;
            calibrate::quantize_linear_weights(&mut w, format, activations, &inputs)?;
        } else {
            quantize_linear_weights_with(&mut w, format, granularity, activations)?;
        }
    }
    Ok(w)
}

/// GPTQ's calibration tokens, sampled from the unquantized model the first time a variant needs them.
pub struct Calibration {
    threads: usize,
    tokens: std::cell::OnceCell<Vec<Vec<u32>>>,
}

impl Calibration {
    pub fn new(threads: usize) -> Calibration {
        Calibration { threads, tokens: std::cell::OnceCell::new() }
    }

    fn tokens(&self, unquantized: &ModelWeights) -> anyhow::Result<&[Vec<u32>]> {
        if self.tokens.get().is_none() {
            let sampled = calibrate::sample_tokens(unquantized, CalibrationPlan::default(), self.threads)?;
            let _ = self.tokens.set(sampled);
        }
        Ok(self.tokens.get().map(Vec::as_slice).unwrap_or_default())
    }
}

/// A CPU backend for `variant` with room for `longest` tokens.
pub fn cpu_backend(weights: &ModelWeights, variant: &Variant, longest: usize, threads: usize, calibration: &Calibration) -> anyhow::Result<Box<dyn Backend>> {
    let block_size = 16;
    let shape = KvCacheShape { num_blocks: longest.div_ceil(block_size).max(1), block_size };
    let mut backend = CpuBackend::new(weights_for(weights, variant.weights, calibration)?, shape, threads)?;
    if let KvOption::Typed(format) = variant.kv {
        backend.set_kv_format(format)?;
    }
    Ok(Box::new(backend))
}

/// A CUDA backend for `variant` with room for `longest` tokens and steps of `chunk` one-token
/// sequences.
#[cfg(feature = "cuda")]
pub fn cuda_backend(weights: &ModelWeights, variant: &Variant, longest: usize, chunk: usize, calibration: &Calibration) -> anyhow::Result<Box<dyn Backend>> {
    use anyhow::Context;
    use peregrine_engine::backend::cuda::{CudaBackend, CudaOptions, KvCacheDtype, WeightInit};
    let quantization = match variant.weights {
        WeightOption::Unquantized => None,
        WeightOption::Quantized { format, granularity: Granularity::PerRow, activations: Activations::PerToken, .. } => Some(format),
        WeightOption::Quantized { .. } => anyhow::bail!("the CUDA backend runs per-row W8A8 weights only"),
    };
    let (kv_cache_dtype, kv_hadamard, kv_hadamard_v) = match variant.kv {
        KvOption::Native => (KvCacheDtype::Bf16, false, false),
        KvOption::Typed(KvFormat { hadamard: false, hadamard_v: true, .. }) => anyhow::bail!("the CUDA backend rotates v only together with q and k"),
        KvOption::Typed(KvFormat { k: KvElem::Bf16, v: KvElem::Bf16, hadamard, hadamard_v }) => (KvCacheDtype::Bf16, hadamard, hadamard_v),
        KvOption::Typed(KvFormat { k: KvElem::Fp8E4m3, v: KvElem::Fp8E4m3, hadamard, hadamard_v }) => (KvCacheDtype::Fp8E4m3, hadamard, hadamard_v),
        KvOption::Typed(KvFormat { k: KvElem::Fp8E4m3PerHead, v: KvElem::Fp8E4m3PerHead, hadamard, hadamard_v }) => (KvCacheDtype::Fp8E4m3PerHead, hadamard, hadamard_v),
        KvOption::Typed(KvFormat { k: KvElem::Int8PerHead, v: KvElem::Int8PerHead, hadamard, hadamard_v }) => (KvCacheDtype::Int8PerHead, hadamard, hadamard_v),
        KvOption::Typed(_) => anyhow::bail!("the CUDA cache keeps K and V in one type (bf16, fp8 or int8)"),
    };
    let block_size = 16;
    let opts = CudaOptions {
        block_size,
        gpu_memory_utilization: 0.9,
        max_model_len: longest.next_multiple_of(block_size),
        max_num_batched_tokens: chunk,
        max_num_seqs: chunk,
        num_blocks: Some(longest.div_ceil(block_size) + 1),
        cuda_graph_max_batch: 0,
        kv_cache_dtype,
        kv_hadamard,
        kv_hadamard_v,
        quantization,
        ..CudaOptions::default()
    };
    // The backend quantizes the host weights itself (to the nearest code): a rotated variant hands
    // it the rotated ones, a GPTQ one the host's GPTQ codes (which it keeps).
    let prepared;
    let weights = match variant.weights {
        WeightOption::Quantized { gptq: true, .. } => {
            prepared = weights_for(weights, variant.weights, calibration)?;
            &prepared
        }
        WeightOption::Quantized { rotated: true, .. } => {
            let mut w = weights.clone();
            rotate_residual_stream(&mut w, ROTATION_SEED)?;
            prepared = w;
            &prepared
        }
        _ => weights,
    };
    Ok(Box::new(CudaBackend::new(WeightInit::Host(weights), &opts).context("starting the CUDA backend")?))
}

#[cfg(not(feature = "cuda"))]
pub fn cuda_backend(_: &ModelWeights, _: &Variant, _: usize, _: usize, _: &Calibration) -> anyhow::Result<Box<dyn Backend>> {
    anyhow::bail!("this build has no CUDA support (built without the `cuda` feature)")
}
