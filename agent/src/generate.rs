//! `peregrine-agent generate`: one prompt, offline, like `llama-cli`. Streams the text to stdout as it
//! is generated, or prints one JSON object with `--json`.

use std::io::Write;

use anyhow::Context;
use clap::Args;
use peregrine_engine::request::{FinishReason, GenerationRequest, RequestEvent, SamplingParams};
use peregrine_engine::tokenizer::{ChatMessage, IncrementalDecoder, StopMatcher};
use serde::Serialize;

use crate::runtime::EngineArgs;

#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Stop strings (repeatable); the text ends before the first one.
    #[arg(long)]
    pub stop: Vec<String>,
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print prompt and generated token ids, text and finish reason as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct GenerateReport {
    prompt: String,
    prompt_token_ids: Vec<u32>,
    token_ids: Vec<u32>,
    text: String,
    finish_reason: &'static str,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let runtime = args.engine.start()?;
    let tokenizer = runtime.tokenizer.clone().context("this model has no tokenizer: generate needs one")?;
    let prompt = if args.chat {
        let template = tokenizer.chat_template().context("the model has no chat template (drop --chat)")?;
        template.render(&[ChatMessage::new("user", args.prompt.clone())], true)?
    } else {
        args.prompt.clone()
    };
    let prompt_token_ids = tokenizer.encode(&prompt)?;
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        // The engine's --seed seeds this one request, so a run repeats with the same flags.
        seed: Some(args.engine.seed),
        max_tokens: args.max_tokens,
        ignore_eos: args.ignore_eos,
        ..SamplingParams::default()
    };
    let id = runtime.engine.new_request_id();
    let request = GenerationRequest { id, prompt_tokens: prompt_token_ids.clone(), params, adapter: None };
    let mut stream = runtime.engine.submit(request)?;

    let mut decoder = IncrementalDecoder::new(tokenizer.clone(), true);
    let mut stops = StopMatcher::new(args.stop.clone());
    let mut token_ids = Vec::new();
    let mut text = String::new();
    let mut stdout = std::io::stdout().lock();
    let mut emit = |piece: &str, text: &mut String| -> anyhow::Result<()> {
        text.push_str(piece);
        if !args.json && !piece.is_empty() {
            stdout.write_all(piece.as_bytes())?;
            stdout.flush()?;
        }
        Ok(())
    };
    let finish_reason = loop {
        match stream.blocking_next() {
            Some(RequestEvent::Scheduled { .. }) => {}
            Some(RequestEvent::Token(t)) => {
                token_ids.push(t.token_id);
                let out = stops.push(&decoder.push(t.token_id)?);
                emit(&out.text, &mut text)?;
                if out.stopped {
                    runtime.engine.abort(id);
                    break FinishReason::Stop;
                }
            }
            Some(RequestEvent::Finished { reason, .. }) => {
                let tail = decoder.finish();
                let mut out = stops.push(&tail);
                if !out.stopped {
                    out.text.push_str(&stops.finish());
                }
                emit(&out.text, &mut text)?;
                break if out.stopped { FinishReason::Stop } else { reason };
            }
            Some(RequestEvent::Error(message)) => anyhow::bail!("generation failed: {message}"),
            None => anyhow::bail!("the engine stopped"),
        }
    };
    drop(stream);
    runtime.engine.shutdown();
    if args.json {
        let report = GenerateReport {
            prompt,
            prompt_token_ids,
            token_ids,
            text,
            finish_reason: finish_reason.as_str(),
        };
        writeln!(stdout, "{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        writeln!(stdout)?;
    }
    Ok(())
}
