//! Causal GQA attention over the paged KV cache.
//!
//! Each new token attends to positions `0..=pos` of its own sequence, reading K/V through the
//! sequence's block table. One task per (token, KV head) handles the query heads that share that KV
//! head, so each key is read once per group. Each task's arithmetic depends only on its own token,
//! so results do not depend on the rest of the batch.

use rayon::prelude::*;

use super::kv_cache::KvCache;
use super::matmul::dot;
use super::simd::Isa;

/// Where one token of the step reads its context from.
pub struct TokenCtx<'a> {
    pub pos: usize,
    pub block_table: &'a [u32],
}

/// Writes K and V of token `pos` (`kv_dim` each) into `layer`'s cache, rounded to the cache's
/// [`super::kv_cache::KvFormat`] (k already rotated when the format says so).
pub fn write_kv(
    cache: &mut KvCache,
    layer: usize,
    block_table: &[u32],
    pos: usize,
    k: &[f32],
    v: &[f32],
) {
    let bs = cache.shape.block_size;
    let (block, slot) = (block_table[pos / bs] as usize, pos % bs);
    let hd = cache.head_dim;
    let format = cache.format;
    for g in 0..cache.kv_heads {
        let off = cache.offset(block, g, slot);
        let (kc, vc) = &mut cache.layers[layer];
        format.k.round_head(&k[g * hd..(g + 1) * hd], &mut kc[off..off + hd]);
        format.v.round_head(&v[g * hd..(g + 1) * hd], &mut vc[off..off + hd]);
    }
}

/// `q` rows are `ld_q` apart and start with the `n_heads * head_dim` query values; `out` is
/// `tokens × (n_heads * head_dim)`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    isa: Isa,
    cache: &KvCache,
    layer: usize,
    n_heads: usize,
    q: &[f32],
    ld_q: usize,
    tokens: &[TokenCtx<'_>],
    out: &mut [f32],
) {
    let hd = cache.head_dim;
    let kvh = cache.kv_heads;
    let group = n_heads / kvh;
    out.par_chunks_mut(group * hd).enumerate().for_each_init(
        Vec::new,
        |scores: &mut Vec<f32>, (item, o)| {
            let (t, g) = (item / kvh, item % kvh);
            let job = Item {
                cache,
                layer,
                group,
                g,
                q: &q[t * ld_q..],
                tok: &tokens[t],
            };
            job.run(isa, scores, o);
        },
    );
}

/// One (token, KV head) task.
struct Item<'a> {
    cache: &'a KvCache,
    layer: usize,
    group: usize,
    g: usize,
    q: &'a [f32],
    tok: &'a TokenCtx<'a>,
}

impl Item<'_> {
    /// The same arithmetic compiled per ISA so the compiler can use wide vectors.
    fn run(&self, isa: Isa, scores: &mut Vec<f32>, o: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
            unsafe fn avx512(it: &Item<'_>, s: &mut Vec<f32>, o: &mut [f32]) {
                it.body(s, o)
            }
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2(it: &Item<'_>, s: &mut Vec<f32>, o: &mut [f32]) {
                it.body(s, o)
            }
            match isa {
                // SAFETY: the features were detected at run time.
                Isa::Avx512 => return unsafe { avx512(self, scores, o) },
                Isa::Avx2 => return unsafe { avx2(self, scores, o) },
                Isa::Generic => {}
            }
        }
        let _ = isa;
        self.body(scores, o)
    }

    #[inline(always)]
    fn body(&self, scores: &mut Vec<f32>, o: &mut [f32]) {
        let cache = self.cache;
        let (hd, bs, group, g) = (cache.head_dim, cache.shape.block_size, self.group, self.g);
        let scale = 1.0 / (hd as f32).sqrt();
        let (kc, vc) = (&cache.layers[self.layer].0, &cache.layers[self.layer].1);
        let tok = self.tok;
        let ctx = tok.pos + 1;
        scores.clear();
        scores.resize(group * ctx, 0.0);
        // Scores, block by block.
        for j0 in (0..ctx).step_by(bs) {
            let block = tok.block_table[j0 / bs] as usize;
            let base = cache.offset(block, g, 0);
            for j in j0..ctx.min(j0 + bs) {
                let kv = &kc[base + (j - j0) * hd..base + (j - j0 + 1) * hd];
                for h in 0..group {
                    let qh = &self.q[(g * group + h) * hd..(g * group + h + 1) * hd];
                    scores[h * ctx + j] = dot(qh, kv) * scale;
                }
            }
        }
        // Softmax per head.
        for h in 0..group {
            let s = &mut scores[h * ctx..(h + 1) * ctx];
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for x in s.iter_mut() {
                *x = (*x - max).exp();
                sum += *x;
            }
            let inv = 1.0 / sum;
            for x in s.iter_mut() {
                *x *= inv;
            }
        }
        // Weighted sum of values.
        o.fill(0.0);
        for j0 in (0..ctx).step_by(bs) {
            let block = tok.block_table[j0 / bs] as usize;
            let base = cache.offset(block, g, 0);
            for j in j0..ctx.min(j0 + bs) {
                let vv = &vc[base + (j - j0) * hd..base + (j - j0 + 1) * hd];
                for h in 0..group {
                    let p = scores[h * ctx + j];
                    let oh = &mut o[h * hd..(h + 1) * hd];
                    for (a, &b) in oh.iter_mut().zip(vv) {
                        *a += p * b;
                    }
                }
            }
        }
    }
}
