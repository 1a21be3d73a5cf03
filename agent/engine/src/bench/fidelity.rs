//! How close a backend's logits are to a reference's (e.g. transformers in float32, or the same
//! weights unquantized): mean and max |Δlogit| over the reference's top-k ids at every position,
//! top-1 agreement, KL(reference ‖ ours) over the whole vocabulary, and perplexity on a text. Used by
//! `peregrine-agent eval` to measure what 8-bit weights and KV caches cost, and to bound it in tests.

use crate::backend::Backend;
use crate::model::rowquant::{Activations, RowFormat};
use crate::plan::{SeqChunk, StepBatch};
use crate::Result;

/// One prompt of a reference: its tokens and, for each position, the reference's top-k next-token
/// ids (best first) and their logits.
#[derive(Debug, Clone)]
pub struct ReferencePrompt {
    pub input_ids: Vec<u32>,
    pub positions: Vec<(Vec<u32>, Vec<f32>)>,
}

/// The prompts of a reference file in the fixtures' format (`prompts[].input_ids`,
/// `prompts[].positions[].top10_ids` / `top10_logits`, see `tests/fixtures/README.md`).
pub fn prompts_from_reference(json: &serde_json::Value) -> std::result::Result<Vec<ReferencePrompt>, String> {
    fn list<T>(v: &serde_json::Value, what: &str, f: impl Fn(&serde_json::Value) -> Option<T>) -> std::result::Result<Vec<T>, String> {
        v.as_array()
            .ok_or_else(|| format!("{what} is not a list"))?
            .iter()
            .map(|x| f(x).ok_or_else(|| format!("{what} holds a bad value {x}")))
            .collect()
    }
    let ids = |v: &serde_json::Value, what: &str| list(v, what, |x| x.as_u64().and_then(|n| u32::try_from(n).ok()));
    let mut out = Vec::new();
    for p in json["prompts"].as_array().ok_or("no prompts list")? {
        let input_ids = ids(&p["input_ids"], "input_ids")?;
        let mut positions = Vec::new();
        for q in p["positions"].as_array().ok_or("no positions list")? {
            let top = ids(&q["top10_ids"], "top10_ids")?;
            let logits = list(&q["top10_logits"], "top10_logits", |x| x.as_f64().map(|f| f as f32))?;
            positions.push((top, logits));
        }
        if positions.len() != input_ids.len() {
            return Err(format!("{} positions for {} input ids", positions.len(), input_ids.len()));
        }
        out.push(ReferencePrompt { input_ids, positions });
    }
    Ok(out)
}

/// Accumulated comparison over positions.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Fidelity {
    pub positions: usize,
    pub top1_agree: usize,
    /// Logits compared (positions × k).
    pub compared: usize,
    pub sum_abs_diff: f64,
    pub max_abs_diff: f64,
}

impl Fidelity {
    pub fn mean_abs_diff(&self) -> f64 {
        self.sum_abs_diff / self.compared.max(1) as f64
    }

    /// Adds one position: `row` is our full logits row.
    pub fn add(&mut self, row: &[f32], ref_ids: &[u32], ref_logits: &[f32]) {
        self.positions += 1;
        if ref_ids.first().is_some_and(|&id| argmax(row) == id as usize) {
            self.top1_agree += 1;
        }
        for (&id, &want) in ref_ids.iter().zip(ref_logits) {
            let got = row.get(id as usize).copied().unwrap_or(f32::NAN);
            let d = (got as f64 - want as f64).abs();
            self.compared += 1;
            self.sum_abs_diff += d;
            // NaN compares false: make it the maximum so it is never hidden.
            if d.is_nan() || d > self.max_abs_diff {
                self.max_abs_diff = if d.is_nan() { f64::INFINITY } else { d };
            }
        }
    }
}

