//! `peregrine-operator`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use peregrine_operator::regression::cli::RegressArgs;

#[derive(Parser, Debug)]
#[command(name = "peregrine-operator", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a regression suite against a server (as rollouts do), for CI.
    Regress(RegressArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Regress(args) => peregrine_operator::regression::cli::main(args).await,
    }
}
