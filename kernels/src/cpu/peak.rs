//! The fused multiply-add peak of one core, measured: what a product kernel's speed is held
//! against (`cargo bench --bench products`).
//!
//! A loop of independent FMA chains on the widest vectors the CPU runs (`simd::width`: AVX-512
//! or AVX2), enough of them to cover the instruction's latency on both FMA ports of every
//! x86-64 core kiln meets (4 cycles, 2 ports: 8 in flight; 16 chains with AVX-512, 12 with
//! AVX2, whose 16 registers hold no more beside the two constants), timed over a fixed count of
//! iterations, best of several tries. The vector loops keep everything in registers, so the
//! figure is the arithmetic bound a GEMM's inner loop can reach, at the clock the core runs
//! under that load (turbo, or AVX-512's lower clock where a core has one). Without AVX2 a
//! scalar loop stands in, its chains kept from folding by `black_box`.

use super::simd::{Width, width};

/// One core's measured FMA throughput.
#[derive(Clone, Copy, Debug)]
pub struct FmaPeak {
    /// The instruction set timed: "avx512", "avx2" or "scalar".
    pub isa: &'static str,
    /// f32 lanes per FMA instruction.
    pub lanes: usize,
    /// f32 multiply-adds per second on one core.
    pub fma_per_second: f64,
}

/// Independent FMA chains per loop iteration.
const CHAINS: usize = 16;

/// Measures one core's FMA peak on the widest vectors the CPU runs (about 0.1 s).
pub fn measure() -> FmaPeak {
    let (isa, lanes) = match width() {
        Width::Avx512 => ("avx512", 16),
        _ if avx2() => ("avx2", 8),
        _ => ("scalar", 1),
    };
    // About 16 ms a try at 130 GFMA/s: long enough for the core to reach the clock it holds
    // under a product.
    let iterations: u64 = 1 << 23;
    let mut best = f64::MAX;
    for _ in 0..7 {
        let start = std::time::Instant::now();
        let sum = chains(isa, iterations);
        best = best.min(start.elapsed().as_secs_f64());
        std::hint::black_box(sum);
    }
    let fmas = iterations as f64 * (CHAINS * lanes) as f64;
    FmaPeak { isa, lanes, fma_per_second: fmas / best }
}

/// Whether the CPU runs AVX2 and FMA.
fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `iterations` rounds of `CHAINS` FMAs on `isa`'s vectors; a sum of the chains, so that none
/// is optimised away.
fn chains(isa: &str, iterations: u64) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if isa == "avx512" {
            // SAFETY: `width()` found AVX-512 F on this CPU.
            return unsafe { chains_avx512(iterations) };
        }
        if isa == "avx2" {
            // SAFETY: `avx2()` found AVX2 and FMA on this CPU.
            return unsafe { chains_avx2(iterations) };
        }
    }
    let mut c = [0f32; CHAINS];
    for _ in 0..iterations {
        for x in &mut c {
            *x = std::hint::black_box(*x).mul_add(0.999_999, 1e-6);
        }
    }
    c.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn chains_avx512(iterations: u64) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-6));
    let mut c = [_mm512_setzero_ps(); CHAINS];
    for _ in 0..iterations {
        for x in &mut c {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    let s = c.iter().fold(_mm512_setzero_ps(), |s, &x| _mm512_add_ps(s, x));
    _mm512_reduce_add_ps(s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn chains_avx2(iterations: u64) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-6));
    // 12 chains: with the two constants they fill AVX2's 16 registers without spilling.
    let mut c = [_mm256_setzero_ps(); 12];
    for _ in 0..iterations * CHAINS as u64 / 12 {
        for x in &mut c {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let s = c.iter().fold(_mm256_setzero_ps(), |s, &x| _mm256_add_ps(s, x));
    let mut out = [0f32; 8];
    // SAFETY: `out` holds the 8 floats an unaligned store writes.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
    out.iter().sum()
}

#[cfg(test)]
mod tests {
    /// The measured peak is positive and finite, on vectors this CPU runs.
    #[test]
    fn the_peak_is_a_positive_rate() {
        let p = super::measure();
        assert!(p.fma_per_second.is_finite() && p.fma_per_second > 1e8, "{p:?}");
        assert!([1, 8, 16].contains(&p.lanes), "{p:?}");
    }
}
