//! The Peregrine agent: one module per subcommand of the `peregrine-agent` binary.

pub mod serve;
