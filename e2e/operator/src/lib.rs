//! Tests only: see `tests/kind.rs`.
