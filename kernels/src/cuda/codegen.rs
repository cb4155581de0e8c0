//! Text helpers shared by the CUDA C generators: an indenting source builder, exact float
//! literals, the index type, grid sizes, and strided loop nests turned into index expressions.
//!
//! Every generator bakes shapes and attributes into the source as literals, so that NVRTC sees
//! constant extents and strides: a division by a constant becomes a multiply-shift, loops over
//! tile sizes unroll, and size-1 axes vanish. The price is one compilation per shape, which the
//! backend caches by source text.

pub(crate) use super::half::Elems;
pub(crate) use crate::strides::{broadcast_strides, contiguous_strides};
use kiln_compiler::ir::Shape;
use std::fmt::Write;

/// Threads per block of the one-thread-per-element kernels.
pub(crate) const BLOCK: u32 = 256;
/// Most blocks a grid-stride kernel launches: 65536 blocks of 256 threads are 128 waves of the
/// H200's 132 SMs, beyond which each thread simply takes several elements.
pub(crate) const MAX_BLOCKS: usize = 1 << 16;
/// Largest element count whose indices (and index + grid size) stay in `int`.
pub(crate) const INT_LIMIT: usize = 1 << 30;

/// A CUDA C source under construction. `line` indents automatically: a line ending in `{` opens
/// a level and a line starting with `}` closes one, so generated sources read like written ones.
#[derive(Default)]
pub(crate) struct Code {
    text: String,
    depth: usize,
}

impl Code {
    pub(crate) fn new() -> Code {
        Code::default()
    }

    /// Appends one or more lines (split at '\n', each trimmed and re-indented).
    pub(crate) fn line(&mut self, s: impl AsRef<str>) -> &mut Code {
        for l in s.as_ref().lines() {
            let t = l.trim();
            if t.is_empty() {
                self.text.push('\n');
                continue;
            }
            if t.starts_with('}') {
                self.depth = self.depth.saturating_sub(1);
            }
            for _ in 0..self.depth {
                self.text.push_str("    ");
            }
            self.text.push_str(t);
            self.text.push('\n');
            if t.ends_with('{') {
                self.depth += 1;
            }
        }
        self
    }

    pub(crate) fn blank(&mut self) -> &mut Code {
        self.text.push('\n');
        self
    }

    pub(crate) fn finish(self) -> String {
        self.text
    }
}

/// An f32 constant that NVRTC reads back bit for bit: small integers as `3.0f`, other finite
/// values as C++17 hexadecimal literals (exact, no decimal rounding) followed by a comment with
/// the shortest decimal, non-finite values through their bits.
pub(crate) fn flt(v: f32) -> String {
    if !v.is_finite() {
        return format!("__int_as_float(0x{:08x})", v.to_bits());
    }
    if v == 0.0 {
        return if v.is_sign_negative() { "(-0.0f)".into() } else { "0.0f".into() };
    }
    if v.fract() == 0.0 && v.abs() < 16_777_216.0 {
        let s = format!("{:.1}f", v.abs());
        return if v < 0.0 { format!("(-{s})") } else { s };
    }
    let bits = v.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = (bits & 0x7f_ffff) << 1; // 24 bits: 6 hex digits
    let (lead, e) = if exp == 0 { (0, -126) } else { (1, exp - 127) };
    let mut digits = format!("{man:06x}");
    while digits.ends_with('0') {
        digits.pop();
    }
    let frac = if digits.is_empty() { String::new() } else { format!(".{digits}") };
    let body = format!("0x{lead}{frac}p{e}f /* {:?} */", v.abs());
    if v < 0.0 { format!("(-{body})") } else { body }
}

/// An f64 constant, exact (hexadecimal), for the few computations the CPU does in f64.
pub(crate) fn dbl(v: f64) -> String {
    if !v.is_finite() {
        return format!("__longlong_as_double(0x{:016x}LL)", v.to_bits());
    }
    if v == 0.0 {
        return if v.is_sign_negative() { "(-0.0)".into() } else { "0.0".into() };
    }
    let bits = v.to_bits();
    let exp = ((bits >> 52) & 0x7ff) as i64;
    let man = bits & 0xf_ffff_ffff_ffff; // 52 bits: 13 hex digits
    let (lead, e) = if exp == 0 { (0, -1022) } else { (1, exp - 1023) };
    let mut digits = format!("{man:013x}");
    while digits.ends_with('0') {
        digits.pop();
    }
    let frac = if digits.is_empty() { String::new() } else { format!(".{digits}") };
    let body = format!("0x{lead}{frac}p{e}");
    if v < 0.0 { format!("(-{body})") } else { body }
}

