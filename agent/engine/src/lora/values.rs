//! An adapter matrix's values in host memory, in the width its file held them: f32, or F16/BF16
//! kept as read. PEFT adapters are commonly saved in 16 bits (the fixtures are F16); widening them
//! to f32 at load doubled the host cache (`--max-cpu-loras`) for no precision, since both widen to
//! f32 exactly. The backends widen (CPU stacks) or narrow (the GPU's bf16 slots) when a slot is
//! written, from the same values either way.

use std::borrow::Cow;
use std::ops::Range;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Values of one LoRA matrix, row-major (`A` is `[r, in]`, `B` is `[out, r]`).
#[derive(Debug, Clone)]
pub enum LoraValues {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl Default for LoraValues {
    fn default() -> Self {
        LoraValues::F32(Vec::new())
    }
}

impl From<Vec<f32>> for LoraValues {
    fn from(v: Vec<f32>) -> Self {
        LoraValues::F32(v)
    }
}

impl FromIterator<f32> for LoraValues {
    fn from_iter<I: IntoIterator<Item = f32>>(iter: I) -> Self {
        LoraValues::F32(iter.into_iter().collect())
    }
}

/// Two matrices are equal when they hold the same values, whatever width each is stored in.
impl PartialEq for LoraValues {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (LoraValues::F32(a), LoraValues::F32(b)) => a == b,
            (LoraValues::F16(a), LoraValues::F16(b)) => a == b,
            (LoraValues::Bf16(a), LoraValues::Bf16(b)) => a == b,
            _ => self.len() == other.len() && self.as_f32() == other.as_f32(),
        }
    }
}

