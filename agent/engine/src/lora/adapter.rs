//! A PEFT LoRA adapter in host memory: `adapter_config.json` + `adapter_model.safetensors`, read,
//! checked against the base model, its values kept in the file's width ([`LoraValues`]).

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensorError};
use sha2::{Digest, Sha256};

use super::config::AdapterConfig;
use super::target::TargetModule;
use super::values::LoraValues;
use crate::config::ModelConfig;
use crate::{EngineError, Result};

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
const PICKLE_FILE: &str = "adapter_model.bin";

/// The low-rank pair of one projection of one layer: `delta_W = scaling * B @ A`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraPair {
    /// `[r, in]`, row-major.
    pub a: LoraValues,
    /// `[out, r]`, row-major.
    pub b: LoraValues,
}

/// An adapter's weights (in its file's width), per layer and target module, with its rank and scaling.
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
    let mut hasher = Sha256::new();
    hasher.update(config_bytes);
    hasher.update(weights_bytes);
    let hex: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

impl LoraAdapter {
    /// Loads the PEFT adapter in the folder `dir` and validates it against `base` (shapes, rank ≤
    /// `max_rank`, dtypes, the exact set of tensors, finite values).
    ///
    /// `adapter_model.safetensors` is never copied whole: its header is read and checked in full
    /// (names, shapes, dtypes, offsets) before any tensor data is read; then each tensor is read
    /// with positioned reads straight into its values, in the file's width (F32, F16 or BF16: a
    /// 16-bit adapter takes half an f32 one's host memory), on the rayon pool, while another thread reads the file in order for
    /// [`content_digest`]. A file that changes (size or modification time) meanwhile is refused, so
    /// the digest names what was decoded. No map: a file truncated under a load is an error, not a
    /// SIGBUS.
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
        let config_text = std::fs::read_to_string(&config_path).map_err(|source| EngineError::Io {
            path: config_path.clone(),
            source,
        })?;
        let config = AdapterConfig::from_json(&config_text)
            .map_err(|message| EngineError::invalid_adapter(&config_path, message))?;
        let io = |source| EngineError::Io { path: weights_path.clone(), source };
        let file = File::open(&weights_path).map_err(io)?;
        let before = file.metadata().map_err(io)?;
        let invalid = |message| EngineError::invalid_adapter(&weights_path, message);
        if config.r > max_rank {
            return Err(invalid(format!("rank {} exceeds max_lora_rank {max_rank}", config.r)));
        }
        let source = Source::File { file: &file, len: before.len() };
        let header = Header::read(&source).map_err(invalid)?;
        let plan = TensorPlan::new(&config, &header, base).map_err(invalid)?;
        let (decoded, digest) = decode_and_digest(&plan, &source, config_text.as_bytes());
        let decoded = decoded.map_err(invalid)?;
        let digest = digest.map_err(io)?;
        let after = file.metadata().map_err(io)?;
        if after.len() != before.len() || after.modified().ok() != before.modified().ok() {
            return Err(invalid(format!("{WEIGHTS_FILE} changed while it was read; load it again")));
        }
        let mut adapter = plan.assemble(decoded);
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
        if config.r > max_rank {
            return Err(format!("rank {} exceeds max_lora_rank {max_rank}", config.r));
        }
        let source = Source::Bytes(safetensors_bytes);
        let header = Header::read(&source)?;
        let plan = TensorPlan::new(config, &header, base)?;
        let decoded = plan.decode(&source)?;
        Ok(plan.assemble(decoded))
    }

    /// Bytes this adapter's weights take in host memory (2 or 4 a value, as its file stored them).
    pub fn size_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| l.iter().flatten())
            .map(|p| p.a.bytes() + p.b.bytes())
            .sum()
    }

    /// This adapter with every matrix narrowed to bf16 (round to nearest even), the width PEFT
    /// adapters are commonly saved in and the GPU's slots hold.
    pub fn into_bf16(mut self) -> LoraAdapter {
        for pair in self.layers.iter_mut().flat_map(|l| l.iter_mut().flatten()) {
            pair.a = pair.a.to_bf16();
            pair.b = pair.b.to_bf16();
        }
        self
    }

    pub fn pair(&self, layer: usize, module: TargetModule) -> Option<&LoraPair> {
        self.layers
            .get(layer)
            .and_then(|l| l[module.index()].as_ref())
    }
}

