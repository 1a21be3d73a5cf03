//! A PEFT LoRA adapter in host memory: `adapter_config.json` + `adapter_model.safetensors`, read,
//! checked against the base model and converted to f32.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use half::slice::HalfFloatSliceExt;
use memmap2::Mmap;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use sha2::{Digest, Sha256};

use super::config::AdapterConfig;
use super::target::TargetModule;
use crate::config::ModelConfig;
use crate::{EngineError, Result};

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
const PICKLE_FILE: &str = "adapter_model.bin";

/// The low-rank pair of one projection of one layer: `delta_W = scaling * B @ A`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraPair {
    /// `[r, in]`, row-major.
    pub a: Vec<f32>,
    /// `[out, r]`, row-major.
    pub b: Vec<f32>,
}

/// An adapter's weights in f32, per layer and target module, with its rank and scaling.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraAdapter {
    pub rank: usize,
    /// `alpha / r` (or `alpha / sqrt(r)` with rsLoRA).
    pub scaling: f32,
    pub targets: Vec<TargetModule>,
    /// `layers[l][module.index()]`: `Some` exactly for the targeted modules.
    pub layers: Vec<[Option<LoraPair>; 7]>,
    /// What was read: [`content_digest`] of the folder's files at load; empty for adapters built
    /// in memory.
    pub digest: String,
}

/// `sha256:<hex>` of `adapter_config.json`'s bytes followed by `adapter_model.safetensors`'s, so
/// that `cat adapter_config.json adapter_model.safetensors | sha256sum` gives the same hex. It
/// names the content a pod serves: the operator records it per pod and compares pods by it.
pub fn content_digest(config_bytes: &[u8], weights_bytes: &[u8]) -> String {
    digest_unless_stopped(config_bytes, weights_bytes, &AtomicBool::new(false))
}

impl LoraAdapter {
    /// Loads the PEFT adapter in the folder `dir` and validates it against `base` (shapes, rank ≤
    /// `max_rank`, dtypes, the exact set of tensors, finite values).
    ///
    /// The safetensors file is mapped, not copied; its header is checked in full (names, shapes,
    /// dtypes) before any tensor data is read; then each tensor is converted once, straight into
    /// its f32 `Vec`, on the rayon pool, while another thread hashes the files for [`content_digest`].
    pub fn load(dir: &Path, base: &ModelConfig, max_rank: usize) -> Result<LoraAdapter> {
        if !dir.is_dir() {
            return Err(EngineError::invalid_adapter(
                dir,
                "not a folder (expected a PEFT adapter folder)",
            ));
        }
        let config_path = dir.join(CONFIG_FILE);
        let weights_path = dir.join(WEIGHTS_FILE);
        if !weights_path.is_file() && dir.join(PICKLE_FILE).is_file() {
            return Err(EngineError::invalid_adapter(
                dir,
                "pickle .bin adapters are not supported; convert to safetensors",
            ));
        }
        if !config_path.is_file() {
            return Err(EngineError::invalid_adapter(
                dir,
                format!("missing {CONFIG_FILE}"),
            ));
        }
        if !weights_path.is_file() {
            return Err(EngineError::invalid_adapter(
                dir,
                format!("missing {WEIGHTS_FILE}"),
            ));
        }
        // Read once: the digest and the parsed adapter come from the same bytes.
        let config_text = std::fs::read_to_string(&config_path).map_err(|source| EngineError::Io {
            path: config_path.clone(),
            source,
        })?;
        let config = AdapterConfig::from_json(&config_text)
            .map_err(|message| EngineError::invalid_adapter(&config_path, message))?;
        let bytes = WeightsBytes::open(&weights_path)?;
        let invalid = |message| EngineError::invalid_adapter(&weights_path, message);
        let plan = TensorPlan::new(&config, &bytes, base, max_rank).map_err(invalid)?;
        let (decoded, digest) = decode_and_digest(&plan, config_text.as_bytes(), &bytes);
        let mut adapter = plan.assemble(decoded.map_err(invalid)?);
        adapter.digest = digest;
        Ok(adapter)
    }