/// The integer type of a kernel's element indices: `int` while every tensor it touches holds
/// fewer than 2^30 elements (so index + grid stride cannot overflow), else `long long`.
pub(crate) fn idx_type(max_elems: usize) -> &'static str {
    if max_elems < INT_LIMIT { "int" } else { "long long" }
}

/// An integer literal of the index type.
pub(crate) fn int(v: usize) -> String {
    if v > i32::MAX as usize { format!("{v}LL") } else { v.to_string() }
}

/// A 1-D grid of `block`-thread blocks for `work` items of a grid-stride loop.
pub(crate) fn grid_for(work: usize, block: u32) -> [u32; 3] {
    let blocks = work.div_ceil(block as usize).clamp(1, MAX_BLOCKS);
    [blocks as u32, 1, 1]
}

/// The opening line of a grid-stride loop over `0..n` with variable `var` of type `ty`.
pub(crate) fn grid_loop(ty: &str, var: &str, n: usize) -> String {
    if ty == "int" {
        format!(
            "for (int {var} = (int)(blockIdx.x * blockDim.x + threadIdx.x); {var} < {n}; \
             {var} += (int)(gridDim.x * blockDim.x)) {{"
        )
    } else {
        format!(
            "for (long long {var} = (long long)blockIdx.x * blockDim.x + threadIdx.x; {var} < {}; \
             {var} += (long long)gridDim.x * blockDim.x) {{",
            int(n)
        )
    }
}

/// A loop nest over a contiguous output with strided operands, after dropping size-1 axes and
/// merging adjacent axes that are contiguous for every operand (as the CPU's `Strided`): same
/// shapes become one axis, a bias add [N, C] + [C] two.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Nest {
    pub dims: Vec<usize>,
    /// `strides[k][axis]`: operand k's element stride along merged axis `axis`.
    pub strides: Vec<Vec<isize>>,
}

/// How an operand is read along a nest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// At the output's own linear index.
    Same,
    /// Always element 0 (a broadcast scalar).
    Scalar,
    /// Through per-axis strides.
    Strided,
}

impl Nest {
    pub(crate) fn new(out_dims: &[usize], strides: &[Vec<isize>]) -> Nest {
        let k = strides.len();
        let mut dims: Vec<usize> = Vec::new();
        let mut merged: Vec<Vec<isize>> = vec![Vec::new(); k];
        for (axis, &d) in out_dims.iter().enumerate() {
            if d == 1 {
                continue;
            }
            if let Some(last) = dims.last_mut()
                && (0..k).all(|j| merged[j].last() == Some(&(strides[j][axis] * d as isize)))
            {
                *last *= d;
                for (j, m) in merged.iter_mut().enumerate() {
                    *m.last_mut().expect("an axis") = strides[j][axis];
                }
                continue;
            }
            dims.push(d);
            for (j, m) in merged.iter_mut().enumerate() {
                m.push(strides[j][axis]);
            }
        }
        if dims.is_empty() {
            dims.push(1);
            merged.iter_mut().for_each(|m| m.push(0));
        }
        Nest { dims, strides: merged }
    }

    pub(crate) fn access(&self, k: usize) -> Access {
        let own = contiguous_strides(&self.dims);
        let s = &self.strides[k];
        if s.iter().zip(&own).all(|(&a, &b)| a == b as isize) || self.dims == [1] {
            Access::Same
        } else if s.iter().all(|&a| a == 0) {
            Access::Scalar
        } else {
            Access::Strided
        }
    }
}

/// Emits the coordinates of linear index `var` over `dims` (outer first) and returns one
/// expression per axis: `var / inner % extent`, without the division for the innermost axis and
/// without the modulo for the outermost; a single axis is `var` itself.
pub(crate) fn decompose(code: &mut Code, ty: &str, var: &str, dims: &[usize], prefix: &str) -> Vec<String> {
    decompose_some(code, ty, var, dims, &vec![true; dims.len()], prefix)
}

/// `decompose` for the axes marked in `used` only (the others get "0").
pub(crate) fn decompose_some(
    code: &mut Code,
    ty: &str,
    var: &str,
    dims: &[usize],
    used: &[bool],
    prefix: &str,
) -> Vec<String> {
    let n = dims.len();
    if n == 1 {
        return vec![var.to_string()];
    }
    (0..n)
        .map(|a| {
            if !used[a] {
                return "0".to_string();
            }
            let inner: usize = dims[a + 1..].iter().product();
            let q = if inner == 1 { var.to_string() } else { format!("{var} / {}", int(inner)) };
            let e = if a == 0 {
                q
            } else if inner == 1 {
                format!("{q} % {}", int(dims[a]))
            } else {
                format!("({q}) % {}", int(dims[a]))
            };
            let c = format!("{prefix}{a}");
            code.line(format!("const {ty} {c} = {e};"));
            c
        })
        .collect()
}

