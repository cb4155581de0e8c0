//! Dense convolutions of few input channels (an image model's stem: 3 channels in), computed
//! directly: each output pixel's channels are summed in registers over the taps (kh, kw, c) in
//! that order, one broadcast input value times V vectors of 16 filter values per tap, for P
//! pixels at once (AVX-512: 4 pixels by 4 vectors, 8 by 2 or 8 by 1; AVX2: 4 by 1), then stored
//! once.
//!
//! Why: `Conv2d::rows` makes one GEMM per output row and filter row, whose depth is KW·C: 9 for
//! a 3x3 window over RGB, against the hundreds the GEMM's packing and micro-kernel are built
//! for, and its output tile is added to KH times. One core of the 2-core AMD EPYC (AVX-512),
//! batch-2 inference exports, each stem with its fused epilogue (`kiln run --profile 10`), GEMM
//! rows -> direct: MobileNetV3-small's 3x3 stride-2 3 -> 16 0.496 -> 0.328 ms,
//! EfficientNet-B0's 3 -> 32 0.725 -> 0.543 ms, ResNet-50's 7x7 stride-2 3 -> 64 2.77 -> 2.29
//! ms (0.77 of the core's FMA peak with its epilogue). A first version with one vector per
//! pixel re-read every input value once per 16 output channels and made ResNet-50's stem
//! slower (3.37 ms); broadcasting each value into 4 vectors fixed it. `KILN_NARROW_CONV=0`
//! turns the path off, to compare.
//!
//! Every channel's sum is one FMA chain over the taps in order, so the tile's shape and the
//! vector width change no bit.

use super::simd::{self, multiversion};
use crate::geometry::Geom;

/// Input channels up to which a dense convolution is computed here.
const MAX_C: usize = 4;
/// Output channels a tile computes: one AVX-512 vector (two AVX2 ones).
const LANES: usize = 16;

/// Whether `g` is computed here: dense (one group, no dilation), at most `MAX_C` input
/// channels, output channels a multiple of `LANES`.
pub(super) fn applies(g: &Geom) -> bool {
    g.is_dense() && (1..=MAX_C).contains(&g.c) && g.f > 0 && g.f.is_multiple_of(LANES)
}

/// Output rows o0..o1 of image `n` into `dst` (row o0 first, rows OW·F floats apart), every
/// element written.
///
/// # Safety
/// `applies(g)`; `x` holds g's N·H·W·C input, `w` its KH·KW·C·F filter (HWIO); `dst` is valid
/// for (o1 - o0)·OW·F floats that no other thread touches and overlaps neither.
pub(super) unsafe fn rows(
    g: &Geom,
    x: *const f32,
    w: *const f32,
    n: usize,
    o0: usize,
    o1: usize,
    dst: *mut f32,
) {
    let wide = simd::width() == simd::Width::Avx512;
    // SAFETY: forwarded contract.
    unsafe { rows_dispatch(g, x, w, (n, o0, o1), dst, wide) }
}

multiversion! {
    /// `rows_in` on the widest vectors the CPU has (`simd`).
    unsafe fn rows_dispatch / rows_at(
        g: &Geom, x: *const f32, w: *const f32, rows: (usize, usize, usize), dst: *mut f32, wide: bool
    ) => rows_in;
}

