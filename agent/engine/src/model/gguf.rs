//! GGUF v2/v3 (little-endian) parser over a memory map.
//!
//! Layout: magic `GGUF`, u32 version, u64 tensor count, u64 metadata count, the metadata key/values,
//! the tensor infos, padding up to `general.alignment`, then the tensor data. Every count, length and
//! offset comes from the file, so each is checked against the bytes that remain before anything is
//! allocated: a truncated or corrupt file gives `EngineError::InvalidModel`, never a panic or a huge
//! allocation.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::ggml_type::GgmlType;
use crate::{EngineError, Result};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions.
const MAX_DIMS: u32 = 4;
/// Arrays of arrays are legal but no real file nests deeply; the cap keeps recursion bounded.
const MAX_ARRAY_DEPTH: usize = 8;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// Any integer that is non-negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer that fits in an i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => i64::try_from(v).ok(),
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// A float (F32, or F64 narrowed). Integers are not converted: a float key stored as an integer
    /// is a writer bug worth seeing.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            GgufValue::F32(v) => Some(v),
            GgufValue::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// One tensor's header entry.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` is the innermost (contiguous) one, so a matrix of
    /// `rows × cols` (HF `[out, in]`) has `dims == [cols, rows]`.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the data section (a multiple of the alignment).
    pub offset: u64,
    /// Number of elements (product of `dims`, checked for overflow).
    pub n_elements: u64,
    /// Bytes of data, or None for a type whose geometry is unknown.
    pub n_bytes: Option<u64>,
}

impl GgufTensorInfo {
    /// Shape in row-major (PyTorch/HF) order: outermost first.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

enum Storage {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file; tensor data stays in the memory map until asked for.
pub struct GgufFile {
    path: PathBuf,
    storage: Storage,
    version: u32,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let io_err = |source| EngineError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io_err)?;
        // SAFETY: the map is read-only and private to us. Like every mmap-based model loader we rely
        // on the file not being truncated or rewritten while it is mapped.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io_err)?;
        Self::parse(path.to_path_buf(), Storage::Mmap(mmap))
    }

    /// Parses a GGUF image held in memory (`path` is only used in error messages).
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<GgufFile> {
        Self::parse(path.into(), Storage::Owned(bytes))
    }

    fn parse(path: PathBuf, storage: Storage) -> Result<GgufFile> {
        let bytes = storage.bytes();
        let mut r = Reader {
            bytes,
            pos: 0,
            path: &path,
        };
        let magic = r.take(4, "magic")?;
        if magic != MAGIC {
            return Err(r.err(format!("not a GGUF file (magic {magic:02x?})")));
        }
        let version = r.u32("version")?;
        if version != 2 && version != 3 {
            return Err(r.err(format!(
                "unsupported GGUF version {version} (only little-endian v2 and v3 are supported)"
            )));
        }
        let tensor_count = r.u64("tensor count")?;
        let kv_count = r.u64("metadata count")?;
        // Smallest possible entries: a KV is key length (8) + 1 key byte + type (4) + 1 value byte;
        // a tensor info is name length (8) + dims count (4) + type (4) + offset (8).
        r.check_count(kv_count, 14, "metadata count")?;
        r.check_count(tensor_count, 24, "tensor count")?;

        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = r.string("metadata key")?;
            let ty = r.u32("metadata value type")?;
            let value = r.value(ty, 0, &key)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(r.err(format!("duplicate metadata key {key:?}")));
            }
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => return Err(r.err(format!("general.alignment {v:?} is not a power of two"))),
            },
        };

        let mut tensors = Vec::with_capacity(tensor_count as usize);
        for _ in 0..tensor_count {
            tensors.push(r.tensor_info(alignment)?);
        }

        let data_offset =
            align_up(r.pos as u64, alignment).ok_or_else(|| r.err("data offset overflows"))?;
        let file_len = bytes.len() as u64;
        if data_offset > file_len {
            return Err(r.err(format!(
                "file truncated: tensor data should start at {data_offset} but the file has {file_len} bytes"
            )));
        }
        let data_len = file_len - data_offset;
        for t in &tensors {
            if let Some(n) = t.n_bytes {
                let end = t.offset.checked_add(n);
                if end.is_none_or(|e| e > data_len) {
                    return Err(r.err(format!(
                        "tensor {:?} ({n} bytes at data offset {}) runs past the end of the file \
                         (data section is {data_len} bytes; file truncated?)",
                        t.name, t.offset
                    )));
                }
            }
        }
        let mut names = std::collections::HashSet::with_capacity(tensors.len());
        for t in &tensors {
            if !names.insert(t.name.as_str()) {
                return Err(r.err(format!("duplicate tensor name {:?}", t.name)));
            }
        }

        Ok(GgufFile {
            path,
            storage,
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.metadata
    }

    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset where the tensor data section begins.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// The raw bytes of one tensor (bounds were checked when the file was parsed).
    pub fn tensor_data(&self, info: &GgufTensorInfo) -> Result<&[u8]> {
        let n = info.n_bytes.ok_or_else(|| {
            EngineError::invalid_model(
                &self.path,
                format!(
                    "tensor {:?} has unsupported type {}",
                    info.name, info.ggml_type
                ),
            )
        })?;
        let start = self.data_offset + info.offset;
        self.storage
            .bytes()
            .get(start as usize..(start + n) as usize)
            .ok_or_else(|| {
                EngineError::invalid_model(
                    &self.path,
                    format!("tensor {:?} is out of bounds", info.name),
                )
            })
    }
}

