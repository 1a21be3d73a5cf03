//! What every subcommand that runs the model shares: the engine flags (`flags`) and how they become a
//! running engine (`start`).

mod flags;
mod start;

pub use flags::{DeviceArg, EngineArgs, KvCacheDtypeArg, LoadFormatArg, LoraModule, QuantizationArg, FP8_KV_DEFAULT};
pub use start::default_device;
pub use start::Runtime;
