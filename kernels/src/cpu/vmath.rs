//! Vectorisable f32 transcendentals: exp, ln, sigmoid, tanh, erf and exact GELU (with its
//! derivative) without libm calls: range reduction by the 1.5·2^23 rounding trick with the
//! exponent read from the mantissa (a saturating float-to-int cast does not vectorise), 2^n built
//! by integer shifts, special cases by selects, polynomials by Horner's rule in fused
//! multiply-adds (`fma`: x86-64-v3 builds, `.cargo/config.toml`), so that the compiler turns a
//! loop over a slice into AVX2 code.
//!
//! Why and what it gave: libm's scalar calls were the CPU's elementwise hot spot. 1M floats in
//! [-6, 6], unary kernel on 2 threads, median of 15, before -> after on the 2-core build machine
//! (then an example, now `cargo bench --bench transcendentals`): first the polynomials (2026-11-25): tanh
//! 4.28 -> 0.45 ms, sigmoid 1.57 -> 0.31 ms, exp 0.68 -> 0.28 ms, ln 0.83 -> 0.39 ms (relu:
//! 0.05-0.09 ms); then (2026-11-26, same machine, same hour, old -> new) FMA in every polynomial
//! and GELU from the Gaussian tail (`gauss_tail`: one exp, one division, one polynomial, where
//! x·(1 + erf(x/√2))/2 evaluated erf's two branches and the derivative a second exp): exp
//! 0.36-0.39 -> 0.22-0.28 ms, ln 0.53-0.57 -> 0.44-0.45, tanh 0.68-0.70 -> 0.48-0.55, sigmoid
//! 0.44 -> 0.31, erf 0.94-0.99 -> 0.60-0.63, GELU 1.01-1.02 -> 0.55-0.64 and its gradient
//! 1.50-1.53 -> 0.69-0.71 ms; the transformer's CPU training step 50-52 -> 47-48 ms
//! (`examples/profile_cpu.rs`). Against the libm baseline (gelu 2.3, tanh 5.1, sigmoid
//! 3.4, exp 1.6 ms): GELU 3.6-4.2x, tanh 9-11x, sigmoid 11x, exp 6-7x.
//!
//! Then (2026-11-27) the loops on the widest vectors the CPU has (`simd`: AVX-512 where present,
//! chosen at run time, the same bits), and the issue-time scalar kernels measured side by side in
//! the same run instead of against figures of another day (`cargo bench --bench transcendentals`,
//! 1M floats, 2 threads, 5 interleaved rounds; speed-up over the issue-time kernel on uniform
//! [-6, 6] / standard normal inputs): exp 8.9x / 8.7x, ln 6.0x / 5.9x, tanh 22x / 30x, sigmoid
//! 8.4x / 19x, erf 20x / 15x, GELU 20x / 11x, GELU's gradient 21x / 14x (kiln's GELU 0.36 ms,
//! the issue-time one 7.2 ms on uniform inputs, 4.2 ms on normal ones: libm's `erff` has a fast
//! branch near 0). Capped at AVX2 (`KILN_SIMD=avx2`, same run conditions): ln 3.3x and sigmoid
//! 4.9x / 12x, below the 5x; the others 6-30x.
//!
//! Accuracy against libm (or double precision) over sweeps of every range (tests below): exp and
//! ln within 1 ulp, sigmoid, tanh and erf within 2 ulp (erf: or 1e-7 absolute), Φ and GELU
//! within 6 ulp relative down to the far left tail (where the erf form lost everything to
//! cancellation), GELU's derivative within 8 ulp or 2e-7 absolute where it crosses 0. NaN
//! propagates, ±inf and overflow/underflow give libm's limits, subnormal results of exp are
//! rounded once.
//!
//! The polynomials are Cephes' single-precision minimax coefficients (exp, ln, and tanh below
//! |x| = 0.625); erf's and the Gaussian tail's were fitted for kiln (see `erf`, `TAIL`).

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5·2^23: adding and subtracting it rounds an f32 of magnitude below 2^22 to an integer.
const ROUND: f32 = 12_582_912.0;

/// a·b + c, rounded once where the build's baseline has FMA (`.cargo/config.toml`: x86-64-v3),
/// else a multiply and an add. Decided at compile time for the whole crate, so that every loop
/// and every scalar call computes the same bits.
#[inline(always)]
fn fma(a: f32, b: f32, c: f32) -> f32 {
    if cfg!(target_feature = "fma") { a.mul_add(b, c) } else { a * b + c }
}