/// `rows` of image `n`, o0..o1, compiled once per vector width; `wide`: tiles for AVX-512's 32
/// registers (else AVX2's 16).
///
/// # Safety
/// As `rows`.
#[inline(always)]
unsafe fn rows_in(
    g: &Geom,
    x: *const f32,
    w: *const f32,
    (n, o0, o1): (usize, usize, usize),
    dst: *mut f32,
    wide: bool,
) {
    let (c, f) = (g.c, g.f);
    // Output vectors a tile holds per pixel: with AVX-512's 32 registers, 4 (64 channels) by 4
    // pixels or 2 by 8, so that each broadcast input value feeds several vectors; with AVX2's
    // 16, one (two registers) by 4 pixels.
    let vectors = match f / LANES {
        q if wide && q.is_multiple_of(4) => 4,
        q if wide && q.is_multiple_of(2) => 2,
        _ => 1,
    };
    // A pixel's first input element is at `base`; tap (kh, kw, c) reads base + xo and filter
    // element wo + channel.
    let mut list: Vec<(usize, usize)> = Vec::with_capacity(g.kh * g.kw * c);
    let xs = g.sw * c;
    for oh in o0..o1 {
        let (kh0, kh1) = Geom::taps(oh, g.sh, g.ph, g.kh, g.h);
        let out = dst.wrapping_add((oh - o0) * g.ow * f);
        let mut ow = 0;
        while ow < g.ow {
            let (kw0, kw1) = Geom::taps(ow, g.sw, g.pw, g.kw, g.w);
            // The run of columns from `ow` that share this column range.
            let mut end = ow + 1;
            while end < g.ow && Geom::taps(end, g.sw, g.pw, g.kw, g.w) == (kw0, kw1) {
                end += 1;
            }
            list.clear();
            let ih0 = (oh * g.sh + kh0) as isize - g.ph as isize;
            let iw0 = (ow * g.sw + kw0) as isize - g.pw as isize;
            for kh in kh0..kh1 {
                for kw in kw0..kw1 {
                    for ci in 0..c {
                        let xo = ((kh - kh0) * g.w + (kw - kw0)) * c + ci;
                        list.push((xo, ((kh * g.kw + kw) * c + ci) * f));
                    }
                }
            }
            // An empty window (all of it in the padding) leaves zeros.
            let base = if list.is_empty() {
                0
            } else {
                (((n * g.h) as isize + ih0) as usize * g.w + iw0 as usize) * c
            };
            // SAFETY (all tiles): the pixels of this run read inside the input rows and
            // columns of their valid taps (`taps`), the filter rows exist, and each tile's
            // output is inside the caller's rows.
            unsafe {
                match vectors {
                    4 => run::<4, 4>(x, w, &list, base, xs, ow, end, f, out),
                    2 => run::<8, 2>(x, w, &list, base, xs, ow, end, f, out),
                    _ if wide => run::<8, 1>(x, w, &list, base, xs, ow, end, f, out),
                    _ => run::<4, 1>(x, w, &list, base, xs, ow, end, f, out),
                }
            }
            ow = end;
        }
    }
}

/// Pixels first..end of a run (pixel `first` reading from `base`, each next one `xs` floats
/// on), output channels in blocks of V vectors: tiles of P pixels, then single pixels.
///
/// # Safety
/// As `tile` for every pixel of the run and every block of channels.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn run<const P: usize, const V: usize>(
    x: *const f32,
    w: *const f32,
    list: &[(usize, usize)],
    base: usize,
    xs: usize,
    first: usize,
    end: usize,
    f: usize,
    out: *mut f32,
) {
    let mut p = first;
    while p + P <= end {
        for f0 in (0..f).step_by(V * LANES) {
            // SAFETY: the caller's contract, pixels p..p + P.
            unsafe {
                tile::<P, V>(x, w, list, base + (p - first) * xs, xs, f0, f, out.wrapping_add(p * f + f0))
            };
        }
        p += P;
    }
    if P > 1 && p < end {
        // SAFETY: the caller's contract, pixels p..end one at a time.
        unsafe { run::<1, V>(x, w, list, base + (p - first) * xs, xs, p, end, f, out) };
    }
}

/// Pixels 0..P (inputs `xs` floats apart from `at`) by output channels f0..f0 + V·LANES:
/// out[p][j] = Σ over `list` in order of x[at + p·xs + xo] · w[wo + f0 + j], in registers,
/// stored to `out` (pixels F floats apart). The sums are named one by one: as a loop over P,
/// the compiler vectorises across the pixels.
///
/// # Safety
/// Every x[at + p·xs + xo] and w[wo + f0 + j] read is inside its tensor; out[p·F + j] is the
/// caller's to write.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const P: usize, const V: usize>(
    x: *const f32,
    w: *const f32,
    list: &[(usize, usize)],
    at: usize,
    xs: usize,
    f0: usize,
    f: usize,
    out: *mut f32,
) {
    const { assert!((P == 1 || P == 4 || P == 8) && (V == 1 || V == 2 || V == 4)) };
    let z = [[0f32; LANES]; V];
    let (mut a0, mut a1, mut a2, mut a3, mut a4, mut a5, mut a6, mut a7) = (z, z, z, z, z, z, z, z);
    for &(xo, wo) in list {
        // SAFETY: the caller's contract bounds every read.
        unsafe {
            let v: [[f32; LANES]; V] =
                std::array::from_fn(|i| w.add(wo + f0 + i * LANES).cast::<[f32; LANES]>().read_unaligned());
            let at = |p: usize| *x.add(at + p * xs + xo);
            mac(&mut a0, at(0), &v);
            if P >= 4 {
                mac(&mut a1, at(1), &v);
                mac(&mut a2, at(2), &v);
                mac(&mut a3, at(3), &v);
            }
            if P == 8 {
                mac(&mut a4, at(4), &v);
                mac(&mut a5, at(5), &v);
                mac(&mut a6, at(6), &v);
                mac(&mut a7, at(7), &v);
            }
        }
    }
    for (p, acc) in [a0, a1, a2, a3, a4, a5, a6, a7].iter().take(P).enumerate() {
        for (i, vector) in acc.iter().enumerate() {
            // SAFETY: the caller's contract.
            unsafe { out.add(p * f + i * LANES).cast::<[f32; LANES]>().write_unaligned(*vector) };
        }
    }
}

