//! `peregrine-agent`: a thin dispatcher; each subcommand lives in its own module of the library.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "peregrine-agent", version, about = "LLM inference server with an OpenAI-compatible API")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start; boxing the large argument structs would only obscure clap's derive.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Serve a model over an OpenAI-compatible HTTP API.
    Serve(peregrine_agent::serve::ServeArgs),
    /// Generate from one prompt offline and print the result (like llama-cli).
    Generate(peregrine_agent::generate::GenerateArgs),
    /// Offline throughput through the engine (`bench` or `bench offline`), or load on a running
    /// server (`bench serve`).
    Bench(peregrine_agent::bench::BenchCommand),
    /// Offline throughput of many requests at once (like vLLM's benchmark_throughput), no HTTP.
    Throughput(peregrine_agent::throughput::ThroughputArgs),
    /// Fidelity of 8-bit weights and KV caches against the unquantized model: |Δlogit|, top-1, KL
    /// on the fixture prompts, perplexity on a public-domain text, every option side by side.
    Eval(peregrine_agent::eval::EvalArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // `serve` sets up its own logging (and trace export). The offline commands log warnings to
    // stderr, beside the tables they print on stdout: a diagnostic switch's warning, a kernel
    // that fell back; `RUST_LOG` shows more (`RUST_LOG=info` the weights' loading and graph capture).
    let _logs = match &cli.command {
        Command::Serve(_) => None,
        _ => Some(peregrine_telemetry::init(peregrine_telemetry::TelemetryConfig {
            service_name: "peregrine-agent",
            default_filter: "warn",
            otlp_endpoint: None,
            json: false,
        })?),
    };
    match cli.command {
        Command::Serve(args) => peregrine_agent::serve::run(args),
        Command::Generate(args) => peregrine_agent::generate::run(args),
        Command::Bench(cmd) => peregrine_agent::bench::dispatch(cmd),
        Command::Throughput(args) => peregrine_agent::throughput::run(args),
        Command::Eval(args) => peregrine_agent::eval::run(args),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// clap checks a command's definition (unique flag names across flattened groups, ...) only when
    /// it parses, and only in debug builds: check every subcommand here.
    #[test]
    fn every_subcommand_is_well_formed() {
        Cli::command().debug_assert();
    }
}