/// The bounds 8-bit weights must meet on SmolLM2 against transformers' float32 logits of the same
/// weights (`fixtures/smollm2/reference.json`, 36 positions, |Δ| over the reference's top-10 ids):
/// `(label, format, activations, max mean |Δlogit|, min top-1 of 36)`, per-row scales. From the
/// figures measured on 2026-11-25 (docs/benchmarks.md, "8-bit weights: fidelity"), mean |Δlogit| /
/// top-1: fp8 W8A8 1.032 / 31, int8 W8A8 1.197 / 32, int8 weight-only 0.205 / 36, plus headroom of
/// 25% on the mean and 2 positions of top-1, because the other kernel ISAs (AVX2, portable) sum in
/// another order and a different rounding of one activation code moves these figures a little; a
/// broken quantizer moves them by whole units (per-tensor int8: 1.8 / 21). `tests/quant_fidelity.rs`
/// checks them against the fixture, the agent's `eval` test against the unquantized model (which
/// equals the fixture to 1e-3).
pub const SMOLLM2_WEIGHT_BOUNDS: [(&str, RowFormat, Activations, f64, usize); 3] = [
    ("fp8 W8A8", RowFormat::Fp8E4m3, Activations::PerToken, 1.3, 29),
    ("int8 W8A8", RowFormat::Int8, Activations::PerToken, 1.5, 30),
    ("int8 weight-only", RowFormat::Int8, Activations::Float, 0.26, 34),
];

/// Runs `tokens` (one sequence from position 0) through the backend and hands `visit` the logits row
/// of every position, in order. Each step carries up to `chunk` positions, each as its own
/// one-token sequence over the same block table (blocks `0..`): the step writes every token's K and V
/// before any attends, so position `p` sees exactly `0..=p`, and one step yields all its rows'
/// logits (a prefill chunk would give only the last).
pub fn for_each_position(
    backend: &mut dyn Backend,
    tokens: &[u32],
    chunk: usize,
    mut visit: impl FnMut(usize, &[f32]),
) -> Result<()> {
    let block = backend.kv_shape().block_size.max(1);
    let table: Vec<u32> = (0..tokens.len().div_ceil(block) as u32).collect();
    let chunk = chunk.max(1);
    for start in (0..tokens.len()).step_by(chunk) {
        let end = (start + chunk).min(tokens.len());
        let batch = StepBatch {
            tokens: tokens[start..end].to_vec(),
            positions: (start as u32..end as u32).collect(),
            seqs: (start..end)
                .map(|pos| SeqChunk {
                    start: pos - start,
                    len: 1,
                    context_len: pos,
                    block_table: table.clone(),
                    wants_logits: true,
                    lora_slot: None,
                })
                .collect(),
        };
        let out = backend.forward(&batch)?;
        for (i, pos) in (start..end).enumerate() {
            visit(pos, out.row(i));
        }
    }
    Ok(())
}

/// `log Σ exp(row)`, in f64.
fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln()
}

/// KL(p ‖ q) of the softmax distributions of two logits rows, in nats.
pub fn kl_divergence(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let (lp, lq) = (log_sum_exp(p_logits), log_sum_exp(q_logits));
    let kl: f64 = p_logits
        .iter()
        .zip(q_logits)
        .map(|(&a, &b)| {
            let log_p = a as f64 - lp;
            log_p.exp() * (log_p - (b as f64 - lq))
        })
        .sum();
    // Rounding can leave a hair below zero for identical rows; NaN stays NaN.
    if kl < 0.0 { 0.0 } else { kl }
}

/// `-log softmax(row)[id]`: the negative log-likelihood of token `id`.
pub fn nll(row: &[f32], id: u32) -> f64 {
    let v = row.get(id as usize).copied().unwrap_or(f32::NAN) as f64;
    log_sum_exp(row) - v
}

/// Indices of the `k` largest values, largest first.
pub fn top_k(row: &[f32], k: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..row.len() as u32).collect();
    let k = k.min(ids.len());
    if k == 0 {
        return Vec::new();
    }
    ids.select_nth_unstable_by(k - 1, |&a, &b| row[b as usize].total_cmp(&row[a as usize]));
    ids.truncate(k);
    ids.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    ids
}