/// The polynomial c[0] + c[1]·x + ... by Horner's rule, one `fma` per coefficient.
#[inline(always)]
fn poly(x: f32, c: &[f32]) -> f32 {
    let (last, rest) = c.split_last().expect("a polynomial has a coefficient");
    rest.iter().rev().fold(*last, |acc, &k| fma(acc, x, k))
}

/// 2^n for an integer n in [-75, 64] (a normal f32); other n give some float (never a panic).
#[inline(always)]
fn pow2(n: i32) -> f32 {
    f32::from_bits((n.wrapping_add(127) as u32) << 23)
}

/// e^x.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    // Beyond these, the result is inf or 0 and the reduction below still gives it. (clamp keeps
    // NaN, and a NaN stays NaN through every step below.)
    exp_reduced(x.clamp(-104.0, 89.0), None)
}

/// e^(c - n·ln 2 + lo) for the integer n nearest c·log2(e): the remainder in two parts of ln 2
/// (exact with FMA), then Cephes' polynomial; `exp_reduced` and `exp_nonpositive_split` scale
/// it by 2^n.
#[inline(always)]
fn exp_of_remainder(c: f32, n: f32, lo: Option<f32>) -> f32 {
    let r = fma(-n, LN2_LO, fma(-n, LN2_HI, c));
    let r = match lo {
        Some(lo) => r + lo,
        None => r,
    };
    let z = r * r;
    let p = poly(r, &[5e-1, 1.666_666_5e-1, 4.166_579_6e-2, 8.333_452e-3, 1.398_199_9e-3, 1.987_569_1e-4]);
    fma(p, z, r) + 1.0
}

/// e^(c + lo) for c in [-185, 89] (the two factors of 2^n stay normal) or NaN, and lo below
/// half an ulp of c (c's rounding error, added after the range reduction; `None` adds nothing,
/// not even a +0.0, on `exp`'s path): `exp` without its clamp, for callers whose argument is in
/// range by construction.
#[inline(always)]
fn exp_reduced(c: f32, lo: Option<f32>) -> f32 {
    let t = fma(c, LOG2E, ROUND);
    let n = t - ROUND;
    // n as an integer, read from t's mantissa (t = 1.5·2^23 + n): no float-to-int conversion,
    // whose saturating form does not vectorise. (A NaN gives garbage here, and NaN below.)
    let ni = (t.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000;
    let e = exp_of_remainder(c, n, lo);
    // 2^n in two normal factors, so that a subnormal result is rounded once, at the end.
    let half = ni >> 1;
    e * pow2(half) * pow2(ni - half)
}

/// e^x for x <= 0 (or NaN): `exp`'s bits, with fewer instructions, for the arguments that
/// sigmoid, softmax and the Gaussian tails pass (always <= 0). Below -104, e^x is 0 in f32 (under
/// half the least subnormal), so one bound suffices; and 2^n is built from the rounded t's own
/// bits: t = 1.5·2^23 + 25 + n, whose bits shifted left by 23 are (n + 25)·2^23 (1.5·2^23's
/// own low 9 bits are 0), so 2^(n + 25) with n + 25 in [-125, 25] is an exponent field added to
/// 127, and e·2^(n + 25) is normal and exact; the multiply by 2^-25 then rounds once, as `exp`'s
/// second factor does. The rounding to n is the same as `exp`'s (the constants differ by an
/// integer, and c·log2(e) has no halfway fraction for |c| <= 104). The same bits as `exp` on every
/// argument (tests below); a NaN stays NaN (e is NaN and the multiplies keep it). Five vector
/// instructions fewer than `exp` (the upper bound, the mantissa mask, the split of n and the
/// second factor): sigmoid 0.20 -> 0.17 ns an element (a scratch loop over 512 floats in L1,
/// best of 20 runs of 2,000 passes, one core of the AMD EPYC build machine with AVX-512).
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    exp_nonpositive_split(x, None)
}

