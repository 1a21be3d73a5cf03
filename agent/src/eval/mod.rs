//! `peregrine-agent eval`: what 8-bit weights and 8-bit KV caches cost in quality, measured against
//! the unquantized model on the same weights (f32 on the CPU, bf16 on CUDA). Over the fixture
//! prompts (`prompts.json`, every position): mean and max |Δlogit| over the reference's top-10 ids,
//! top-1 agreement and KL(reference ‖ configuration); on a public-domain text
//! (`pride-and-prejudice-ch1.txt`, Project Gutenberg eBook #1342, chapter 1): perplexity (its change
//! with a 95 % interval from the tokens' paired NLL differences, `fidelity::PerplexityChange`), how often
//! the greedy pick agrees with the reference's, and the KL at its first 2048 positions (the
//! better-powered measure: the prompts' 36 positions are few and all at short contexts). Without `--quantization`/`--kv-cache-dtype` it
//! prints every option side by side, so the defaults' choice is visible; with them, that one
//! configuration. With `--reference-logits` (transformers' float32 logits of the same prompts, as
//! `tests/fixtures/smollm2/reference.json`), the reference and every row are also compared with
//! those: on CUDA the reference is itself bf16 (weights and cache), and the KV target is
//! stated against float32.

mod variants;

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use peregrine_engine::backend::Backend;
use peregrine_engine::bench::fidelity::{self, Comparison, PerplexityChange, Reference, ReferencePrompt, TextRun, PPL_BLOCK_TOKENS};
use peregrine_engine::model::{self, ModelWeights};
use peregrine_engine::tokenizer::Tokenizer;

use crate::runtime::{DeviceArg, KvCacheDtypeArg, LoadFormatArg, QuantizationArg};
pub use variants::{KvOption, Variant, WeightOption};

/// The fixture prompts (transformers' reference logits for SmolLM2 were computed on these).
const PROMPTS: &str = include_str!("prompts.json");
/// Project Gutenberg eBook #1342 (Jane Austen, Pride and Prejudice), chapter 1: public domain.
pub const TEXT: &str = include_str!("pride-and-prejudice-ch1.txt");

#[derive(Debug, Clone, Args)]
pub struct EvalArgs {
    /// Model: a GGUF file or a Hugging Face folder.
    #[arg(long, env = "PEREGRINE_MODEL")]
    pub model: PathBuf,
    #[arg(long, value_enum, default_value = "auto")]
    pub load_format: LoadFormatArg,
    /// Where the model runs (default: cuda when usable, else cpu).
    #[arg(long, value_enum)]
    pub device: Option<DeviceArg>,
    /// CPU threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Evaluate only this weight quantization (with --kv-cache-dtype, or the backend's own cache).
    #[arg(long, value_enum)]
    pub quantization: Option<QuantizationArg>,
    /// With --quantization: the residual stream rotated first, as the server's flag of that name.
    #[arg(long, requires = "quantization")]
    pub quantization_rotation: bool,
    /// With --quantization: GPTQ's rounding over calibration tokens the model samples, as the
    /// server's flag of that name.
    #[arg(long, requires = "quantization")]
    pub quantization_gptq: bool,
    /// Evaluate only this KV cache type (with --quantization, or unquantized weights).
    #[arg(long, value_enum)]
    pub kv_cache_dtype: Option<KvCacheDtypeArg>,
    /// Perplexity text instead of the built-in chapter (UTF-8, at most 1 MiB).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Tokens of the text to use (the first ones; 0: all).
    #[arg(long, default_value_t = 0)]
    pub text_tokens: usize,
    /// Positions per forward step.
    #[arg(long, default_value_t = 64)]
    pub chunk: usize,
    /// Second reference for the prompts: transformers' logits of the same prompt tokens in the
    /// fixtures' JSON format (e.g. `tests/fixtures/smollm2/reference.json`, float32); the reference
    /// and every row also get mean |Δ| and top-1 against it. At most 64 MiB.
    #[arg(long)]
    pub reference_logits: Option<PathBuf>,
}

/// Longest perplexity text read from a file (bounds the work and the memory).
const MAX_TEXT_BYTES: u64 = 1 << 20;
/// Largest `--reference-logits` file read.
const MAX_REFERENCE_LOGITS_BYTES: u64 = 64 << 20;

/// One evaluated configuration.
#[derive(Debug, Clone)]
pub struct Row {
    pub variant: Variant,
    pub comparison: Comparison,
}

/// What `eval` measured.
#[derive(Debug, Clone)]
pub struct Report {
    pub device: DeviceArg,
    pub reference_label: String,
    pub reference: Reference,
    pub text_tokens: usize,
    pub rows: Vec<Row>,
    /// The reference against `--reference-logits`, when given.
    pub reference_vs_fixture: Option<fidelity::Fidelity>,
}