impl LoraValues {
    pub fn len(&self) -> usize {
        match self {
            LoraValues::F32(v) => v.len(),
            LoraValues::F16(v) => v.len(),
            LoraValues::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Host bytes the values take.
    pub fn bytes(&self) -> usize {
        match self {
            LoraValues::F32(v) => v.len() * 4,
            LoraValues::F16(v) => v.len() * 2,
            LoraValues::Bf16(v) => v.len() * 2,
        }
    }

    /// The values as f32: borrowed when stored so, widened (exactly) otherwise.
    pub fn as_f32(&self) -> Cow<'_, [f32]> {
        match self {
            LoraValues::F32(v) => Cow::Borrowed(v),
            LoraValues::F16(v) => Cow::Owned(v.to_f32_vec()),
            LoraValues::Bf16(v) => Cow::Owned(v.to_f32_vec()),
        }
    }

    /// The values as f32, owned (for transforms that rewrite them, e.g. rotations).
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            LoraValues::F32(v) => v,
            other => other.as_f32().into_owned(),
        }
    }

    /// The values in `range`, in the same width; None where the range lies outside.
    pub fn slice(&self, range: Range<usize>) -> Option<LoraValues> {
        Some(match self {
            LoraValues::F32(v) => LoraValues::F32(v.get(range)?.to_vec()),
            LoraValues::F16(v) => LoraValues::F16(v.get(range)?.to_vec()),
            LoraValues::Bf16(v) => LoraValues::Bf16(v.get(range)?.to_vec()),
        })
    }

    /// Columns `cols` of every row of `row_len` values, in the same width (`len` a multiple of
    /// `row_len`, `cols` within a row: the caller checks).
    pub fn columns(&self, row_len: usize, cols: Range<usize>) -> LoraValues {
        fn take<T: Copy>(v: &[T], row_len: usize, cols: &Range<usize>) -> Vec<T> {
            v.chunks_exact(row_len.max(1)).flat_map(|row| row[cols.clone()].iter().copied()).collect()
        }
        match self {
            LoraValues::F32(v) => LoraValues::F32(take(v, row_len, &cols)),
            LoraValues::F16(v) => LoraValues::F16(take(v, row_len, &cols)),
            LoraValues::Bf16(v) => LoraValues::Bf16(take(v, row_len, &cols)),
        }
    }

    /// The values narrowed to bf16 (round to nearest even; bf16 values are kept as they are).
    pub fn to_bf16(&self) -> LoraValues {
        match self {
            LoraValues::Bf16(v) => LoraValues::Bf16(v.clone()),
            other => LoraValues::Bf16(other.as_f32().iter().map(|&x| bf16::from_f32(x)).collect()),
        }
    }

    /// Each value as bf16 bits, round to nearest even (what the GPU's slots hold), into `out`
    /// (as many as both have).
    pub fn write_bf16_bits(&self, out: &mut [u16]) {
        match self {
            LoraValues::F32(v) => out.iter_mut().zip(v).for_each(|(d, &s)| *d = bf16::from_f32(s).to_bits()),
            LoraValues::F16(v) => out.iter_mut().zip(v).for_each(|(d, &s)| *d = bf16::from_f32(s.to_f32()).to_bits()),
            LoraValues::Bf16(v) => out.iter_mut().zip(v).for_each(|(d, &s)| *d = s.to_bits()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn widths() -> [LoraValues; 3] {
        // Every value is exact in f16; 65504 (f16's largest) is not in bf16, which rounds it to 65536.
        let v = [0.5f32, -1.25, 3.0, 0.0, 65504.0, -0.001953125];
        [LoraValues::F32(v.to_vec()), LoraValues::F16(v.iter().map(|&x| f16::from_f32(x)).collect()), LoraValues::Bf16(v.iter().map(|&x| bf16::from_f32(x)).collect())]
    }

    #[test]
    fn sixteen_bit_values_take_half_the_bytes_and_widen_exactly() {
        let [f, h, b] = widths();
        assert_eq!((f.len(), h.len(), b.len()), (6, 6, 6));
        assert_eq!((f.bytes(), h.bytes(), b.bytes()), (24, 12, 12));
        assert!(matches!(f.as_f32(), Cow::Borrowed(_)));
        // Exactly the 16-bit value, widened.
        let LoraValues::F16(raw) = &h else { unreachable!() };
        assert!(h.as_f32().iter().zip(raw).all(|(&w, &x)| w == x.to_f32()));
        assert_eq!(h.clone().into_f32(), h.as_f32().into_owned());
    }

    #[test]
    fn equality_is_by_value_across_widths() {
        let [f, h, b] = widths();
        assert_eq!(f, h);
        assert_ne!(f, b, "65504 rounds in bf16");
        assert_eq!(LoraValues::F32(b.as_f32().into_owned()), b);
        assert_ne!(LoraValues::F32(vec![1.0]), LoraValues::F32(vec![1.0, 1.0]));
    }

    #[test]
    fn slices_and_columns_keep_the_width() {
        for v in widths() {
            let s = v.slice(1..4).expect("in range");
            assert_eq!(s.as_f32().as_ref(), &v.as_f32()[1..4]);
            assert_eq!(std::mem::discriminant(&s), std::mem::discriminant(&v));
            assert!(v.slice(4..7).is_none());
            // Two rows of 3: the last two columns.
            let c = v.columns(3, 1..3);
            let all = v.as_f32();
            assert_eq!(c.as_f32().as_ref(), &[all[1], all[2], all[4], all[5]]);
            assert_eq!(std::mem::discriminant(&c), std::mem::discriminant(&v));
        }
    }

    #[test]
    fn narrowing_to_bf16_rounds_as_the_slots_do() {
        for v in widths() {
            let LoraValues::Bf16(narrowed) = v.to_bf16() else { panic!("not bf16") };
            let want: Vec<bf16> = v.as_f32().iter().map(|&x| bf16::from_f32(x)).collect();
            assert_eq!(narrowed, want);
            assert_eq!(v.to_bf16().bytes(), 2 * v.len());
        }
        // 1 + 2^-9 lies between two bf16 values (1 and 1 + 2^-7 are the neighbours); it rounds down.
        let LoraValues::Bf16(one) = LoraValues::F32(vec![1.0 + 1.0 / 512.0]).to_bf16() else { unreachable!() };
        assert_eq!(one[0].to_f32(), 1.0);
    }

    #[test]
    fn bf16_bits_round_each_width_to_the_same_slot_value() {
        let [f, h, b] = widths();
        let bits = |v: &LoraValues| {
            let mut out = vec![0u16; v.len()];
            v.write_bf16_bits(&mut out);
            out
        };
        let want: Vec<u16> = f.as_f32().iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        assert_eq!(bits(&f), want);
        assert_eq!(bits(&b), want, "bf16 values are copied as they are");
        // f16 holds these values exactly, so narrowing it gives the f32's bf16.
        assert_eq!(bits(&h), want);
    }
}
