//! Per-row sampling instructions for backends that pick tokens on their device.

/// How one logits row's next token is chosen when the backend samples on its device (see
/// `Backend::forward_sample`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowSampling {
    /// Temperature (below [`crate::sampling::GREEDY_TEMPERATURE`]: greedy), top-k (0: off), top-p
    /// (1: off), min-p (0: off), and `uniform` in [0, 1): the one draw of the request's own RNG
    /// for this token, so seeded requests stay reproducible whatever the batch.
    Draw { temperature: f32, top_k: u32, top_p: f32, min_p: f32, uniform: f32 },
    /// The row's logits go to the host, where the engine samples (penalties, logprobs).
    Host,
}
