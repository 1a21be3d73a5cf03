//! Decoder models (Llama family) serving embeddings: `serve --task embed` on a decoder. The
//! embedding of an input is the hidden state after the model's final norm at its last token,
//! scaled to unit length (last-token pooling, as decoder embedding models are pooled). The CPU
//! decoder backend runs the forward ([`CpuBackend::final_hidden_states`]) on a KV pool of its own,
//! sized for one batch and reused every batch (no sequence outlives its forward); the batching
//! thread, tokenizing and endpoints are the encoders'.

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, EncoderBackend};
use crate::config::ModelConfig;
use crate::plan::{RaggedBatch, SeqChunk, StepBatch};
use crate::tokenizer::Tokenizer;
use crate::{EngineError, Result};

use super::config::Activation;
use super::sentence::{PoolingMode, PostStep, SentencePipeline};
use super::{EncoderConfig, EncoderModel, EncoderTask, EncoderTokenizer};

/// [`EncoderBackend`] over a decoder's CPU backend: each ragged batch becomes one or more steps of
/// fresh sequences (context 0), as many as fit the KV pool at a time.
pub struct DecoderEmbedder {
    backend: CpuBackend,
    block_size: usize,
    num_blocks: usize,
}

impl DecoderEmbedder {
    /// `backend` was built with a KV pool of at least [`DecoderEmbedder::blocks_for`] blocks.
    pub fn new(backend: CpuBackend) -> DecoderEmbedder {
        let shape = backend.kv_shape();
        DecoderEmbedder { backend, block_size: shape.block_size, num_blocks: shape.num_blocks }
    }

    /// KV blocks for batches of `max_tokens` tokens: one sequence of that length always fits;
    /// batches of many short sequences run in several steps.
    pub fn blocks_for(max_tokens: usize, block_size: usize) -> usize {
        max_tokens.div_ceil(block_size.max(1)) + 1
    }

    fn run_step(&mut self, batch: &RaggedBatch, seqs: std::ops::Range<usize>) -> Result<Vec<f32>> {
        let mut step = StepBatch::default();
        let mut next_block = 0u32;
        for i in seqs {
            let range = batch.range(i);
            let len = range.len();
            let blocks = len.div_ceil(self.block_size) as u32;
            step.seqs.push(SeqChunk {
                start: step.tokens.len(),
                len,
                context_len: 0,
                block_table: (next_block..next_block + blocks).collect(),
                wants_logits: false,
                lora_slot: None,
            });
            next_block += blocks;
            step.tokens.extend_from_slice(&batch.ids[range]);
            step.positions.extend(0..len as u32);
        }
        self.backend.final_hidden_states(&step)
    }
}

impl EncoderBackend for DecoderEmbedder {
    fn forward(&mut self, batch: &RaggedBatch) -> Result<Vec<f32>> {
        if batch.offsets.first() != Some(&0) || batch.offsets.last() != Some(&batch.ids.len()) {
            return Err(EngineError::Backend("ragged batch offsets must start at 0 and end at the token count".into()));
        }
        let mut out = Vec::with_capacity(batch.num_tokens() * self.backend.config().hidden_size);
        let (mut first, mut used) = (0, 0);
        for i in 0..batch.num_seqs() {
            let blocks = batch.range(i).len().div_ceil(self.block_size);
            if blocks > self.num_blocks {
                return Err(EngineError::Backend(format!("a sequence of {} tokens does not fit the KV pool", batch.range(i).len())));
            }
            if used + blocks > self.num_blocks {
                out.extend(self.run_step(batch, first..i)?);
                (first, used) = (i, 0);
            }
            used += blocks;
        }
        if first < batch.num_seqs() {
            out.extend(self.run_step(batch, first..batch.num_seqs())?);
        }
        Ok(out)
    }

    fn name(&self) -> String {
        format!("{} (decoder embeddings)", self.backend.name())
    }
}

impl EncoderModel {
    /// The encoder-side description of a decoder serving embeddings: its tokenizer's pipeline
    /// (limited to `max_seq_length` tokens), last-token pooling then Normalize, no classifier.
    pub fn for_decoder(config: &ModelConfig, tokenizer: &Tokenizer, max_seq_length: usize) -> Result<EncoderModel> {
        if max_seq_length == 0 || max_seq_length > config.max_position_embeddings {
            return Err(EngineError::InvalidConfig(format!(
                "max sequence length {max_seq_length} is outside 1..={} for this model",
                config.max_position_embeddings
            )));
        }
        let encoder_config = EncoderConfig {
            model_type: format!("{:?}", config.architecture).to_lowercase(),
            vocab_size: config.vocab_size,
            hidden_size: config.hidden_size,
            num_hidden_layers: config.num_hidden_layers,
            num_attention_heads: config.num_attention_heads,
            intermediate_size: config.intermediate_size,
            max_position_embeddings: max_seq_length,
            type_vocab_size: 1,
            layer_norm_eps: config.rms_norm_eps,
            // Not used: the decoder backend runs its own layers (SiLU-gated MLP).
            activation: Activation::GeluErf,
            position_offset: 0,
            labels: Vec::new(),
        };
        let pipeline = SentencePipeline {
            pooling: vec![PoolingMode::LastToken],
            steps: vec![PostStep::Normalize],
            max_seq_length: Some(max_seq_length),
        };
        Ok(EncoderModel {
            config: encoder_config,
            tokenizer: EncoderTokenizer::from_tokenizer(tokenizer.pipeline().clone(), max_seq_length)?,
            pipeline,
            classifier: None,
            task: EncoderTask::Embed,
        })
    }
}
