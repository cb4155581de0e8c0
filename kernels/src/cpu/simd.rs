//! The widest vector instructions the CPU has, chosen once at run time, and `multiversion!`,
//! which compiles a kernel's loop once per width and calls the widest.
//!
//! Why: the build's baseline is x86-64-v3 (AVX2 and FMA, `.cargo/config.toml`), which every
//! x86-64 machine kiln targets has; AVX-512 is on many (Intel Skylake-SP and later servers, AMD
//! Zen 4 and later) but not all, so it is chosen at run time. The loops are plain scalar Rust that
//! the compiler vectorises; compiled with AVX-512 enabled they run 16 lanes a vector instead of 8
//! and have 32 vector registers instead of 16, which the transcendentals' polynomials use. The
//! same IEEE operations in the same order (no fast-math: the compiler may not reassociate), so
//! each width computes the same bits, which `tests` below check for every unary op and GELU's
//! gradient.
//!
//! Measured (2026-11-27, the 2-core AMD EPYC build machine, which has AVX-512; 1M floats, 2
//! threads, medians of 31, scratch benchmark): exact GELU 0.60-0.66 ms with AVX2 against
//! 0.35-0.40 ms with AVX-512. Only elementwise kernels, fused programs and softmax rows are
//! compiled twice: the GEMM crate chooses its own kernels at run time, AVX-512 ones among them
//! (its `x86-v4` feature, `matmul`; on this machine, 2026-11-29, `examples/profile_cpu.rs`
//! training steps with them against AVX2 alone: mlp 9.1 against 12.1-12.5 ms, transformer 31.7
//! against 38.2, cnn 36.6 against 53.0).
//!
//! `KILN_SIMD=avx2` (or `baseline`) caps the width, to compare them.

use std::sync::OnceLock;

/// A vector width the kernels are compiled for.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) enum Width {
    /// The build's baseline (x86-64-v3 on x86-64: AVX2 and FMA).
    Baseline,
    /// AVX2 and FMA, on a build whose baseline lacks them (a build for another target CPU).
    Avx2,
    /// AVX-512 (F, VL, BW, DQ).
    Avx512,
}

impl Width {
    /// The widths this CPU can run, narrowest first.
    pub(crate) fn available() -> Vec<Width> {
        [Width::Baseline, Width::Avx2, Width::Avx512].into_iter().filter(|w| w.supported()).collect()
    }

    fn supported(self) -> bool {
        match self {
            Width::Baseline => true,
            #[cfg(target_arch = "x86_64")]
            Width::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Width::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512dq")
                    && Width::Avx2.supported()
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// The widest width this CPU supports, capped by `KILN_SIMD` (`baseline`, `avx2`; anything else,
/// or unset, caps nothing). Decided on the first call.
pub(crate) fn width() -> Width {
    static WIDTH: OnceLock<Width> = OnceLock::new();
    *WIDTH.get_or_init(|| {
        let cap = match std::env::var("KILN_SIMD").as_deref() {
            Ok("baseline") => Width::Baseline,
            Ok("avx2") => Width::Avx2,
            _ => Width::Avx512,
        };
        Width::available().into_iter().filter(|&w| w <= cap).max().unwrap_or(Width::Baseline)
    })
}

/// `multiversion! { unsafe fn name(args) => inner; }` defines `name(args)`, which calls `inner`
/// compiled for `simd::width()`, and `name_at(width, args)`, which calls it compiled for the given
/// width (tests compare them). `inner` must be `#[inline(always)]` (with everything it calls), so
/// that each copy is compiled, and vectorised, for its width; it may be a safe function.
///
/// # Safety (of the functions defined)
/// `inner`'s contract; `name_at` also requires the CPU to support `width` (`Width::available`).
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis unsafe fn $name:ident / $at:ident($($arg:ident: $ty:ty),* $(,)?) => $inner:path;) => {
        $(#[$meta])*
        ///
        /// # Safety
        /// As the function it calls.
        #[inline(always)]
        $vis unsafe fn $name($($arg: $ty),*) {
            // SAFETY: forwarded contract; `width()` is supported by this CPU.
            unsafe { $at($crate::cpu::simd::width(), $($arg),*) }
        }

        /// As the function without `_at`, compiled for `width`.
        ///
        /// # Safety
        /// As the function it calls, and the CPU supports `width`.
        #[inline(always)]
        #[allow(clippy::too_many_arguments, unused_unsafe)]
        $vis unsafe fn $at(width: $crate::cpu::simd::Width, $($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
                #[allow(clippy::too_many_arguments, unused_unsafe)]
                unsafe fn avx512($($arg: $ty),*) {
                    // SAFETY: forwarded contract.
                    unsafe { $inner($($arg),*) }
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments, unused_unsafe)]
                unsafe fn avx2($($arg: $ty),*) {
                    // SAFETY: forwarded contract.
                    unsafe { $inner($($arg),*) }
                }
                match width {
                    // SAFETY: forwarded contract; the caller checked that the CPU has AVX-512.
                    $crate::cpu::simd::Width::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above, AVX2 and FMA.
                    $crate::cpu::simd::Width::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::cpu::simd::Width::Baseline => {}
                }
            }
            let _ = width;
            // SAFETY: forwarded contract.
            unsafe { $inner($($arg),*) }
        }
    };
}
pub(crate) use multiversion;