/// `exp_nonpositive` of c + lo, lo below half an ulp of c (`exp_reduced`'s `lo`).
#[inline(always)]
fn exp_nonpositive_split(c: f32, lo: Option<f32>) -> f32 {
    const SHIFTED: f32 = ROUND + 25.0;
    const TWO_TO_MINUS_25: f32 = 2.980_232_2e-8;
    // (A comparison, not f32::max, which would turn NaN into -104.)
    let c = if c < -104.0 { -104.0 } else { c };
    let t = fma(c, LOG2E, SHIFTED);
    let n = t - SHIFTED;
    let e = exp_of_remainder(c, n, lo);
    let scale = f32::from_bits((t.to_bits() << 23).wrapping_add(127 << 23));
    e * scale * TWO_TO_MINUS_25
}

/// ln x.
#[inline(always)]
pub(crate) fn ln(x: f32) -> f32 {
    const SQRT_HALF: f32 = std::f32::consts::FRAC_1_SQRT_2;
    // Subnormals scaled up by 2^24 first.
    let sub = x < f32::MIN_POSITIVE;
    let xs = if sub { x * 16_777_216.0 } else { x };
    let bits = xs.to_bits();
    let mut e = ((bits >> 23) & 0xff) as i32 - 126 - if sub { 24 } else { 0 };
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f00_0000); // [0.5, 1)
    // m in [sqrt(1/2), sqrt(2)): m - 1 small.
    let low = m < SQRT_HALF;
    e -= low as i32;
    m = if low { m + m } else { m } - 1.0;
    let z = m * m;
    let p = poly(
        m,
        &[
            3.333_333e-1,
            -2.499_999_4e-1,
            2.000_071_4e-1,
            -1.666_805_8e-1,
            1.424_932_3e-1,
            -1.242_014_1e-1,
            1.167_699_9e-1,
            -1.151_461e-1,
            7.037_683_6e-2,
        ],
    ) * m
        * z;
    let ef = e as f32;
    let y = fma(ef, LN2_HI, fma(-0.5, z, fma(ef, LN2_LO, p)) + m);
    // ln 0 = -inf, ln of a negative = NaN, ln inf = inf, NaN stays.
    let y = if x == f32::INFINITY { x } else { y };
    let y = if x < 0.0 || x.is_nan() { f32::NAN } else { y };
    if x == 0.0 { f32::NEG_INFINITY } else { y }
}

/// 1 / (1 + e^-x) without overflow: e^-|x| never exceeds 1. One division, of the numerator
/// chosen first (1, or e^x for x < 0): choosing between two quotients made the vectorised loop
/// compute both, and a division costs what the rest of the function does together. The same
/// bits; EfficientNet-B0's forward pass, whose SiLUs took 2.8 of its 16.3 ms (measured by
/// replacing sigmoid with x/2), 16.6-17.1 -> 16.4-16.7 ms (one core of the 2-core AMD EPYC,
/// `kiln run --bench 20`, four interleaved rounds).
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    let e = exp_nonpositive(-x.abs());
    let d = 1.0 + e;
    let numerator = if x >= 0.0 { 1.0 } else { e };
    numerator / d
}

/// tanh x: an odd polynomial below |x| = 0.625, 1 - 2 / (e^2|x| + 1) above.
#[inline(always)]
pub(crate) fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let small = fma(
        poly(z, &[-3.333_328e-1, 1.333_144_2e-1, -5.373_971_6e-2, 2.063_909e-2, -5.704_988_7e-3]) * z,
        x,
        x,
    );
    let large = (1.0 - 2.0 / (exp(a + a) + 1.0)).copysign(x);
    let y = if a < 0.625 { small } else { large };
    // tanh(±0) = ±0: the polynomial's sum would make -0 into +0.
    if a == 0.0 { x } else { y }
}

/// erf x, branch-free (so that loops over slices vectorise): x·P(x²) below |x| = 1, and
/// 1 - e^(-x²)·Q(1/x) from 1 to 4, beyond which erf is ±1 in f32. The coefficients were fitted
/// for kiln (weighted least squares on Chebyshev nodes against the double-precision erf:
/// relative error 1.4e-9 and 1.7e-8 in exact arithmetic); within 2 ulp or 1e-7 of libm's erff.
#[inline(always)]
pub(crate) fn erf(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let small = x * poly(
        z,
        &[
            std::f32::consts::FRAC_2_SQRT_PI,
            -3.761_263e-1,
            1.128_361_2e-1,
            -2.685_480_7e-2,
            5.190_050_6e-3,
            -8.024_330_5e-4,
            7.898_137e-5,
        ],
    );
    let b = a.min(4.0);
    let t = 1.0 / b;
    let q = poly(
        t,
        &[
            1.146_693e-4,
            5.618_857e-1,
            1.960_391_5e-2,
            -3.716_936e-1,
            2.187_654_8e-1,
            2.593_266e-1,
            -5.615_039e-1,
            4.562_14e-1,
            -1.871_951_5e-1,
            3.206_583_6e-2,
        ],
    );
    let large = fma(-exp_nonpositive(-(b * b)), q, 1.0);
    let large = if x < 0.0 { -large } else { large };
    if a < 1.0 {
        small
    } else if x.is_nan() {
        x
    } else {
        large
    }
}