/// A reference run: every position's full logits row of each prompt, and the NLL of each next token
/// of the text with the reference's greedy pick there.
#[derive(Debug, Clone)]
pub struct Reference {
    /// Per prompt: its tokens and one logits row per position.
    pub prompts: Vec<(Vec<u32>, Vec<Vec<f32>>)>,
    pub text: TextRun,
    /// The text's logits rows at its first [`TEXT_KL_MAX_POSITIONS`] positions.
    pub text_rows: Vec<Vec<f32>>,
}

/// What one model did on the perplexity text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TextRun {
    /// NLL of token `i + 1` given `0..=i`, for every position but the last.
    pub nll: Vec<f64>,
    /// The greedy pick at every position but the last.
    pub argmax: Vec<u32>,
}

impl TextRun {
    pub fn perplexity(&self) -> f64 {
        (self.nll.iter().sum::<f64>() / self.nll.len().max(1) as f64).exp()
    }
}

/// Tokens per block for [`PerplexityChange`]'s standard error.
pub const PPL_BLOCK_TOKENS: usize = 32;

/// How much a configuration changed the perplexity of a text against the reference's run on the
/// same tokens, with a 95 % interval, as ratios minus one (+0.016 is +1.6 %). Each token's NLL
/// difference (ours − reference) is paired; their mean `m` gives the change `exp(m) − 1` (exactly
/// the perplexities' ratio − 1). The interval is `exp(m ± t · SE) − 1`, with the standard error from
/// the means of consecutive blocks of [`PPL_BLOCK_TOKENS`] tokens (batch means): neighbouring
/// tokens' differences are correlated, so counting every token as independent would make the
/// interval too narrow. It says whether a 1,200-token text can tell a change from rounding noise: a
/// change whose interval holds 0 cannot be told from none.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PerplexityChange {
    pub change: f64,
    pub low: f64,
    pub high: f64,
}

impl PerplexityChange {
    /// None where the runs cover different numbers of tokens, or fewer than two whole blocks.
    pub fn between(reference: &TextRun, ours: &TextRun) -> Option<PerplexityChange> {
        if reference.nll.len() != ours.nll.len() {
            return None;
        }
        let diffs: Vec<f64> = ours.nll.iter().zip(&reference.nll).map(|(a, b)| a - b).collect();
        let blocks: Vec<f64> = diffs.chunks_exact(PPL_BLOCK_TOKENS).map(mean).collect();
        if blocks.len() < 2 {
            return None;
        }
        let block_mean = mean(&blocks);
        let variance = blocks.iter().map(|b| (b - block_mean).powi(2)).sum::<f64>() / (blocks.len() - 1) as f64;
        let half_width = student_t_975(blocks.len() - 1) * (variance / blocks.len() as f64).sqrt();
        let m = mean(&diffs);
        Some(PerplexityChange { change: m.exp_m1(), low: (m - half_width).exp_m1(), high: (m + half_width).exp_m1() })
    }