    /// Builds the adapter from a parsed config and the bytes of a safetensors file.
    pub fn from_parts(
        config: &AdapterConfig,
        safetensors_bytes: &[u8],
        base: &ModelConfig,
        max_rank: usize,
    ) -> std::result::Result<LoraAdapter, String> {
        let plan = TensorPlan::new(config, safetensors_bytes, base, max_rank)?;
        let decoded = plan.decode()?;
        Ok(plan.assemble(decoded))
    }

    /// Bytes this adapter takes in host memory (f32 weights).
    pub fn size_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| l.iter().flatten())
            .map(|p| (p.a.len() + p.b.len()) * std::mem::size_of::<f32>())
            .sum()
    }

    pub fn pair(&self, layer: usize, module: TargetModule) -> Option<&LoraPair> {
        self.layers
            .get(layer)
            .and_then(|l| l[module.index()].as_ref())
    }
}

/// `adapter_model.safetensors`'s bytes: mapped (the page cache, read in place by the conversion and
/// the digest), or read into memory when the file is small (or empty, which cannot be mapped).
enum WeightsBytes {
    Mapped(Mmap),
    Read(Vec<u8>),
}

/// Files below this size are read, not mapped: a map costs more than the copy.
const MAP_FROM_BYTES: u64 = 1 << 20;

impl WeightsBytes {
    fn open(path: &Path) -> Result<WeightsBytes> {
        let io = |source| EngineError::Io { path: path.to_path_buf(), source };
        let mut file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < MAP_FROM_BYTES {
            let mut bytes = Vec::with_capacity(len as usize);
            file.read_to_end(&mut bytes).map_err(io)?;
            return Ok(WeightsBytes::Read(bytes));
        }
        // SAFETY: a read-only private map, held only while this load runs; the file must not be
        // truncated meanwhile (as for the model loader's maps).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        // A cold file: start reading all of it now, ahead of the threads that will touch it.
        #[cfg(unix)]
        let _ = map.advise(memmap2::Advice::WillNeed);
        Ok(WeightsBytes::Mapped(map))
    }
}

impl std::ops::Deref for WeightsBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            WeightsBytes::Mapped(map) => map,
            WeightsBytes::Read(bytes) => bytes,
        }
    }
}

/// One tensor to decode: where it goes and its bytes (shape and dtype already checked).
struct PlannedTensor<'a> {
    layer: usize,
    module: TargetModule,
    is_a: bool,
    dtype: Dtype,
    data: &'a [u8],
}

impl PlannedTensor<'_> {
    fn label(&self) -> String {
        let which = if self.is_a { "lora_A" } else { "lora_B" };
        format!("layers.{}.{}.{}.{which}", self.layer, self.module.parent(), self.module)
    }

    /// The tensor's values in f32, or the message naming its first non-finite value.
    fn decode(&self) -> std::result::Result<Vec<f32>, String> {
        decode_finite(self.dtype, self.data).map_err(|(i, v)| {
            format!("{} holds a non-finite value ({v}) at index {i}", self.label())
        })
    }
}

/// Everything the safetensors header says, checked against the adapter config and the base model,
/// before any tensor's data is read: every targeted (layer, module) in order, A then B.
struct TensorPlan<'a> {
    rank: usize,
    scaling: f32,
    targets: Vec<TargetModule>,
    layers: usize,
    tensors: Vec<PlannedTensor<'a>>,
}

impl<'a> TensorPlan<'a> {
    fn new(
        config: &AdapterConfig,
        safetensors_bytes: &'a [u8],
        base: &ModelConfig,
        max_rank: usize,
    ) -> std::result::Result<TensorPlan<'a>, String> {
        let r = config.r;
        if r > max_rank {
            return Err(format!("rank {r} exceeds max_lora_rank {max_rank}"));
        }
        let st = SafeTensors::deserialize(safetensors_bytes)
            .map_err(|e| format!("not a valid safetensors file: {e}"))?;