/// p/√2 for the Gaussian tail's variable t = 1 / (1 + p·z), z = |x|/√2, p = 0.4.
const TAIL_P: f32 = 0.4 * std::f32::consts::FRAC_1_SQRT_2;
/// P(t) ≈ e^(z²)·erfc(z) / (2t) over t in (0, 1] (all z >= 0): fitted for kiln by Lawson's
/// iteration on 6,000 Chebyshev nodes against SciPy's `erfcx` in double precision, relative
/// error 6.2e-9 in exact arithmetic (the fit's coefficients halved, exactly).
const TAIL: [f32; 11] = [
    0.112_837_92,
    0.112_837_93,
    0.103_806_87,
    0.085_869_64,
    0.059_504_166,
    0.041_958_127,
    -0.023_447_402,
    0.068_780_42,
    -0.117_763_38,
    0.070_223_235,
    -0.014_607_532,
];

/// Φ(-|x|) = erfc(|x|/√2)/2 and e^(-x²/2), for |x| up to 16 (beyond, both are 0 in f32): one
/// exp, one division and an 11-term polynomial, no branch; NaN stays NaN. x² is split into two
/// floats (exact with FMA) so that e^(-x²/2) is not off by x²'s rounding, which grows with x².
#[inline(always)]
fn gauss_tail(x: f32) -> (f32, f32) {
    let a = x.abs();
    // (Not f32::min, which would turn NaN into 16.)
    let a = if a > 16.0 { 16.0 } else { a };
    let t = 1.0 / fma(TAIL_P, a, 1.0);
    let h = a * a;
    let l = fma(a, a, -h);
    let e = exp_nonpositive_split(-0.5 * h, Some(-0.5 * l));
    (e * t * poly(t, &TAIL), e)
}

/// Φ(x), the standard normal CDF, as `gelu_derivative` computes it: Φ(-|x|) from the tail, 1 -
/// that for x >= 0. Unlike (1 + erf(x/√2))/2, the left tail keeps its relative precision (a few
/// ulp down to Φ(-13), where the erf form is off by 17% at Φ(-5) from cancellation).
#[cfg(test)]
fn normal_cdf(x: f32) -> f32 {
    cdf_from_tail(x, gauss_tail(x).0)
}

/// Φ(x) from c = Φ(-|x|).
#[inline(always)]
fn cdf_from_tail(x: f32, c: f32) -> f32 {
    if x < 0.0 { c } else { 1.0 - c }
}

/// Exact GELU, x·Φ(x) = max(x, 0) - |x|·Φ(-|x|) (for x >= 0, x·(1 - Φ(-x)); below, x·Φ(x)):
/// no select between the tails and one fused step. |x| is clamped where Φ(-|x|) is 0 anyway, so
/// that gelu(inf) = inf and gelu(-inf) = 0.
#[inline(always)]
pub(crate) fn gelu(x: f32) -> f32 {
    let (c, _) = gauss_tail(x);
    let positive = if x > 0.0 { x } else { 0.0 };
    fma(-x.clamp(-16.0, 16.0).abs(), c, positive)
}

/// d/dx x·Φ(x) = Φ(x) + x·φ(x), φ(x) = e^(-x²/2)/√(2π) from the same exp as Φ. (x is clamped
/// where φ is 0 anyway, so that ±inf gives 1 and 0.)
#[inline(always)]
pub(crate) fn gelu_derivative(x: f32) -> f32 {
    const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
    let (c, e) = gauss_tail(x);
    fma(x.clamp(-16.0, 16.0) * e, FRAC_1_SQRT_2PI, cdf_from_tail(x, c))
}