impl Report {
    pub fn reference_perplexity(&self) -> f64 {
        self.reference.text.perplexity()
    }

    /// The row of `variant`, if it was measured.
    pub fn row(&self, variant: &Variant) -> Option<&Row> {
        self.rows.iter().find(|r| &r.variant == variant)
    }
}

/// The prompts and text as token ids.
pub struct Inputs {
    pub prompts: Vec<Vec<u32>>,
    pub text: Vec<u32>,
}

impl EvalArgs {
    fn inputs(&self, tokenizer: &Tokenizer) -> anyhow::Result<Inputs> {
        let prompts: Vec<String> = serde_json::from_str(PROMPTS).context("the built-in prompts")?;
        let prompts = prompts
            .iter()
            .map(|p| tokenizer.encode(p))
            .collect::<Result<Vec<_>, _>>()
            .context("tokenizing the prompts")?;
        let text = match &self.text {
            None => TEXT.to_string(),
            Some(path) => {
                let len = std::fs::metadata(path).map_err(|e| anyhow::anyhow!("--text: cannot read the file: {}", e.kind()))?.len();
                if len > MAX_TEXT_BYTES {
                    anyhow::bail!("--text: {len} bytes, at most {MAX_TEXT_BYTES}");
                }
                std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("--text: cannot read the file as UTF-8 text: {}", e.kind()))?
            }
        };
        let mut text = tokenizer.encode(&text).context("tokenizing the text")?;
        if self.text_tokens > 0 {
            text.truncate(self.text_tokens);
        }
        if text.len() < 2 || prompts.iter().any(|p| p.is_empty()) {
            anyhow::bail!("the perplexity text needs at least 2 tokens and every prompt 1");
        }
        Ok(Inputs { prompts, text })
    }

    /// The configurations to compare: the one asked for, or every one the device runs.
    fn variants(&self, device: DeviceArg) -> anyhow::Result<Vec<Variant>> {
        if self.quantization.is_none() && self.kv_cache_dtype.is_none() {
            return Ok(variants::table(device));
        }
        let weights = match self.quantization {
            None => WeightOption::Unquantized,
            Some(q) => match WeightOption::default_for(q.into()) {
                WeightOption::Quantized { format, granularity, activations, .. } => WeightOption::Quantized {
                    format,
                    granularity,
                    activations,
                    rotated: self.quantization_rotation,
                    gptq: self.quantization_gptq,
                },
                unquantized => unquantized,
            },
        };
        let kv = match self.kv_cache_dtype {
            None | Some(KvCacheDtypeArg::Auto) => KvOption::Native,
            Some(k) => KvOption::from_flag(k),
        };
        Ok(vec![Variant { weights, kv }])
    }

    /// `--reference-logits`, read and parsed (errors name the flag, never the path).
    fn fixture(&self) -> anyhow::Result<Option<Vec<ReferencePrompt>>> {
        let Some(path) = &self.reference_logits else { return Ok(None) };
        let len = std::fs::metadata(path).map_err(|e| anyhow::anyhow!("--reference-logits: cannot read the file: {}", e.kind()))?.len();
        if len > MAX_REFERENCE_LOGITS_BYTES {
            anyhow::bail!("--reference-logits: {len} bytes, at most {MAX_REFERENCE_LOGITS_BYTES}");
        }
        let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("--reference-logits: cannot read the file as UTF-8 text: {}", e.kind()))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("--reference-logits: not JSON: {e}"))?;
        let prompts = fidelity::prompts_from_reference(&json).map_err(|e| anyhow::anyhow!("--reference-logits: {e}"))?;
        Ok(Some(prompts))
    }

    fn device(&self) -> DeviceArg {
        self.device.unwrap_or_else(crate::runtime::default_device)
    }

    /// Measures the configurations the flags ask for, handing each output line to `progress`.
    pub fn evaluate(&self, progress: impl FnMut(&str)) -> anyhow::Result<Report> {
        let variants = self.variants(self.device())?;
        self.evaluate_variants(&variants, progress)
    }

    /// Measures `variants` against the unquantized model.
    pub fn evaluate_variants(&self, variants: &[Variant], mut progress: impl FnMut(&str)) -> anyhow::Result<Report> {
        let device = self.device();
        let tokenizer = Tokenizer::for_model(&self.model).with_context(|| format!("loading the tokenizer of {}", self.model.display()))?;
        let inputs = self.inputs(&tokenizer)?;
        let fixture = self.fixture()?;
        let loaded = model::load(&self.model, self.load_format.into()).with_context(|| format!("loading model {}", self.model.display()))?;
        let weights = loaded.weights;
        let longest = inputs.prompts.iter().map(Vec::len).chain([inputs.text.len()]).max().unwrap_or(0);
        let backends = Backends {
            device,
            threads: self.threads,
            longest,
            chunk: self.chunk.clamp(1, 256),
            calibration: variants::Calibration::new(self.threads.unwrap_or(0)),
        };

        let ref_variant = Variant { weights: WeightOption::Unquantized, kv: KvOption::Native };
        let reference_label = ref_variant.label(device);
        let mut backend = backends.build(&weights, &ref_variant)?;
        let reference = fidelity::run_reference(backend.as_mut(), &inputs.prompts, &inputs.text, backends.chunk)?;
        drop(backend);
        let reference_vs_fixture = match &fixture {
            None => None,
            Some(f) if fidelity::fixture_matches(&reference, f) => Some(fidelity::reference_vs_fixture(&reference, f)),
            Some(_) => anyhow::bail!("--reference-logits: its prompts are not the tokens of eval's built-in prompts (another model or tokenizer?)"),
        };
        if let Some(f) = &reference_vs_fixture {
            progress(&format!(
                "reference vs --reference-logits: mean |Δ| {:.4}, max |Δ| {:.3}, top-1 {}/{} (the columns \"ref2\" below: each row against it)",
                f.mean_abs_diff(),
                f.max_abs_diff,
                f.top1_agree,
                f.positions
            ));
        }
        progress(&header(&reference_label, reference.text.perplexity(), inputs.text.len(), fixture.is_some()));
        let mut rows = Vec::new();
        for &variant in variants {
            let mut backend = match backends.build(&weights, &variant) {
                Ok(b) => b,
                Err(e) => {
                    progress(&format!("{:<44} not measured: {e:#}", variant.label(device)));
                    continue;
                }
            };
            let comparison = fidelity::compare_with_fixture(backend.as_mut(), &reference, &inputs.text, backends.chunk, fixture.as_deref())?;
            drop(backend);
            let row = Row { variant, comparison };
            progress(&format_row(device, &row, &reference.text));
            rows.push(row);
        }
        Ok(Report { device, reference_label, reference, text_tokens: inputs.text.len(), rows, reference_vs_fixture })
    }
}

