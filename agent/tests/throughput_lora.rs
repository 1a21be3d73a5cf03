//! `peregrine-agent throughput --lora` on the CPU with SmolLM2: the LoRA side runs, and a new
//! adapter's time from its files on disk to its first token is measured and reported; with
//! `--lora-dir`, on a folder of real PEFT adapters (issue 16).

use clap::Parser;
use peregrine_agent::throughput::{measure, ThroughputArgs};

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    args: ThroughputArgs,
}

#[test]
fn lora_throughput_reports_a_new_adapters_disk_to_first_token() {
    let model = peregrine_testkit::test_model();
    let argv = ["throughput", "--model", model.to_str().unwrap(), "--device", "cpu", "--threads", "2", "--num-prompts", "4", "--input-len", "8", "--output-len", "3", "--lora", "2", "--lora-rank", "4", "--max-loras", "2"];
    let args = Cli::try_parse_from(argv).unwrap().args;
    let report = measure(args).unwrap();
    assert_eq!(report.num_prompts, 4);
    assert!(report.output_tokens_per_second > 0.0);
    let lora = report.lora.expect("the LoRA side ran");
    assert_eq!((lora.adapters.adapters, lora.adapters.rank, lora.adapters.source.as_str()), (2, 4, "random"));
    assert!(lora.output_tokens_per_second > 0.0 && lora.relative_to_base > 0.0);
    let cold = &lora.cold_adapter;
    for (what, v) in [("load", cold.load_seconds), ("first token", cold.first_token_seconds), ("base first token", cold.base_first_token_seconds)] {
        assert!(v.is_finite() && v > 0.0, "{what}: {v}");
    }
    // Each sample's total is at least each of its parts, so the medians keep that order.
    assert!(cold.disk_to_first_token_seconds >= cold.load_seconds && cold.disk_to_first_token_seconds >= cold.first_token_seconds, "{cold:?}");
    assert!(cold.disk_to_first_token_seconds < 60.0, "{cold:?}");
}

#[test]
fn lora_throughput_runs_on_a_folder_of_peft_adapters() {
    let model = peregrine_testkit::test_model();
    let dir = peregrine_testkit::fixtures_dir().join("smollm2/lora");
    // Two adapters of ranks 8 and 16 on different modules; --max-lora-rank 8 is raised to 16 for them.
    let argv = ["throughput", "--model", model.to_str().unwrap(), "--device", "cpu", "--threads", "2", "--num-prompts", "4", "--input-len", "8", "--output-len", "3", "--lora-dir", dir.to_str().unwrap(), "--max-lora-rank", "8", "--max-loras", "2", "--json"];
    let args = Cli::try_parse_from(argv).unwrap().args;
    let report = measure(args).unwrap();
    let lora = report.lora.expect("the LoRA side ran");
    assert_eq!((lora.adapters.adapters, lora.adapters.rank, lora.adapters.ranks.clone()), (2, 16, vec![8, 16]));
    assert_eq!(lora.adapters.source, dir.display().to_string());
    assert!(lora.output_tokens_per_second > 0.0 && lora.relative_to_base > 0.0);
    // The report names its adapters the same way as JSON.
    let json = serde_json::to_value(&lora).unwrap();
    assert_eq!((json["adapters"].as_u64(), json["rank"].as_u64()), (Some(2), Some(16)));
}

#[test]
fn lora_throughput_refuses_a_folder_without_adapters_before_loading_the_model() {
    let empty = tempfile::tempdir().unwrap();
    // No model needed: the folder is read first.
    let argv = ["throughput", "--model", "/nonexistent/model.gguf", "--device", "cpu", "--lora-dir", empty.path().to_str().unwrap()];
    let args = Cli::try_parse_from(argv).unwrap().args;
    let err = format!("{:#}", measure(args).unwrap_err());
    assert!(err.contains("no PEFT adapter"), "{err}");
}