/// √(2/π)·2 and √(2/π)·2·0.044715: 2u = x·(A + B·x²) for GELU's tanh form, u = √(2/π)·(x +
/// 0.044715·x³).
pub(crate) const GELU_TANH_A: f32 = 1.595_769_2;
pub(crate) const GELU_TANH_B: f32 = 0.071_354_814;

/// e^(-|2u|) and 2u for GELU's tanh form at x, x clamped to ±20 (beyond, the sigmoid of 2u is
/// 0 or 1 in f32 and x³ would overflow on the way).
#[inline(always)]
fn gelu_tanh_parts(x: f32) -> (f32, f32) {
    // (f32::clamp keeps NaN.)
    let c = x.clamp(-20.0, 20.0);
    let u2 = c * fma(c * c, GELU_TANH_B, GELU_TANH_A);
    (exp_nonpositive(-u2.abs()), u2)
}

/// GELU's tanh approximation, x·(1 + tanh(u))/2 = x·σ(2u), u = √(2/π)·(x + 0.044715·x³): the
/// sigmoid form needs one exp and no subtraction, so the left tail keeps its relative precision
/// (PyTorch's (1 + tanh u) cancels there). gelu_tanh(inf) = inf, gelu_tanh(-inf) = -0.
#[inline(always)]
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    let (e, u2) = gelu_tanh_parts(x);
    let d = 1.0 + e;
    let s = if u2 >= 0.0 { 1.0 / d } else { e / d };
    // x·σ(2u); for x < -20, σ is 0 and the clamped x keeps -inf from making a NaN.
    let xc = if x < -20.0 { -20.0 } else { x };
    xc * s
}