        // Sort every tensor into its (layer, module, A|B) place first, so that missing and extra
        // tensors are both reported by name.
        let mut found: BTreeMap<(usize, TargetModule, bool), (String, TensorView<'a>)> =
            BTreeMap::new();
        for (name, view) in st.iter() {
            let (layer, module, is_a) = parse_tensor_name(name).ok_or_else(|| {
                format!("unexpected tensor {name:?} (only LoRA A/B of decoder projections)")
            })?;
            if layer >= base.num_hidden_layers {
                return Err(format!(
                    "tensor {name:?} is for layer {layer} but the base model has {} layers",
                    base.num_hidden_layers
                ));
            }
            if !config.target_modules.contains(&module) {
                return Err(format!(
                    "tensor {name:?} targets {module}, which target_modules does not list"
                ));
            }
            if let Some((other, _)) = found.insert((layer, module, is_a), (name.to_string(), view)) {
                return Err(format!(
                    "tensors {other:?} and {name:?} are the same weight; keep one"
                ));
            }
        }

        let mut tensors = Vec::with_capacity(base.num_hidden_layers * config.target_modules.len() * 2);
        for layer in 0..base.num_hidden_layers {
            for &module in &config.target_modules {
                let (fan_in, fan_out) = module.dims(base);
                for (is_a, shape) in [(true, [r, fan_in]), (false, [fan_out, r])] {
                    tensors.push(check_tensor(&found, layer, module, is_a, shape)?);
                }
            }
        }
        Ok(TensorPlan {
            rank: r,
            scaling: config.scaling(),
            targets: config.target_modules.iter().copied().collect(),
            layers: base.num_hidden_layers,
            tensors,
        })
    }

    /// Decodes every tensor on the rayon pool; the error is the first bad tensor's in plan order,
    /// whichever thread found it first.
    fn decode(&self) -> std::result::Result<Vec<Vec<f32>>, String> {
        use rayon::prelude::*;
        self.tensors
            .par_iter()
            .map(PlannedTensor::decode)
            .collect::<Vec<_>>()
            .into_iter()
            .collect()
    }

    /// The adapter from [`TensorPlan::decode`]'s output (one `Vec` per planned tensor, in order).
    fn assemble(&self, decoded: Vec<Vec<f32>>) -> LoraAdapter {
        let mut layers: Vec<[Option<LoraPair>; 7]> =
            (0..self.layers).map(|_| Default::default()).collect();
        let mut values = decoded.into_iter();
        for pair in self.tensors.chunks_exact(2) {
            let (Some(a), Some(b)) = (values.next(), values.next()) else { break };
            layers[pair[0].layer][pair[0].module.index()] = Some(LoraPair { a, b });
        }
        LoraAdapter {
            rank: self.rank,
            scaling: self.scaling,
            targets: self.targets.clone(),
            layers,
            digest: String::new(),
        }
    }
}

/// [`TensorPlan::decode`] beside [`content_digest`] of `config_bytes` + `weights` on a thread of its
/// own (the digest is one sequential SHA-256 over the whole file, the longest single task of a
/// load). A failed decode stops the digest early.
fn decode_and_digest(
    plan: &TensorPlan<'_>,
    config_bytes: &[u8],
    weights: &[u8],
) -> (std::result::Result<Vec<Vec<f32>>, String>, String) {
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let hashing = std::thread::Builder::new()
            .name("adapter-digest".into())
            .spawn_scoped(scope, || digest_unless_stopped(config_bytes, weights, &stop));
        let decoded = plan.decode();
        if decoded.is_err() {
            stop.store(true, Ordering::Relaxed);
        }
        let digest = match hashing {
            Ok(handle) => match handle.join() {
                Ok(digest) => digest,
                Err(panic) => std::panic::resume_unwind(panic),
            },
            // No thread to be had: hash here, after the decode.
            Err(_) => digest_unless_stopped(config_bytes, weights, &stop),
        };
        (decoded, digest)
    })
}