/// Where a safetensors file's bytes are: in memory, or in an open file of `len` bytes (read with
/// positioned reads, so that threads share it).
enum Source<'a> {
    Bytes(&'a [u8]),
    File { file: &'a File, len: u64 },
}

impl Source<'_> {
    fn len(&self) -> u64 {
        match self {
            Source::Bytes(bytes) => bytes.len() as u64,
            Source::File { len, .. } => *len,
        }
    }

    /// Fills `buf` from byte `offset`.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        match self {
            Source::Bytes(bytes) => {
                let range = usize::try_from(offset)
                    .ok()
                    .and_then(|start| Some(start..start.checked_add(buf.len())?))
                    .and_then(|range| bytes.get(range))
                    .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
                buf.copy_from_slice(range);
                Ok(())
            }
            Source::File { file, .. } => file.read_exact_at(buf, offset),
        }
    }
}

/// A safetensors header, checked as the safetensors crate checks a whole file (offsets contiguous,
/// sizes matching shape × dtype, data exactly filling the file), without reading the data.
struct Header {
    /// Where the data starts: 8 + the header's length.
    data_start: u64,
    metadata: Metadata,
}

impl Header {
    fn read(source: &Source<'_>) -> std::result::Result<Header, String> {
        let bad = |e: SafeTensorError| format!("not a valid safetensors file: {e}");
        let mut n = [0u8; 8];
        if source.len() < 8 {
            return Err(bad(SafeTensorError::HeaderTooSmall));
        }
        source
            .read_at(0, &mut n)
            .map_err(|e| format!("cannot read the safetensors header: {e}"))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER_BYTES {
            return Err(bad(SafeTensorError::HeaderTooLarge));
        }
        let data_start = 8 + n;
        if data_start > source.len() {
            return Err(bad(SafeTensorError::InvalidHeaderLength));
        }
        // n ≤ MAX_HEADER_BYTES: fits in memory and in usize.
        let mut text = vec![0u8; n as usize];
        source
            .read_at(8, &mut text)
            .map_err(|e| format!("cannot read the safetensors header: {e}"))?;
        let text = std::str::from_utf8(&text).map_err(|e| bad(SafeTensorError::InvalidHeader(e)))?;
        let metadata: Metadata = serde_json::from_str(text)
            .map_err(|e| bad(SafeTensorError::InvalidHeaderDeserialization(e)))?;
        if data_start.checked_add(metadata.data_len() as u64) != Some(source.len()) {
            return Err(bad(SafeTensorError::MetadataIncompleteBuffer));
        }
        Ok(Header { data_start, metadata })
    }
}

/// The safetensors crate's limit on a header's length.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor to decode: where it goes and where its bytes are (shape and dtype already checked).
struct PlannedTensor {
    layer: usize,
    module: TargetModule,
    is_a: bool,
    dtype: Dtype,
    /// Byte offset in the file and byte length.
    offset: u64,
    bytes: usize,
}

impl PlannedTensor {
    fn label(&self) -> String {
        let which = if self.is_a { "lora_A" } else { "lora_B" };
        format!("layers.{}.{}.{}.{which}", self.layer, self.module.parent(), self.module)
    }

    /// The tensor's values, or the message naming its first non-finite value.
    fn decode(&self, source: &Source<'_>) -> std::result::Result<LoraValues, String> {
        decode_finite(self.dtype, source, self.offset, self.bytes).map_err(|e| match e {
            DecodeError::NonFinite(i, v) => {
                format!("{} holds a non-finite value ({v}) at index {i}", self.label())
            }
            DecodeError::Read(e) => format!("{}: cannot read its data: {e}", self.label()),
        })
    }
}

/// Everything the safetensors header says, checked against the adapter config (its rank already
/// checked against `max_lora_rank`) and the base model, before any tensor's data is read: every targeted (layer, module) in order, A then B.
struct TensorPlan {
    rank: usize,
    scaling: f32,
    targets: Vec<TargetModule>,
    layers: usize,
    tensors: Vec<PlannedTensor>,
}