/// `coords · strides` as an expression ("0" when every stride is 0).
pub(crate) fn linear(coords: &[String], strides: &[isize]) -> String {
    let terms: Vec<String> = coords
        .iter()
        .zip(strides)
        .filter(|&(_, &s)| s != 0)
        .map(|(c, &s)| if s == 1 { c.clone() } else { format!("{c} * {s}") })
        .collect();
    if terms.is_empty() { "0".into() } else { terms.join(" + ") }
}

/// A shape as descriptions print it: "32x10", "scalar" for rank 0.
pub(crate) fn shape_text(s: &Shape) -> String {
    if s.rank() == 0 {
        return "scalar".into();
    }
    s.dims().iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")
}

/// The comment line that opens every generated source.
pub(crate) fn header(label: &str, inputs: &[&Shape], output: Option<&Shape>) -> String {
    let mut s = format!("// kiln: {label}:");
    for (i, x) in inputs.iter().enumerate() {
        let _ = write!(s, "{} {x}", if i == 0 { "" } else { "," });
    }
    if let Some(o) = output {
        let _ = write!(s, " -> {o}");
    }
    s
}

/// A kernel parameter list: `inputs` read-only operands named in0, in1, ... and, with `output`,
/// a written `out`, pointing to the types `elems` gives them. `restrict` marks them
/// `__restrict__` (never for elementwise kernels, whose output may be one of their inputs).
pub(crate) fn params(elems: &Elems, inputs: usize, output: bool, restrict: bool) -> String {
    let r = if restrict { " __restrict__" } else { "" };
    let mut p: Vec<String> = (0..inputs).map(|i| format!("const {}*{r} in{i}", elems.input(i))).collect();
    if output {
        p.push(format!("{}*{r} out", elems.output()));
    }
    p.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_literals_are_exact() {
        assert_eq!(flt(1.0), "1.0f");
        assert_eq!(flt(-3.0), "(-3.0f)");
        assert_eq!(flt(0.0), "0.0f");
        assert_eq!(flt(-0.0), "(-0.0f)");
        assert_eq!(flt(0.1), "0x1.99999ap-4f /* 0.1 */");
        assert_eq!(flt(0.5), "0x1p-1f /* 0.5 */");
        assert_eq!(flt(-1.5e-3), "(-0x1.89374cp-10f /* 0.0015 */)");
        assert_eq!(flt(f32::INFINITY), "__int_as_float(0x7f800000)");
        assert_eq!(flt(f32::NEG_INFINITY), "__int_as_float(0xff800000)");
        assert_eq!(flt(f32::from_bits(1)), "0x0.000002p-126f /* 1e-45 */");
        assert_eq!(flt(1e30), "0x1.93e594p99f /* 1e30 */");
        assert_eq!(dbl(0.9), "0x1.ccccccccccccdp-1");
        assert_eq!(dbl(1.0), "0x1p0");
        assert_eq!(dbl(-2.5), "(-0x1.4p1)");
    }

    #[test]
    fn nests_merge_like_the_cpu() {
        let same = broadcast_strides(&[4, 5, 6], &[4, 5, 6]);
        let n = Nest::new(&[4, 5, 6], &[same.clone(), same]);
        assert_eq!(n.dims, vec![120]);
        assert_eq!(n.access(0), Access::Same);
        let bias = broadcast_strides(&[10], &[32, 10]);
        let x = broadcast_strides(&[32, 10], &[32, 10]);
        let n = Nest::new(&[32, 10], &[x, bias]);
        assert_eq!(n.dims, vec![32, 10]);
        assert_eq!(n.strides, vec![vec![10, 1], vec![0, 1]]);
        assert_eq!((n.access(0), n.access(1)), (Access::Same, Access::Strided));
        let s = broadcast_strides(&[], &[3, 4]);
        let n = Nest::new(&[3, 4], &[s]);
        assert_eq!(n.access(0), Access::Scalar);
        let n = Nest::new(&[1, 1], &[vec![0, 0]]);
        assert_eq!((n.dims.clone(), n.access(0)), (vec![1], Access::Same));
    }

    #[test]
    fn code_indents_by_braces() {
        let mut c = Code::new();
        c.line("void f() {").line("if (x) {\ny = 1;\n} else {").line("y = 2;").line("}").line("}");
        assert_eq!(
            c.finish(),
            "void f() {\n    if (x) {\n        y = 1;\n    } else {\n        y = 2;\n    }\n}\n"
        );
    }
}