/// [`content_digest`], fed in 4 MiB pieces so that `stop` can end it (the result is then unused).
fn digest_unless_stopped(config_bytes: &[u8], weights: &[u8], stop: &AtomicBool) -> String {
    let mut hasher = Sha256::new();
    hasher.update(config_bytes);
    for piece in weights.chunks(4 << 20) {
        if stop.load(Ordering::Relaxed) {
            return String::new();
        }
        hasher.update(piece);
    }
    let hex: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight` → (i, module, is_a).
/// PEFT writes the adapter name into the key only in memory (`lora_A.default.weight`); we accept that
/// spelling too since some tools save it.
fn parse_tensor_name(name: &str) -> Option<(usize, TargetModule, bool)> {
    let rest = name.strip_prefix("base_model.model.model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (parent, rest) = rest.split_once('.')?;
    let (module_name, rest) = rest.split_once('.')?;
    let module = TargetModule::from_peft_name(module_name)?;
    if module.parent() != parent {
        return None;
    }
    let is_a = match rest {
        "lora_A.weight" | "lora_A.default.weight" => true,
        "lora_B.weight" | "lora_B.default.weight" => false,
        _ => return None,
    };
    Some((layer, module, is_a))
}

/// The header's entry for one expected tensor, checked: present, of `shape`, of a dtype we decode.
fn check_tensor<'a>(
    found: &BTreeMap<(usize, TargetModule, bool), (String, TensorView<'a>)>,
    layer: usize,
    module: TargetModule,
    is_a: bool,
    shape: [usize; 2],
) -> std::result::Result<PlannedTensor<'a>, String> {
    let planned = |dtype, data| PlannedTensor { layer, module, is_a, dtype, data };
    let label = planned(Dtype::F32, &[][..]).label();
    let (_, view) = found
        .get(&(layer, module, is_a))
        .ok_or_else(|| format!("missing tensor {label}"))?;
    if view.shape() != shape {
        return Err(format!(
            "{label} has shape {:?}, expected {:?} for this base model (A is [r, in], B is [out, r])",
            view.shape(),
            shape
        ));
    }
    if !matches!(view.dtype(), Dtype::F32 | Dtype::F16 | Dtype::BF16) {
        return Err(format!(
            "{label} has dtype {:?}; only F32, F16 and BF16 are supported",
            view.dtype()
        ));
    }
    Ok(planned(view.dtype(), view.data()))
}

/// Values converted (and checked) per piece, small enough that the check reads what the
/// conversion just wrote from the core's cache.
const DECODE_PIECE: usize = 16 * 1024;

/// Little-endian F32/F16/BF16 bytes (a dtype [`check_tensor`] let through) → f32, written once into
/// the returned `Vec`; `Err((index, value))` at the first non-finite value. The safetensors crate
/// has already checked that the byte length matches shape × dtype size.
fn decode_finite(dtype: Dtype, bytes: &[u8]) -> std::result::Result<Vec<f32>, (usize, f32)> {
    let width = if dtype == Dtype::F32 { 4 } else { 2 };
    let mut out: Vec<f32> = Vec::with_capacity(bytes.len() / width);
    for piece in bytes.chunks(DECODE_PIECE * width) {
        let start = out.len();
        match dtype {
            Dtype::F32 => match bytemuck::try_cast_slice::<u8, f32>(piece) {
                Ok(values) if cfg!(target_endian = "little") => out.extend_from_slice(values),
                _ => out.extend(
                    piece
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                ),
            },
            Dtype::BF16 => match bytemuck::try_cast_slice::<u8, u16>(piece) {
                // bf16 is the top half of an f32.
                Ok(bits) if cfg!(target_endian = "little") => {
                    out.extend(bits.iter().map(|&b| f32::from_bits(u32::from(b) << 16)))
                }
                _ => out.extend(
                    piece
                        .chunks_exact(2)
                        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
                ),
            },
            _ => match bytemuck::try_cast_slice::<u8, half::f16>(piece) {
                // F16C where the CPU has it.
                Ok(halves) if cfg!(target_endian = "little") => {
                    out.resize(start + halves.len(), 0.0);
                    halves.convert_to_f32_slice(&mut out[start..]);
                }
                _ => out.extend(
                    piece
                        .chunks_exact(2)
                        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
                ),
            },
        }
        let written = &out[start..];
        // A branch-free pass first (it vectorises); the position only when something is wrong.
        if written.iter().fold(false, |bad, v| bad | !v.is_finite()) {
            if let Some(i) = written.iter().position(|v| !v.is_finite()) {
                return Err((start + i, written[i]));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_digest_is_sha256_of_the_files_one_after_the_other() {
        // FIPS 180-2's "abc" test vector, split across the two files.
        assert_eq!(
            content_digest(b"ab", b"c"),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(content_digest(b"abc", b""), content_digest(b"a", b"bc"));
    }

    #[test]
    fn decode_reports_the_first_non_finite_value_across_pieces() {
        let n = DECODE_PIECE * 2 + 100;
        let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 7.0).collect();
        let f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bf16_bytes: Vec<u8> = values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
        let f16_bytes: Vec<u8> = values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
        for (dtype, bytes, width) in [(Dtype::F32, &f32_bytes, 4), (Dtype::BF16, &bf16_bytes, 2), (Dtype::F16, &f16_bytes, 2)] {
            // Unaligned too: the same values one byte into a buffer.
            let mut shifted = vec![0u8];
            shifted.extend_from_slice(bytes);
            for data in [&bytes[..], &shifted[1..]] {
                let decoded = decode_finite(dtype, data).map_err(|(i, _)| i);
                let want: Vec<f32> = match dtype {
                    Dtype::F32 => values.clone(),
                    Dtype::BF16 => values.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect(),
                    _ => values.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
                };
                assert_eq!(decoded, Ok(want), "{dtype:?}");
                // Two bad values in the second piece: the first is reported, at its index in the tensor.
                let mut bad = data.to_vec();
                for (at, value) in [(DECODE_PIECE + 3, f32::INFINITY), (DECODE_PIECE + 9, f32::NAN)] {
                    let encoded = match dtype {
                        Dtype::F32 => value.to_le_bytes().to_vec(),
                        Dtype::BF16 => half::bf16::from_f32(value).to_le_bytes().to_vec(),
                        _ => half::f16::from_f32(value).to_le_bytes().to_vec(),
                    };
                    bad[at * width..(at + 1) * width].copy_from_slice(&encoded);
                }
                assert_eq!(decode_finite(dtype, &bad).map_err(|(i, v)| (i, v.is_infinite())), Err((DECODE_PIECE + 3, true)), "{dtype:?}");
            }
        }
    }

    #[test]
    fn parses_peft_tensor_names() {
        assert_eq!(
            parse_tensor_name("base_model.model.model.layers.12.self_attn.q_proj.lora_A.weight"),
            Some((12, TargetModule::Q, true))
        );
        assert_eq!(
            parse_tensor_name("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"),
            Some((0, TargetModule::Down, false))
        );
        assert_eq!(
            parse_tensor_name("base_model.model.model.layers.0.mlp.q_proj.lora_B.weight"),
            None
        );
        assert_eq!(
            parse_tensor_name("base_model.model.lm_head.lora_A.weight"),
            None
        );
        assert_eq!(
            parse_tensor_name("base_model.model.model.layers.x.mlp.up_proj.lora_A.weight"),
            None
        );
    }
}