/// d/dx x·σ(2u) = σ(2u) + x·σ(2u)·σ(-2u)·(2u)', (2u)' = A + 3B·x², with σ(2u)·σ(-2u) =
/// e/(1 + e)² from the same exp.
#[inline(always)]
pub(crate) fn gelu_tanh_derivative(x: f32) -> f32 {
    let (e, u2) = gelu_tanh_parts(x);
    let d = 1.0 + e;
    let r = 1.0 / d;
    let s = if u2 >= 0.0 { r } else { e * r };
    let c = x.clamp(-20.0, 20.0);
    let slope = fma(3.0 * GELU_TANH_B, c * c, GELU_TANH_A);
    fma(c * slope, e * r * r, s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between two finite f32 of the same sign, or 0 for
    /// equal values (NaN = NaN).
    fn ulps(a: f32, b: f32) -> u32 {
        if a == b || (a.is_nan() && b.is_nan()) {
            return 0;
        }
        if a.is_nan() || b.is_nan() || a.is_infinite() || b.is_infinite() || a.signum() != b.signum() {
            return u32::MAX;
        }
        a.to_bits().abs_diff(b.to_bits())
    }

    /// Every f32 in [lo, hi) stepped so that about `n` values are tried, plus both ends.
    fn sweep(lo: f32, hi: f32, n: usize) -> impl Iterator<Item = f32> {
        (0..=n).map(move |i| lo + (hi - lo) * i as f32 / n as f32)
    }

    fn check(
        name: &str,
        f: fn(f32) -> f32,
        reference: fn(f32) -> f32,
        xs: impl Iterator<Item = f32>,
        ulp: u32,
        abs: f32,
    ) {
        let mut worst = (0u32, 0.0f32);
        for x in xs {
            let (got, want) = (f(x), reference(x));
            let u = ulps(got, want);
            if u > ulp && (got - want).abs() > abs {
                panic!("{name}({x:e}) = {got:e}, libm {want:e}: {u} ulp");
            }
            if u > worst.0 && u != u32::MAX {
                worst = (u, x);
            }
        }
        eprintln!("{name}: worst {} ulp at {:e}", worst.0, worst.1);
    }

    #[test]
    fn exp_matches_libm() {
        check("exp", exp, f32::exp, sweep(-104.0, 89.0, 1_000_000), 2, 0.0);
        check("exp", exp, f32::exp, sweep(-1.0, 1.0, 100_000), 2, 0.0);
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(-200.0), 0.0);
        assert!(exp(f32::NAN).is_nan());
    }

    /// `exp_nonpositive` is `exp`'s bits on every argument <= 0 (a stride through all of their
    /// bit patterns, subnormal results and the cut at -104 included), -0, -inf and NaNs of any
    /// payload; with a low part, it is `exp_reduced`'s.
    #[test]
    fn exp_nonpositive_is_exp_bitwise() {
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        let negatives = (0x8000_0000u32..=0xff80_0000).step_by(331).map(f32::from_bits);
        let edges =
            [-0.0, 0.0, -104.0, -103.97, -103.9, -87.34, -87.33, f32::NEG_INFINITY, -f32::MIN_POSITIVE];
        for x in negatives.chain(sweep(-110.0, 0.0, 200_000)).chain(edges) {
            assert!(
                same(exp_nonpositive(x), exp(x)),
                "exp_nonpositive({x:e}) = {:e}, exp {:e}",
                exp_nonpositive(x),
                exp(x)
            );
        }
        for bits in [0x7fc0_0000u32, 0x7fc0_01ff, 0x7f80_0001, 0xffc0_0123, 0xff80_00ff, 0x7fff_ffff] {
            assert!(exp_nonpositive(f32::from_bits(bits)).is_nan(), "NaN {bits:#x}");
        }
        for c in sweep(-104.0, 0.0, 100_000) {
            let lo = c * 2.9e-8;
            assert!(same(exp_nonpositive_split(c, Some(lo)), exp_reduced(c, Some(lo))), "at {c:e} + {lo:e}");
        }
        for c in sweep(-128.0, -104.0, 10_000) {
            assert_eq!(exp_nonpositive_split(c, Some(c * 2.9e-8)), 0.0);
        }
    }

    #[test]
    fn ln_matches_libm() {
        check("ln", ln, f32::ln, sweep(1e-3, 10.0, 1_000_000), 2, 0.0);
        check("ln", ln, f32::ln, sweep(0.5, 2.0, 200_000), 2, 0.0);
        check("ln", ln, f32::ln, (0..2000).map(|i| f32::from_bits(1 + i * 4096)), 2, 0.0);
        check("ln", ln, f32::ln, (1..255u32).map(|e| f32::from_bits((e << 23) | 0x12_3456)), 2, 0.0);
        assert_eq!(ln(1.0), 0.0);
        assert_eq!(ln(0.0), f32::NEG_INFINITY);
        assert_eq!(ln(f32::INFINITY), f32::INFINITY);
        assert!(ln(-1.0).is_nan() && ln(f32::NAN).is_nan());
    }

    #[test]
    fn sigmoid_and_tanh_match_libm() {
        let sig = |x: f32| {
            if x >= 0.0 {
                1.0 / (1.0 + (-x).exp())
            } else {
                let e = x.exp();
                e / (1.0 + e)
            }
        };
        check("sigmoid", sigmoid, sig, sweep(-100.0, 100.0, 1_000_000), 2, 0.0);
        check("tanh", tanh, f32::tanh, sweep(-10.0, 10.0, 1_000_000), 2, 0.0);
        check("tanh", tanh, f32::tanh, sweep(-0.7, 0.7, 200_000), 2, 0.0);
        for f in [sigmoid, tanh] {
            assert!(f(f32::NAN).is_nan());
        }
        assert_eq!((tanh(f32::INFINITY), tanh(f32::NEG_INFINITY)), (1.0, -1.0));
        assert_eq!((sigmoid(f32::INFINITY), sigmoid(f32::NEG_INFINITY)), (1.0, 0.0));
        assert_eq!(tanh(-0.0).to_bits(), (-0.0f32).to_bits());
    }

    /// Φ, GELU and its derivative against double precision (libm's erfc), rounded to f32.
    #[test]
    fn gelu_matches_double_precision() {
        let cdf = |x: f32| (0.5 * libm::erfc(-(x as f64) / std::f64::consts::SQRT_2)) as f32;
        let gelu_ref = |x: f32| (x as f64 * 0.5 * libm::erfc(-(x as f64) / std::f64::consts::SQRT_2)) as f32;
        let grad_ref = |x: f32| {
            let x = x as f64;
            let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
            (0.5 * libm::erfc(-x / std::f64::consts::SQRT_2) + x * pdf) as f32
        };
        // To 8 ulp (relative) down the left tail to Φ(-13) = 6e-39 (the erf form, (1 + erf(x/√2))/2,
        // is off by 17% at x = -5) and near 0 (measured: worst 6 ulp).
        check("normal_cdf", normal_cdf, cdf, sweep(-13.0, 8.0, 1_000_000), 8, 0.0);
        check("gelu", gelu, gelu_ref, sweep(-13.0, 8.0, 1_000_000), 8, 0.0);
        check("gelu", gelu, gelu_ref, sweep(-1e-3, 1e-3, 100_000), 8, 0.0);
        // The derivative cancels (Φ + xφ crosses 0 near x = -0.75): absolute there.
        check("gelu_derivative", gelu_derivative, grad_ref, sweep(-13.0, 8.0, 1_000_000), 8, 2e-7);
        assert!(
            normal_cdf(f32::NAN).is_nan() && gelu(f32::NAN).is_nan() && gelu_derivative(f32::NAN).is_nan()
        );
        assert_eq!((normal_cdf(f32::INFINITY), normal_cdf(f32::NEG_INFINITY)), (1.0, 0.0));
        assert_eq!(
            (gelu(f32::INFINITY), gelu(f32::NEG_INFINITY), gelu(-20.0), gelu(0.0)),
            (f32::INFINITY, 0.0, 0.0, 0.0)
        );
        assert_eq!((gelu_derivative(f32::INFINITY), gelu_derivative(f32::NEG_INFINITY)), (1.0, 0.0));
    }

    /// GELU's tanh form and its derivative against double precision.
    #[test]
    fn gelu_tanh_matches_double_precision() {
        fn u(x: f64) -> f64 {
            (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)
        }
        // x·σ(2u) in double precision (the same function as 0.5·x·(1 + tanh u), without its
        // cancellation in the left tail).
        let reference = |x: f32| {
            let x = x as f64;
            (x / (1.0 + (-2.0 * u(x)).exp())) as f32
        };
        let grad_ref = |x: f32| {
            let x = x as f64;
            let s = 1.0 / (1.0 + (-2.0 * u(x)).exp());
            let k = (2.0 / std::f64::consts::PI).sqrt();
            (s + x * s * (1.0 - s) * 2.0 * k * (1.0 + 3.0 * 0.044715 * x * x)) as f32
        };
        check("gelu_tanh", gelu_tanh, reference, sweep(-2.0, 10.0, 1_000_000), 8, 0.0);
        // Further left the value is about x·e^(2u), and 2u's rounding in f32 (its constants'
        // own included), a few ulp of |2u| (87 at x = -10), is its relative error.
        for x in sweep(-10.0, -2.0, 100_000) {
            let (got, want) = (gelu_tanh(x), reference(x));
            let bound = 4.0 * f32::EPSILON * (2.0 * u(x as f64)).abs() as f32;
            assert!((got - want).abs() <= bound * want.abs(), "gelu_tanh({x:e}) = {got:e}, want {want:e}");
        }
        check("gelu_tanh", gelu_tanh, reference, sweep(-1e-3, 1e-3, 100_000), 8, 0.0);
        // The derivative crosses 0 near x = -0.75: absolute there.
        check("gelu_tanh_derivative", gelu_tanh_derivative, grad_ref, sweep(-10.0, 10.0, 1_000_000), 8, 2e-7);
        // Against the textbook form, 0.5·x·(1 + tanh u), where that form does not cancel.
        for x in sweep(-3.0, 8.0, 10_000) {
            let textbook = (0.5 * x as f64 * (1.0 + u(x as f64).tanh())) as f32;
            assert!((gelu_tanh(x) - textbook).abs() <= 2e-7 * textbook.abs().max(1.0), "{x}");
        }
        assert!(gelu_tanh(f32::NAN).is_nan() && gelu_tanh_derivative(f32::NAN).is_nan());
        assert_eq!(
            (gelu_tanh(f32::INFINITY), gelu_tanh(f32::NEG_INFINITY), gelu_tanh(0.0)),
            (f32::INFINITY, 0.0, 0.0)
        );
        assert_eq!(
            (gelu_tanh_derivative(f32::INFINITY), gelu_tanh_derivative(f32::NEG_INFINITY)),
            (1.0, 0.0)
        );
    }

    #[test]
    fn erf_matches_libm() {
        check("erf", erf, libm::erff, sweep(-6.0, 6.0, 1_000_000), 2, 1e-7);
        check("erf", erf, libm::erff, sweep(-1e-3, 1e-3, 100_000), 2, 0.0);
        assert!(erf(f32::NAN).is_nan());
        assert_eq!((erf(f32::INFINITY), erf(f32::NEG_INFINITY)), (1.0, -1.0));
    }
}