/// acc[i][j] += x · v[i][j], rounded once (one FMA where the build has it).
#[inline(always)]
fn mac<const V: usize>(acc: &mut [[f32; LANES]; V], x: f32, v: &[[f32; LANES]; V]) {
    for i in 0..V {
        for j in 0..LANES {
            acc[i][j] = x.mul_add(v[i][j], acc[i][j]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::test_values as values;
    use kiln_compiler::ir::{Padding, Shape, Window2d};

    /// The convolution in f64, tap by tap.
    fn reference(g: &Geom, x: &[f32], w: &[f32]) -> Vec<f64> {
        let mut out = vec![0f64; g.n * g.oh * g.ow * g.f];
        for n in 0..g.n {
            for oh in 0..g.oh {
                for ow in 0..g.ow {
                    for kh in 0..g.kh {
                        for kw in 0..g.kw {
                            let ih = (oh * g.sh + kh) as isize - g.ph as isize;
                            let iw = (ow * g.sw + kw) as isize - g.pw as isize;
                            if ih < 0 || iw < 0 || ih >= g.h as isize || iw >= g.w as isize {
                                continue;
                            }
                            for c in 0..g.c {
                                let xv =
                                    f64::from(x[((n * g.h + ih as usize) * g.w + iw as usize) * g.c + c]);
                                for f in 0..g.f {
                                    let wv = f64::from(w[((kh * g.kw + kw) * g.c + c) * g.f + f]);
                                    out[((n * g.oh + oh) * g.ow + ow) * g.f + f] += xv * wv;
                                }
                            }
                        }
                    }
                }
            }
        }
        out
    }

    /// Stems of every common shape (3x3, 4x4, 5x5 and 7x7 windows, strides 1, 2 and 4, SAME,
    /// VALID and explicit padding, windows mostly in the padding, 1 to 4 channels in, 16 to 64
    /// out) against the f64 sum, and each vector width the CPU has (with its own tiles) against
    /// the others, bit for bit.
    #[test]
    fn stems_match_the_sum_and_every_width_gives_the_same_bits() {
        let cases: [(usize, usize, usize, usize, usize, Padding, usize); 10] = [
            (2, 17, 3, 3, 2, Padding::Same, 16),
            (1, 23, 3, 7, 2, Padding::Explicit { before: [3, 3], after: [3, 3] }, 64),
            (1, 16, 3, 4, 4, Padding::Valid, 32),
            (2, 9, 1, 3, 1, Padding::Same, 16),
            (1, 12, 4, 5, 1, Padding::Explicit { before: [2, 2], after: [2, 2] }, 48),
            (1, 11, 2, 3, 2, Padding::Explicit { before: [1, 1], after: [0, 0] }, 32),
            (1, 5, 3, 7, 1, Padding::Same, 16),
            (1, 33, 3, 3, 2, Padding::Explicit { before: [1, 1], after: [1, 1] }, 16),
            // Windows mostly in the padding, and a stride longer than the window.
            (1, 6, 3, 3, 2, Padding::Explicit { before: [2, 2], after: [2, 2] }, 32),
            (2, 14, 3, 3, 4, Padding::Valid, 16),
        ];
        for (n, hw, c, k, s, padding, f) in cases {
            let x_shape = Shape::new([n, hw, hw + 1, c]);
            let window = Window2d { size: [k, k], stride: [s, s], padding, dilation: [1, 1], groups: 1 };
            let g = Geom::new(&x_shape, &window, f);
            assert!(applies(&g));
            let x = values(x_shape.numel(), 1);
            let w = values(k * k * c * f, 2);
            let want = reference(&g, &x, &w);
            let mut runs = Vec::new();
            for width in simd::Width::available() {
                let mut out = vec![f32::NAN; g.n * g.oh * g.ow * g.f];
                let row = g.ow * g.f;
                for img in 0..g.n {
                    // Rows in blocks of 3, as callers split them.
                    for o0 in (0..g.oh).step_by(3) {
                        let o1 = (o0 + 3).min(g.oh);
                        let dst = out[(img * g.oh + o0) * row..].as_mut_ptr();
                        // SAFETY: the geometry's input, filter and rows o0..o1 of image img.
                        let wide = width == simd::Width::Avx512;
                        unsafe { rows_at(width, &g, x.as_ptr(), w.as_ptr(), (img, o0, o1), dst, wide) };
                    }
                }
                for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (f64::from(got) - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{} [{i}]: {got} vs {want}",
                        g.text()
                    );
                }
                runs.push(out);
            }
            for other in &runs[1..] {
                assert!(runs[0].iter().zip(other).all(|(a, b)| a.to_bits() == b.to_bits()), "{}", g.text());
            }
        }
    }
}