fn align_up(x: u64, alignment: u64) -> Option<u64> {
    Some(x.checked_add(alignment - 1)? / alignment * alignment)
}

/// A bounds-checked little-endian cursor.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn err(&self, message: impl Into<String>) -> EngineError {
        EngineError::invalid_model(self.path, message)
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(format!(
                "file truncated at offset {} while reading {what} ({n} bytes needed, {} left)",
                self.pos,
                self.remaining()
            )));
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Rejects a count whose smallest possible encoding would not fit in the rest of the file.
    fn check_count(&self, count: u64, min_bytes_each: u64, what: &str) -> Result<()> {
        if count.saturating_mul(min_bytes_each) > self.remaining() as u64 {
            return Err(self.err(format!(
                "{what} {count} is impossible: only {} bytes remain after offset {}",
                self.remaining(),
                self.pos
            )));
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        if len > self.remaining() as u64 {
            return Err(self.err(format!(
                "{what}: string length {len} at offset {} exceeds the {} bytes left",
                self.pos - 8,
                self.remaining()
            )));
        }
        let at = self.pos;
        let raw = self.take(len as usize, what)?;
        String::from_utf8(raw.to_vec())
            .map_err(|_| self.err(format!("{what} at offset {at} is not valid UTF-8")))
    }

    fn value(&mut self, ty: u32, depth: usize, key: &str) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>(key)?[0]),
            1 => GgufValue::I8(self.array::<1>(key)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => GgufValue::U32(u32::from_le_bytes(self.array(key)?)),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(self.err(format!("{key}: invalid bool byte {b}"))),
            },
            8 => GgufValue::String(self.string(key)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(format!(
                        "{key}: arrays nested deeper than {MAX_ARRAY_DEPTH}"
                    )));
                }
                let elem_ty = self.u32(key)?;
                let count = self.u64(key)?;
                let min_size = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    10..=12 => 8,
                    8 => 8,  // a string is at least its u64 length
                    9 => 12, // an array is at least its type and count
                    other => {
                        return Err(self.err(format!("{key}: unknown array element type {other}")))
                    }
                };
                self.check_count(count, min_size, key)?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem_ty, depth + 1, key)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(key)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(key)?)),
            other => return Err(self.err(format!("{key}: unknown metadata value type {other}"))),
        })
    }

    fn tensor_info(&mut self, alignment: u64) -> Result<GgufTensorInfo> {
        let name = self.string("tensor name")?;
        let n_dims = self.u32("tensor dimension count")?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(self.err(format!(
                "tensor {name:?} has {n_dims} dimensions (1..={MAX_DIMS} allowed)"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        let mut n_elements: u64 = 1;
        for _ in 0..n_dims {
            let d = self.u64("tensor dimension")?;
            n_elements = n_elements
                .checked_mul(d)
                .ok_or_else(|| self.err(format!("tensor {name:?}: element count overflows")))?;
            dims.push(d);
        }
        let ggml_type = GgmlType::from_id(self.u32("tensor type")?);
        let offset = self.u64("tensor offset")?;
        if offset % alignment != 0 {
            return Err(self.err(format!(
                "tensor {name:?}: data offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        let n_bytes = match ggml_type.block_geometry() {
            None => None,
            Some((block, _)) => {
                // Blocks never straddle rows: the innermost dimension must be whole blocks.
                if dims[0] % block as u64 != 0 {
                    return Err(self.err(format!(
                        "tensor {name:?}: row length {} is not a multiple of the {ggml_type} block size {block}",
                        dims[0]
                    )));
                }
                Some(
                    ggml_type
                        .bytes_for(n_elements)
                        .ok_or_else(|| self.err(format!("tensor {name:?}: byte size overflows")))?,
                )
            }
        };
        Ok(GgufTensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            n_elements,
            n_bytes,
        })
    }
}
