//! The element types a ring reduces ([`Elem`]) and how they travel ([`Codec`]): as themselves, or at half precision
//! on the wire with the sums kept in float32.

/// An element type the ring reduces: plain bytes on the wire (little-endian hosts; see `peer.rs`).
pub trait Elem: bytemuck::Pod + Send + Sync {
    /// Code in the call header, so ranks reducing different types refuse instead of mixing bytes.
    const CODE: u32;
    /// Name in error messages.
    const NAME: &'static str;
    /// `self + other`.
    fn add(self, other: Self) -> Self;
    /// `self * by` (a mean divides by the rank count).
    fn scale(self, by: f64) -> Self;
}

impl Elem for f32 {
    const CODE: u32 = 1;
    const NAME: &'static str = "float32";
    fn add(self, other: Self) -> Self {
        self + other
    }
    fn scale(self, by: f64) -> Self {
        (self as f64 * by) as f32
    }
}

impl Elem for f64 {
    const CODE: u32 = 2;
    const NAME: &'static str = "float64";
    fn add(self, other: Self) -> Self {
        self + other
    }
    fn scale(self, by: f64) -> Self {
        self * by
    }
}

/// How elements of type `T` travel: as themselves ([`Plain`]), or narrowed to a smaller type and widened again on
/// arrival (the sum is always kept in `T`).
pub trait Codec<T: Elem>: Send + Sync {
    /// The element type on the wire.
    type W: bytemuck::Pod + Send + Sync;
    /// Code in the call header (with `T::CODE`): ranks sending different wire types refuse.
    const CODE: u32;
    /// Name in error messages.
    const NAME: &'static str;
    /// `true` when `W` is `T` itself: bytes are sent straight from the data, without staging.
    const PLAIN: bool;
    /// Narrow `src` into `out` (same length).
    fn encode(src: &[T], out: &mut [Self::W]);
    /// Add the widened `src` to `dst` (same length).
    fn add(dst: &mut [T], src: &[Self::W]);
    /// Write `a` plus the widened `src` into `dst` (same lengths; the same bits as [`Codec::add`] to a copy of `a`).
    fn sum(dst: &mut [T], a: &[T], src: &[Self::W]);
    /// Replace `dst` by the widened `src` (same length).
    fn copy(dst: &mut [T], src: &[Self::W]);
}

/// Elements travel as themselves.
pub struct Plain;

impl<T: Elem> Codec<T> for Plain {
    type W = T;
    const CODE: u32 = 0;
    const NAME: &'static str = "";
    const PLAIN: bool = true;
    fn encode(src: &[T], out: &mut [T]) {
        out.copy_from_slice(src);
    }
    fn add(dst: &mut [T], src: &[T]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = d.add(*s);
        }
    }
    fn sum(dst: &mut [T], a: &[T], src: &[T]) {
        for ((d, a), s) in dst.iter_mut().zip(a).zip(src) {
            *d = a.add(*s);
        }
    }
    fn copy(dst: &mut [T], src: &[T]) {
        dst.copy_from_slice(src);
    }
}

/// float32 summed, IEEE float16 on the wire (values beyond ±65504 become infinite: for gradients and deltas).
pub struct F16Wire;

impl Codec<f32> for F16Wire {
    type W = half::f16;
    const CODE: u32 = 1;
    const NAME: &'static str = " over float16";
    const PLAIN: bool = false;
    fn encode(src: &[f32], out: &mut [half::f16]) {
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(out, src);
    }
    fn add(dst: &mut [f32], src: &[half::f16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d += s.to_f32();
        }
    }
    fn sum(dst: &mut [f32], a: &[f32], src: &[half::f16]) {
        for ((d, a), s) in dst.iter_mut().zip(a).zip(src) {
            *d = a + s.to_f32();
        }
    }
    fn copy(dst: &mut [f32], src: &[half::f16]) {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
    }
}

/// float32 summed, bfloat16 on the wire (float32's range, 8 bits of mantissa).
pub struct Bf16Wire;

impl Codec<f32> for Bf16Wire {
    type W = half::bf16;
    const CODE: u32 = 2;
    const NAME: &'static str = " over bfloat16";
    const PLAIN: bool = false;
    fn encode(src: &[f32], out: &mut [half::bf16]) {
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(out, src);
    }
    fn add(dst: &mut [f32], src: &[half::bf16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d += s.to_f32();
        }
    }
    fn sum(dst: &mut [f32], a: &[f32], src: &[half::bf16]) {
        for ((d, a), s) in dst.iter_mut().zip(a).zip(src) {
            *d = a + s.to_f32();
        }
    }
    fn copy(dst: &mut [f32], src: &[half::bf16]) {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
    }
}
