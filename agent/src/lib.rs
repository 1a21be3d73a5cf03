//! The Peregrine agent: one module per subcommand of the `peregrine-agent` binary.

pub mod bench;
pub mod bench_adapters;
pub mod bench_serve;
pub mod eval;
pub mod generate;
pub mod kv_events;
pub mod runtime;
pub mod serve;
pub mod throughput;