/// Builds a backend for each configuration, sized for the longest input.
struct Backends {
    device: DeviceArg,
    threads: Option<usize>,
    longest: usize,
    chunk: usize,
    calibration: variants::Calibration,
}

impl Backends {
    fn build(&self, weights: &ModelWeights, variant: &Variant) -> anyhow::Result<Box<dyn Backend>> {
        match self.device {
            DeviceArg::Cpu => variants::cpu_backend(weights, variant, self.longest, self.threads.unwrap_or(0), &self.calibration),
            DeviceArg::Cuda => variants::cuda_backend(weights, variant, self.longest, self.chunk, &self.calibration),
        }
    }
}

fn header(reference: &str, perplexity: f64, text_tokens: usize, with_fixture: bool) -> String {
    let mut line = format!(
        "reference: {reference}, perplexity {perplexity:.4} on {text_tokens} tokens (Δppl 95 %: the change's interval from the tokens' paired NLL differences, blocks of {PPL_BLOCK_TOKENS}; \"n/a\" under {} tokens)\n{:<44} {:>9} {:>8} {:>6} {:>9} {:>8} {:>10} {:>7} {:>16} {:>10} {:>9}",
        2 * PPL_BLOCK_TOKENS + 1,
        "configuration", "mean |Δ|", "max |Δ|", "top-1", "KL mean", "KL max", "perplexity", "Δppl", "Δppl 95 %", "text top-1", "text KL"
    );
    if with_fixture {
        line.push_str(&format!(" {:>9} {:>9} {:>10}", "ref2 mean", "ref2 max", "ref2 top-1"));
    }
    line
}

fn format_row(device: DeviceArg, row: &Row, reference: &TextRun) -> String {
    let c = &row.comparison;
    let ppl = c.text.perplexity();
    let interval = PerplexityChange::between(reference, &c.text)
        .map_or_else(|| "n/a".to_string(), |p| format!("[{:+.2}, {:+.2}]%", 100.0 * p.low, 100.0 * p.high));
    format!(
        "{:<44} {:>9.4} {:>8.3} {:>3}/{:<2} {:>9.5} {:>8.4} {:>10.4} {:>+6.2}% {:>16} {:>5}/{} {:>9.5}",
        row.variant.label(device),
        c.logits.mean_abs_diff(),
        c.logits.max_abs_diff,
        c.logits.top1_agree,
        c.logits.positions,
        c.kl_mean(),
        c.kl_max,
        ppl,
        100.0 * (ppl / reference.perplexity() - 1.0),
        interval,
        c.text_top1_agree,
        c.text.argmax.len(),
        c.text_kl_mean()
    ) + &c.fixture.map_or_else(String::new, |f| format!(" {:>9.4} {:>9.3} {:>7}/{}", f.mean_abs_diff(), f.max_abs_diff, f.top1_agree, f.positions))
}

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    args.evaluate(|line| println!("{line}"))?;
    Ok(())
}
