//! `peregrine-operator regress`: runs a regression suite against any OpenAI-compatible server (a
//! canary, a port-forwarded deployment, a local agent), so that CI runs the suite a rollout runs.
//!
//! Exit status: 0 passed, 1 failed, 2 could not run (bad suite, unreachable reference).

use std::path::PathBuf;
use std::time::Duration;

use peregrine_crds::{ModelTask, RegressionCase, RegressionSpec, RegressionThresholds};

use super::client::OpenAiClient;
use super::runner::{run_suite, SuiteReport, SuiteTarget};
use super::suite::{check_cases, load_cases};

/// Run a regression suite against a server under test.
#[derive(clap::Args, Debug, Clone)]
pub struct RegressArgs {
    /// Root URL of the server under test, e.g. http://localhost:8000.
    #[arg(long)]
    pub canary: String,
    /// Root URL of the reference server (needed by sameAsStable cases and the latency gate).
    #[arg(long)]
    pub stable: Option<String>,
    /// Model id to send (the deployment's served model name).
    #[arg(long)]
    pub model: String,
    /// YAML file: a list of cases (as in a ConfigMap), or a `spec.rollout.regression` object with
    /// inline cases and thresholds.
    #[arg(long)]
    pub suite: PathBuf,
    /// Also run every case through this adapter (repeatable).
    #[arg(long = "adapter")]
    pub adapters: Vec<String>,
    /// The model's task (`spec.model.task`): generate, embed, rerank or classify.
    #[arg(long, default_value = "generate", value_parser = parse_task)]
    pub task: ModelTask,
    /// Overrides the suite's minAgreementRate.
    #[arg(long)]
    pub min_agreement_rate: Option<f64>,
    /// Overrides the suite's maxLatencyFactor.
    #[arg(long)]
    pub max_latency_factor: Option<f64>,
    /// Timeout of one request, in seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout_seconds: u64,
    /// Print the result as JSON (a rollout StepResult) instead of text.
    #[arg(long)]
    pub json: bool,
}

fn parse_task(s: &str) -> Result<ModelTask, String> {
    serde_json::from_value(serde_json::Value::String(s.to_string())).map_err(|_| format!("{s:?} is not a task: generate, embed, rerank or classify"))
}

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Suite(#[from] super::suite::SuiteError),
    #[error("the suite file's regression object refers to a ConfigMap; give the cases inline or as a list")]
    ConfigMapInFile,
    #[error(transparent)]
    Client(#[from] super::client::ClientError),
    #[error(transparent)]
    Run(#[from] super::runner::RunError),
}

/// Reads a suite file: a list of cases, or a regression object.
pub fn read_suite(text: &str) -> Result<(Vec<RegressionCase>, RegressionThresholds), CliError> {
    if let Ok(spec) = serde_yaml::from_str::<RegressionSpec>(text) {
        if spec.suite.config_map_ref.is_some() {
            return Err(CliError::ConfigMapInFile);
        }
        check_cases(&spec.suite.cases)?;
        return Ok((spec.suite.cases, spec.thresholds));
    }
    Ok((load_cases(text)?, RegressionThresholds::default()))
}

/// Runs the suite as `args` say.
pub async fn run(args: &RegressArgs) -> Result<SuiteReport, CliError> {
    let text = std::fs::read_to_string(&args.suite).map_err(|source| CliError::Read { path: args.suite.clone(), source })?;
    let (cases, mut thresholds) = read_suite(&text)?;
    if let Some(r) = args.min_agreement_rate {
        thresholds.min_agreement_rate = r;
    }
    if let Some(f) = args.max_latency_factor {
        thresholds.max_latency_factor = f;
    }
    let client = OpenAiClient::new(Duration::from_secs(args.timeout_seconds))?;
    let target = SuiteTarget {
        canary: args.canary.clone(),
        stable: args.stable.clone(),
        model: args.model.clone(),
        adapters: args.adapters.clone(),
        task: args.task,
    };
    Ok(run_suite(&client, &target, &cases, &thresholds).await?)
}

/// Prints the report; returns the process exit status.
pub fn print(report: &SuiteReport, json: bool) -> i32 {
    if json {
        match serde_json::to_string_pretty(&report.to_step_result(0)) {
            Ok(text) => println!("{text}"),
            Err(e) => {
                eprintln!("error: {e}");
                return 2;
            }
        }
    } else {
        for case in &report.cases {
            let mark = if case.verdict.passed { "PASS" } else { "FAIL" };
            println!("{mark} {}", case.name);
            if !case.verdict.passed {
                println!("     {}", case.verdict.reason);
                if !case.verdict.expected.is_empty() {
                    println!("     expected: {:?}", case.verdict.expected);
                }
                println!("     got:      {:?}", case.verdict.got);
            }
        }
        println!("{}: {}", if report.passed { "PASSED" } else { "FAILED" }, report.message);
    }
    if report.passed {
        0
    } else {
        1
    }
}

/// Entry point of the subcommand; returns the process exit status.
pub async fn main(args: RegressArgs) -> i32 {
    match run(&args).await {
        Ok(report) => print(&report, args.json),
        Err(e) => {
            eprintln!("error: {e}");
            2
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suite_files_are_lists_or_regression_objects() {
        let (cases, thresholds) = read_suite("- {name: a, prompt: p, expect: {type: sameAsStable}}").unwrap();
        assert_eq!(cases.len(), 1);
        assert_eq!(thresholds, RegressionThresholds::default());
        let (cases, thresholds) = read_suite(
            "suite:\n  cases:\n  - {name: a, prompt: p, expect: {type: contains, value: x}}\nthresholds: {minAgreementRate: 0.8}\n",
        )
        .unwrap();
        assert_eq!(cases[0].name, "a");
        assert_eq!(thresholds.min_agreement_rate, 0.8);
        assert_eq!(thresholds.max_latency_factor, 1.5);
        assert!(matches!(read_suite("suite: {configMapRef: {name: x}}"), Err(CliError::ConfigMapInFile)));
    }
}