    /// Whether the interval leaves out "no change".
    pub fn significant(&self) -> bool {
        self.low > 0.0 || self.high < 0.0
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Student's t at 0.975 for `df` degrees of freedom (df ≥ 1): the tables' values up to 6, then the
/// Cornish-Fisher expansion around the normal's 1.96 (within 0.5 % of the tables from 7 up).
fn student_t_975(df: usize) -> f64 {
    const TABLE: [f64; 6] = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447];
    if let Some(&t) = df.checked_sub(1).and_then(|i| TABLE.get(i)) {
        return t;
    }
    let (z, n) = (1.959_964f64, df as f64);
    z + (z.powi(3) + z) / (4.0 * n) + (5.0 * z.powi(5) + 16.0 * z.powi(3) + 3.0 * z) / (96.0 * n * n)
}

/// Runs `text` through the backend: NLL and greedy pick per position.
pub fn run_text(backend: &mut dyn Backend, text: &[u32], chunk: usize) -> Result<TextRun> {
    run_text_visiting(backend, text, chunk, |_, _| {})
}

/// [`run_text`], handing `visit` every position's logits row too.
fn run_text_visiting(backend: &mut dyn Backend, text: &[u32], chunk: usize, mut visit: impl FnMut(usize, &[f32])) -> Result<TextRun> {
    let mut run = TextRun::default();
    for_each_position(backend, text, chunk, |pos, row| {
        if let Some(&next) = text.get(pos + 1) {
            run.nll.push(nll(row, next));
            run.argmax.push(argmax(row) as u32);
        }
        visit(pos, row);
    })?;
    Ok(run)
}

/// Text positions whose reference logits are kept for the text's KL (the first ones): bounds the
/// reference's memory to this many vocabulary rows of f32 (SmolLM2: 2048 × 49152 × 4 B = 400 MB at
/// most; the built-in text has 1198 tokens).
pub const TEXT_KL_MAX_POSITIONS: usize = 2048;

/// Runs the reference model: keeps every prompt position's logits, and the text's run.
pub fn run_reference(backend: &mut dyn Backend, prompts: &[Vec<u32>], text: &[u32], chunk: usize) -> Result<Reference> {
    let mut out = Vec::with_capacity(prompts.len());
    for p in prompts {
        let mut rows = Vec::with_capacity(p.len());
        for_each_position(backend, p, chunk, |_, row| rows.push(row.to_vec()))?;
        out.push((p.clone(), rows));
    }
    let mut text_rows = Vec::with_capacity(text.len().min(TEXT_KL_MAX_POSITIONS));
    let text_run = run_text_visiting(backend, text, chunk, |pos, row| {
        if pos < TEXT_KL_MAX_POSITIONS {
            text_rows.push(row.to_vec());
        }
    })?;
    Ok(Reference { prompts: out, text: text_run, text_rows })
}

/// How one configuration compares with the reference.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Comparison {
    /// |Δlogit| over the reference's top-10 ids and top-1 agreement, on the prompts.
    pub logits: Fidelity,
    /// KL(reference ‖ ours) per prompt position.
    pub kl_sum: f64,
    pub kl_max: f64,
    pub text: TextRun,
    /// Text positions where our greedy pick equals the reference's.
    pub text_top1_agree: usize,
    /// KL(reference ‖ ours) summed over the text's first [`TEXT_KL_MAX_POSITIONS`] positions, and
    /// how many: many more positions, at longer contexts, than the prompts'.
    pub text_kl_sum: f64,
    pub text_kl_positions: usize,
    /// |Δlogit| and top-1 on the prompts against a second, fixed reference (transformers' float32
    /// logits of the same prompts), when one was given to [`compare_with_fixture`].
    pub fixture: Option<Fidelity>,
}

impl Comparison {
    pub fn kl_mean(&self) -> f64 {
        self.kl_sum / self.logits.positions.max(1) as f64
    }

    pub fn text_kl_mean(&self) -> f64 {
        self.text_kl_sum / self.text_kl_positions.max(1) as f64
    }
}

/// Runs the prompts and the text through `backend` and compares every position with `reference`.
pub fn compare(backend: &mut dyn Backend, reference: &Reference, text: &[u32], chunk: usize) -> Result<Comparison> {
    compare_with_fixture(backend, reference, text, chunk, None)
}

