//! Prints the autoscaler simulation's minute-by-minute table for the standard trace:
//! `cargo run -p peregrine-operator --example autoscale_sim [seed]`.

use peregrine_crds::{LatencySlo, Throughput};
use peregrine_operator::autoscaler::sim::{self, SimConfig, StepModel, Workload};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let seed: u64 = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(42);
    let slo = LatencySlo { ttft_p95_seconds: Some(0.5), tpot_p95_seconds: Some(0.05), e2e_p95_seconds: None };
    let model = StepModel::smollm2_cpu();
    let workload = Workload { prompt_tokens: 128, min_output_tokens: 32, max_output_tokens: 96 };
    let rps = sim::capacity_at_slo(&model, &workload, &slo, 1800.0, 7);
    let capacity = Throughput { output_tokens_per_second: rps * workload.mean_output_tokens(), requests_per_second: Some(rps) };
    let spec = sim::standard_spec(slo, capacity);
    let min = spec.min_replicas;
    let config = SimConfig { spec, model, workload, scrape_interval: 15.0, startup_seconds: 60.0, initial_replicas: 2, seed };
    let report = sim::run(&config, &sim::standard_trace(1.5 * rps), &move |load: f64| ((load / rps).ceil() as i32).max(min));
    println!("capacity per replica at the SLO: {rps:.2} req/s");
    print!("{}", report.table());
    if let Some(c) = report.learned_capacity {
        println!("learned capacity per replica: {:.1} output tokens/s", c.output_tokens_per_second);
    }
    Ok(())
}
