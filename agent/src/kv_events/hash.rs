//! Block hashes as prefix-aware routers compute them from a prompt: vLLM's `sha256_cbor_64bit`
//! scheme (`--prefix-caching-hash-algo sha256_cbor_64bit`, vLLM v0.10), which llm-d's precise
//! prefix-cache scorer reproduces (llm-d-kv-cache-manager, `kvblock.ChunkedTokenDatabase`):
//!
//! - `hash(x)` = the last 8 bytes, read big-endian, of SHA-256 over the canonical CBOR encoding
//!   of `x`;
//! - the root: `NONE_HASH = hash(seed)`, the seed a text string (vLLM's `PYTHONHASHSEED`, llm-d's
//!   `HashSeed`; both must be set to the same value);
//! - block `i`: `hash([parent, [token ids of the block], extra])`, `parent` the previous block's hash
//!   (NONE_HASH for the first), `extra` null for the base model.
//!
//! The engine keys its own prefix cache by a faster 128-bit hash; these are computed off the engine
//! thread, per stored block, for the events only.

use sha2::{Digest, Sha256};

/// CBOR major types used here.
const UNSIGNED: u8 = 0;
const TEXT: u8 = 3;
const ARRAY: u8 = 4;
const NULL: u8 = 0xf6;

/// A CBOR item head in its shortest form (canonical CBOR, RFC 8949 §4.2.1).
fn head(out: &mut Vec<u8>, major: u8, n: u64) {
    let m = major << 5;
    if n < 24 {
        out.push(m | n as u8);
    } else if n <= u64::from(u8::MAX) {
        out.extend([m | 24, n as u8]);
    } else if n <= u64::from(u16::MAX) {
        out.push(m | 25);
        out.extend((n as u16).to_be_bytes());
    } else if n <= u64::from(u32::MAX) {
        out.push(m | 26);
        out.extend((n as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend(n.to_be_bytes());
    }
}

fn sha256_low64(bytes: &[u8]) -> u64 {
    let digest = Sha256::digest(bytes);
    let mut low = [0u8; 8];
    low.copy_from_slice(&digest[24..32]);
    u64::from_be_bytes(low)
}

/// The chain's root hash for `seed`.
pub fn none_hash(seed: &str) -> u64 {
    let mut cbor = Vec::with_capacity(seed.len() + 9);
    head(&mut cbor, TEXT, seed.len() as u64);
    cbor.extend(seed.as_bytes());
    sha256_low64(&cbor)
}

/// The hash of one full block. `extra`: None for the base model; for an adapter's blocks its id as
/// a one-element array (so they never collide with the base model's; routers that hash prompts
/// without adapter keys do not match them, as with vLLM).
pub fn block_hash(parent: u64, tokens: &[u32], extra: Option<u64>) -> u64 {
    let mut cbor = Vec::with_capacity(16 + tokens.len() * 5);
    head(&mut cbor, ARRAY, 3);
    head(&mut cbor, UNSIGNED, parent);
    head(&mut cbor, ARRAY, tokens.len() as u64);
    for &t in tokens {
        head(&mut cbor, UNSIGNED, u64::from(t));
    }
    match extra {
        None => cbor.push(NULL),
        Some(id) => {
            head(&mut cbor, ARRAY, 1);
            head(&mut cbor, UNSIGNED, id);
        }
    }
    sha256_low64(&cbor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cbor_heads_are_shortest() {
        let enc = |n| {
            let mut v = Vec::new();
            head(&mut v, UNSIGNED, n);
            v
        };
        // RFC 8949 Appendix A examples.
        assert_eq!(enc(0), [0x00]);
        assert_eq!(enc(23), [0x17]);
        assert_eq!(enc(24), [0x18, 0x18]);
        assert_eq!(enc(1000), [0x19, 0x03, 0xe8]);
        assert_eq!(enc(1_000_000), [0x1a, 0x00, 0x0f, 0x42, 0x40]);
        assert_eq!(enc(1_000_000_000_000), [0x1b, 0x00, 0x00, 0x00, 0xe8, 0xd4, 0xa5, 0x10, 0x00]);
        assert_eq!(enc(u64::MAX), [0x1b, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
    }
}