/// [`compare`], and with `fixture` (one entry per prompt of `reference`, the same tokens; the caller
/// checks [`fixture_matches`]) the prompts' logits against it too ([`Comparison::fixture`]).
pub fn compare_with_fixture(backend: &mut dyn Backend, reference: &Reference, text: &[u32], chunk: usize, fixture: Option<&[ReferencePrompt]>) -> Result<Comparison> {
    let mut c = Comparison { fixture: fixture.map(|_| Fidelity::default()), ..Comparison::default() };
    for (i, (tokens, ref_rows)) in reference.prompts.iter().enumerate() {
        let mut rows = Vec::with_capacity(tokens.len());
        for_each_position(backend, tokens, chunk, |_, row| rows.push(row.to_vec()))?;
        if let (Some(f), Some(want)) = (c.fixture.as_mut(), fixture.and_then(|p| p.get(i))) {
            add_prompt(f, &rows, want);
        }
        for (ours, theirs) in rows.iter().zip(ref_rows) {
            let ids = top_k(theirs, 10);
            let ref_logits: Vec<f32> = ids.iter().map(|&i| theirs[i as usize]).collect();
            c.logits.add(ours, &ids, &ref_logits);
            let kl = kl_divergence(theirs, ours);
            c.kl_sum += kl;
            if kl.is_nan() || kl > c.kl_max {
                c.kl_max = if kl.is_nan() { f64::INFINITY } else { kl };
            }
        }
    }
    let (mut kl_sum, mut kl_positions) = (0.0, 0);
    c.text = run_text_visiting(backend, text, chunk, |pos, row| {
        if let Some(theirs) = reference.text_rows.get(pos) {
            kl_sum += kl_divergence(theirs, row);
            kl_positions += 1;
        }
    })?;
    (c.text_kl_sum, c.text_kl_positions) = (kl_sum, kl_positions);
    c.text_top1_agree = c.text.argmax.iter().zip(&reference.text.argmax).filter(|(a, b)| a == b).count();
    Ok(c)
}

/// Whether `fixture` holds exactly the prompts `reference` ran (same tokens, in order), so that
/// [`compare_with_fixture`] compares like with like.
pub fn fixture_matches(reference: &Reference, fixture: &[ReferencePrompt]) -> bool {
    reference.prompts.len() == fixture.len() && reference.prompts.iter().zip(fixture).all(|((tokens, _), f)| *tokens == f.input_ids)
}

/// The reference run's own prompts against `fixture` ([`fixture_matches`] checked by the caller).
pub fn reference_vs_fixture(reference: &Reference, fixture: &[ReferencePrompt]) -> Fidelity {
    let mut f = Fidelity::default();
    for ((_, rows), want) in reference.prompts.iter().zip(fixture) {
        add_prompt(&mut f, rows, want);
    }
    f
}

/// Adds every position of one prompt: `rows` our logits rows, `want` the fixture's top-k.
fn add_prompt(f: &mut Fidelity, rows: &[Vec<f32>], want: &ReferencePrompt) {
    for (row, (ids, logits)) in rows.iter().zip(&want.positions) {
        f.add(row, ids, logits);
    }
}