impl TensorPlan {
    fn new(
        config: &AdapterConfig,
        header: &Header,
        base: &ModelConfig,
    ) -> std::result::Result<TensorPlan, String> {
        let r = config.r;
        // Sort every tensor into its (layer, module, A|B) place first, so that missing and extra
        // tensors are both reported by name (in file order).
        let mut found: BTreeMap<(usize, TargetModule, bool), (String, &TensorInfo)> = BTreeMap::new();
        for name in header.metadata.offset_keys() {
            let Some(info) = header.metadata.info(&name) else { continue };
            let (layer, module, is_a) = parse_tensor_name(&name).ok_or_else(|| {
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
            let key = (layer, module, is_a);
            if let Some((other, _)) = found.get(&key) {
                return Err(format!(
                    "tensors {other:?} and {name:?} are the same weight; keep one"
                ));
            }
            found.insert(key, (name, info));
        }

        let mut tensors = Vec::with_capacity(base.num_hidden_layers * config.target_modules.len() * 2);
        for layer in 0..base.num_hidden_layers {
            for &module in &config.target_modules {
                let (fan_in, fan_out) = module.dims(base);
                for (is_a, shape) in [(true, [r, fan_in]), (false, [fan_out, r])] {
                    tensors.push(check_tensor(&found, header.data_start, layer, module, is_a, shape)?);
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
    fn decode(&self, source: &Source<'_>) -> std::result::Result<Vec<LoraValues>, String> {
        use rayon::prelude::*;
        self.tensors
            .par_iter()
            .map(|t| t.decode(source))
            .collect::<Vec<_>>()
            .into_iter()
            .collect()
    }

    /// The adapter from [`TensorPlan::decode`]'s output (one matrix per planned tensor, in order).
    fn assemble(&self, decoded: Vec<LoraValues>) -> LoraAdapter {
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

/// [`TensorPlan::decode`] beside [`content_digest`] of `config_bytes` + the file on a thread of its
/// own (the digest is one sequential SHA-256 over the whole file, the longest single task of a
/// load). A failed decode stops the digest early.
fn decode_and_digest(
    plan: &TensorPlan,
    source: &Source<'_>,
    config_bytes: &[u8],
) -> (std::result::Result<Vec<LoraValues>, String>, std::io::Result<String>) {
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let hashing = std::thread::Builder::new()
            .name("adapter-digest".into())
            .spawn_scoped(scope, || digest_source(config_bytes, source, &stop));
        let decoded = plan.decode(source);
        if decoded.is_err() {
            stop.store(true, Ordering::Relaxed);
        }
        let digest = match hashing {
            Ok(handle) => match handle.join() {
                Ok(digest) => digest,
                Err(panic) => std::panic::resume_unwind(panic),
            },
            // No thread to be had: hash here, after the decode.
            Err(_) => digest_source(config_bytes, source, &stop),
        };
        (decoded, digest)
    })
}

/// Bytes hashed per read (a buffer that stays in the core's cache).
const DIGEST_PIECE: usize = 1 << 20;

/// [`content_digest`] of `config_bytes` + `source`, read in order a piece at a time; `stop` ends it
/// early (the result is then unused).
fn digest_source(config_bytes: &[u8], source: &Source<'_>, stop: &AtomicBool) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    hasher.update(config_bytes);
    match source {
        Source::Bytes(bytes) => {
            for piece in bytes.chunks(DIGEST_PIECE) {
                if stop.load(Ordering::Relaxed) {
                    return Ok(String::new());
                }
                hasher.update(piece);
            }
        }
        Source::File { len, .. } => {
            let mut buf = vec![0u8; DIGEST_PIECE];
            let mut offset = 0u64;
            while offset < *len {
                if stop.load(Ordering::Relaxed) {
                    return Ok(String::new());
                }
                let take = (*len - offset).min(DIGEST_PIECE as u64) as usize;
                let piece = &mut buf[..take];
                source.read_at(offset, piece)?;
                hasher.update(&*piece);
                offset += take as u64;
            }
        }
    }
    let hex: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("sha256:{hex}"))
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
fn check_tensor(
    found: &BTreeMap<(usize, TargetModule, bool), (String, &TensorInfo)>,
    data_start: u64,
    layer: usize,
    module: TargetModule,
    is_a: bool,
    shape: [usize; 2],
) -> std::result::Result<PlannedTensor, String> {
    let planned = |dtype, offset, bytes| PlannedTensor { layer, module, is_a, dtype, offset, bytes };
    let label = planned(Dtype::F32, 0, 0).label();
    let (_, info) = found
        .get(&(layer, module, is_a))
        .ok_or_else(|| format!("missing tensor {label}"))?;
    if info.shape != shape {
        return Err(format!(
            "{label} has shape {:?}, expected {:?} for this base model (A is [r, in], B is [out, r])",
            info.shape, shape
        ));
    }
    if !matches!(info.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
        return Err(format!(
            "{label} has dtype {:?}; only F32, F16 and BF16 are supported",
            info.dtype
        ));
    }
    let (start, end) = info.data_offsets;
    Ok(planned(info.dtype, data_start + start as u64, end - start))
}

/// Values read (and checked) per piece, small enough that the check reads what the read just
/// wrote from the core's cache.
const DECODE_PIECE: usize = 16 * 1024;

enum DecodeError {
    NonFinite(usize, f32),
    Read(std::io::Error),
}

/// The `bytes` bytes of a little-endian F32/F16/BF16 tensor (a dtype [`check_tensor`] let through)
/// at `offset` of `source`, in its own width ([`LoraValues`]), read straight into the returned
/// values a piece at a time; `NonFinite(index, value)` at the first non-finite value. The header
/// check has already matched the byte length to shape × dtype size.
fn decode_finite(dtype: Dtype, source: &Source<'_>, offset: u64, bytes: usize) -> std::result::Result<LoraValues, DecodeError> {
    match dtype {
        Dtype::F32 => {
            // Zeroed up front, which for a large tensor is fresh zero pages from the kernel (no
            // pass over it here), then read into.
            let mut out = vec![0.0f32; bytes / 4];
            read_checked(source, offset, &mut out, |v: &f32| !v.is_finite(), |&v| v)?;
            Ok(LoraValues::F32(out))
        }
        Dtype::BF16 => {
            let mut out = vec![half::bf16::ZERO; bytes / 2];
            // A bf16 is non-finite when its 8 exponent bits are all set.
            read_checked(source, offset, &mut out, |v: &half::bf16| v.to_bits() & 0x7f80 == 0x7f80, |v| v.to_f32())?;
            Ok(LoraValues::Bf16(out))
        }
        _ => {
            let mut out = vec![half::f16::ZERO; bytes / 2];
            // An f16 is non-finite when its 5 exponent bits are all set.
            read_checked(source, offset, &mut out, |v: &half::f16| v.to_bits() & 0x7c00 == 0x7c00, |v| v.to_f32())?;
            Ok(LoraValues::F16(out))
        }
    }
}

/// Fills `out` with `source`'s little-endian values from byte `offset`, [`DECODE_PIECE`] values
/// at a time, each piece checked by `bad` (branch-free, so it vectorises) right after its read;
/// `NonFinite` names the first bad value (as f32, by `widen`). On a big-endian host each value's
/// bytes are swapped from the file's order before the check.
fn read_checked<T: bytemuck::Pod>(
    source: &Source<'_>,
    offset: u64,
    out: &mut [T],
    bad: impl Fn(&T) -> bool,
    widen: impl Fn(&T) -> f32,
) -> std::result::Result<(), DecodeError> {
    let width = std::mem::size_of::<T>();
    let mut start = 0;
    while start < out.len() {
        let count = (out.len() - start).min(DECODE_PIECE);
        let piece = &mut out[start..start + count];
        source.read_at(offset + (start * width) as u64, bytemuck::cast_slice_mut(piece)).map_err(DecodeError::Read)?;
        if cfg!(target_endian = "big") {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(piece);
            bytes.chunks_exact_mut(width).for_each(<[u8]>::reverse);
        }
        if piece.iter().fold(false, |acc, v| acc | bad(v)) {
            if let Some(i) = piece.iter().position(&bad) {
                return Err(DecodeError::NonFinite(start + i, widen(&piece[i])));
            }
        }
        start += count;
    }
    Ok(())
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
                let decode = |data: &[u8]| {
                    decode_finite(dtype, &Source::Bytes(data), 0, data.len()).map_err(|e| match e {
                        DecodeError::NonFinite(i, v) => Ok((i, v.is_infinite())),
                        DecodeError::Read(e) => Err(e.kind()),
                    })
                };
                let decoded = decode(data).map_err(|e| e.map(|(i, _)| i));
                // Kept in the file's width.
                let want = match dtype {
                    Dtype::F32 => LoraValues::F32(values.clone()),
                    Dtype::BF16 => LoraValues::Bf16(values.iter().map(|&v| half::bf16::from_f32(v)).collect()),
                    _ => LoraValues::F16(values.iter().map(|&v| half::f16::from_f32(v)).collect()),
                };
                let width_of = |v: &LoraValues| std::mem::discriminant(v);
                assert_eq!(decoded.as_ref().map(width_of), Ok(width_of(&want)), "{dtype:?}");
                assert_eq!(decoded, Ok(want), "{dtype:?}");
                // Bytes short of what the header promised: a read error.
                let short = decode_finite(dtype, &Source::Bytes(&data[..data.len() - 1]), 0, data.len());
                assert!(matches!(short, Err(DecodeError::Read(_))), "{dtype:?}");
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
                assert_eq!(decode(&bad), Err(Ok((DECODE_PIECE + 3, true))), "{dtype:?}");
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
