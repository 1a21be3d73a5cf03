//! Model files → weights in memory: GGUF and HF safetensors folders, dequantization, configs.

pub mod ggml_type;
pub mod gguf;

pub use ggml_type::GgmlType;
pub use gguf::{GgufFile, GgufTensorInfo, GgufValue};