/// Lowest index of the largest value (the greedy pick).
fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// Runs every prompt token by token through the backend's KV cache (blocks `0..` reused per prompt)
/// and compares each position's logits with the reference.
pub fn measure(backend: &mut dyn Backend, prompts: &[ReferencePrompt]) -> Result<Fidelity> {
    let block = backend.kv_shape().block_size.max(1);
    let mut fidelity = Fidelity::default();
    for prompt in prompts {
        let table: Vec<u32> = (0..prompt.input_ids.len().div_ceil(block) as u32).collect();
        for (pos, (&token, (ids, logits))) in prompt.input_ids.iter().zip(&prompt.positions).enumerate() {
            let batch = StepBatch {
                tokens: vec![token],
                positions: vec![pos as u32],
                seqs: vec![SeqChunk {
                    start: 0,
                    len: 1,
                    context_len: pos,
                    block_table: table.clone(),
                    wants_logits: true,
                    lora_slot: None,
                }],
            };
            let out = backend.forward(&batch)?;
            fidelity.add(out.row(0), ids, logits);
        }
    }
    Ok(fidelity)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_top1_and_max() {
        let mut f = Fidelity::default();
        f.add(&[0.0, 3.0, 1.0], &[1, 2], &[2.5, 1.0]);
        f.add(&[5.0, 3.0, 1.0], &[1, 0], &[4.0, 4.5]);
        assert_eq!((f.positions, f.top1_agree, f.compared), (2, 1, 4));
        assert!((f.mean_abs_diff() - (0.5 + 0.0 + 1.0 + 0.5) / 4.0).abs() < 1e-12);
        assert_eq!(f.max_abs_diff, 1.0);
        f.add(&[f32::NAN, 0.0], &[0], &[1.0]);
        assert_eq!(f.max_abs_diff, f64::INFINITY, "NaN logits are never hidden");
    }

    #[test]
    fn kl_nll_and_top_k_by_their_definitions() {
        let p = [1.0f32, 2.0, 0.5];
        assert!(kl_divergence(&p, &p).abs() < 1e-12);
        // A constant shift is the same distribution.
        assert!(kl_divergence(&p, &[11.0, 12.0, 10.5]).abs() < 1e-9);
        let q = [2.0f32, 0.0, 0.5];
        let soft = |r: &[f32]| {
            let z: f64 = r.iter().map(|&v| (v as f64).exp()).sum();
            r.iter().map(|&v| (v as f64).exp() / z).collect::<Vec<_>>()
        };
        let (sp, sq) = (soft(&p), soft(&q));
        let want: f64 = sp.iter().zip(&sq).map(|(a, b)| a * (a / b).ln()).sum();
        assert!((kl_divergence(&p, &q) - want).abs() < 1e-9);
        assert!((nll(&p, 1) - -sp[1].ln()).abs() < 1e-9);
        assert_eq!(top_k(&[0.1, 3.0, -1.0, 3.0, 2.0], 3), vec![1, 3, 4]);
        let run = TextRun { nll: vec![1.0, 3.0], argmax: vec![0, 0] };
        assert!((run.perplexity() - 2f64.exp()).abs() < 1e-12);
    }

    fn text_run(nll: Vec<f64>) -> TextRun {
        TextRun { argmax: vec![0; nll.len()], nll }
    }

    #[test]
    fn perplexity_change_is_the_ratio_with_an_interval_from_block_means() {
        // 4 blocks of 32 tokens; ours adds 0.01, 0.03, 0.01, 0.03 nats a token, block by block.
        let reference = text_run((0..128).map(|i| 2.0 + (i % 7) as f64 * 0.1).collect());
        let shift = |i: usize| if (i / PPL_BLOCK_TOKENS) % 2 == 0 { 0.01 } else { 0.03 };
        let ours = text_run(reference.nll.iter().enumerate().map(|(i, x)| x + shift(i)).collect());
        let c = PerplexityChange::between(&reference, &ours).unwrap();
        assert!((c.change - (ours.perplexity() / reference.perplexity() - 1.0)).abs() < 1e-12);
        assert!((c.change - 0.02f64.exp_m1()).abs() < 1e-12);
        // Block means 0.01, 0.03, 0.01, 0.03: sd 0.011547, SE 0.005774, t(3) 3.182.
        let half: f64 = 3.182 * 0.011547005 / 2.0;
        assert!((c.low - (0.02 - half).exp_m1()).abs() < 1e-6, "{c:?}");
        assert!((c.high - (0.02 + half).exp_m1()).abs() < 1e-6, "{c:?}");
        assert!(c.significant());
        // The same shift in every block: no spread, a point interval.
        let even = text_run(reference.nll.iter().map(|x| x + 0.02).collect());
        let e = PerplexityChange::between(&reference, &even).unwrap();
        assert!((e.low - e.high).abs() < 1e-12 && e.significant());
        // Differences that cancel between blocks: not told from no change.
        let mixed = text_run(reference.nll.iter().enumerate().map(|(i, x)| x + shift(i) - 0.02).collect());
        let m = PerplexityChange::between(&reference, &mixed).unwrap();
        assert!(m.change.abs() < 1e-12 && m.low < 0.0 && m.high > 0.0 && !m.significant(), "{m:?}");
        // Too short, or runs of different texts: no figure.
        assert!(PerplexityChange::between(&text_run(vec![1.0; 40]), &text_run(vec![1.1; 40])).is_none());
        assert!(PerplexityChange::between(&reference, &text_run(vec![1.0; 96])).is_none());
    }

    #[test]
    fn student_t_follows_the_tables() {
        for (df, table) in [(1, 12.706), (3, 3.182), (6, 2.447), (7, 2.365), (10, 2.228), (36, 2.028), (1000, 1.962)] {
            assert!((student_t_975(df) / table - 1.0).abs() < 0.005, "df {df}: {} vs {table}", student_t_975(df));
        }
    }
}
