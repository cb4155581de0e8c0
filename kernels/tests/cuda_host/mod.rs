//! Runs generated CUDA C kernels on the host: every kernel is compiled with the system C++
//! compiler against `cuda_host.h` (CUDA's built-ins mapped onto host threads), loaded as a shared
//! library and launched with its grid and block on host buffers. See the header for what this
//! cannot see. Cases are compiled into a few translation units (each kernel in a namespace of
//! its own) built in parallel, so the whole set costs a few compiler runs.

use kiln_compiler::ir::Op;
use kiln_kernels::cuda::{Arg, CudaKernel};
use std::ffi::c_void;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One kernel to run: its launches, the operands (read and, for effects, written in place) and
/// the output's element count (0 for effects).
pub struct HostCase {
    pub name: String,
    pub kernel: CudaKernel,
    pub operands: Vec<Vec<f32>>,
    pub output_len: usize,
}

/// What a kernel left: its operands after the run and its output.
pub struct HostResult {
    pub operands: Vec<Vec<f32>>,
    pub output: Vec<f32>,
}

/// Whether the host run of `got` matches the CPU's `want`: NaN where NaN, infinities equal,
/// else within `tol` relative (transcendentals are libm's on both sides; sums may run in
/// another order: `tolerance`).
pub fn close(got: &[f32], want: &[f32], tol: f32) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{} elements, expected {}", got.len(), want.len()));
    }
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = (g.is_nan() && w.is_nan())
            || g == w
            || (g.is_finite() && w.is_finite() && (g - w).abs() <= tol * w.abs().max(1.0));
        if !ok {
            return Err(format!("element {i}: {g} on the host, {w} on the CPU"));
        }
    }
    Ok(())
}

/// The relative tolerance for `op`: 1e-5, or 1e-4 where the kernel sums long rows in another
/// order than the CPU (products and convolutions split over K, reductions by warps).
pub fn tolerance(op: &Op) -> f32 {
    match op {
        Op::MatMul { .. }
        | Op::MatMulRows { .. }
        | Op::Conv2d { .. }
        | Op::Conv2dBackpropInput { .. }
        | Op::Conv2dBackpropFilter { .. }
        | Op::Reduce { .. }
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::GatherGrad { .. } => 1e-4,
        Op::Fused(f) if f.matmul.is_some() || f.reduce.is_some() => 1e-4,
        _ => 1e-5,
    }
}

const HEADER: &str = include_str!("cuda_host.h");

/// The C++ compiler: `$CXX`, else `c++`.
fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".into())
}

/// Whether a C++20 compiler is present (CI has one; the test says so where not).
pub fn available() -> Result<(), String> {
    match Command::new(compiler()).arg("--version").output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!("{} --version failed: {}", compiler(), String::from_utf8_lossy(&o.stderr))),
        Err(e) => Err(format!("no C++ compiler ({}): {e}", compiler())),
    }
}

/// The kernel source as host C++: `extern "C"` dropped (each case lives in its own namespace).
fn host_source(k: &CudaKernel) -> String {
    k.source.replace("extern \"C\" ", "")
}

fn unit(cases: &[(usize, &HostCase)]) -> String {
    let mut s = String::from("#include \"cuda_host.h\"\n");
    for &(i, c) in cases {
        let _ = writeln!(s, "namespace kiln_case_{i} {{\n{}\n}}", host_source(&c.kernel));
        for (j, l) in c.kernel.launches.iter().enumerate() {
            let _ = writeln!(
                s,
                "static void kiln_case_{i}_body_{j}(void** args) {{ kiln_host::call(kiln_case_{i}::{}, args); }}\n\
                 extern \"C\" void kiln_case_{i}_launch_{j}(void** args) {{\n    \
                 kiln_host::launch(dim3{{{}, {}, {}}}, dim3{{{}, {}, {}}}, kiln_case_{i}_body_{j}, args);\n}}",
                l.function, l.grid[0], l.grid[1], l.grid[2], l.block[0], l.block[1], l.block[2]
            );
        }
    }
    s
}

/// Compiles `cases` into `units` shared libraries under `dir`, in parallel.
fn build(dir: &Path, cases: &[HostCase], units: usize) -> Result<Vec<(PathBuf, Vec<usize>)>, String> {
    std::fs::write(dir.join("cuda_host.h"), HEADER).map_err(|e| e.to_string())?;
    let indexed: Vec<(usize, &HostCase)> = cases.iter().enumerate().collect();
    let per = indexed.len().div_ceil(units.max(1)).max(1);
    let jobs: Vec<(PathBuf, Vec<usize>, String)> = indexed
        .chunks(per)
        .enumerate()
        .map(|(u, chunk)| (dir.join(format!("unit{u}.so")), chunk.iter().map(|c| c.0).collect(), unit(chunk)))
        .collect();
    let results: Vec<Result<(), String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .iter()
            .enumerate()
            .map(|(u, (lib, _, src))| {
                scope.spawn(move || -> Result<(), String> {
                    let cpp = dir.join(format!("unit{u}.cpp"));
                    std::fs::write(&cpp, src).map_err(|e| e.to_string())?;
                    let out = Command::new(compiler())
                        .args([
                            "-std=c++20",
                            "-O1",
                            "-ffp-contract=off",
                            "-fPIC",
                            "-shared",
                            "-pthread",
                            "-w",
                        ])
                        .arg("-I")
                        .arg(dir)
                        .arg("-o")
                        .arg(lib)
                        .arg(&cpp)
                        .output()
                        .map_err(|e| format!("running {}: {e}", compiler()))?;
                    if out.status.success() {
                        Ok(())
                    } else {
                        let log = String::from_utf8_lossy(&out.stderr);
                        Err(format!(
                            "{} failed on {}:\n{}",
                            compiler(),
                            cpp.display(),
                            &log[..log.len().min(4000)]
                        ))
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("compiler thread panicked".into())))
            .collect()
    });
    results.into_iter().collect::<Result<Vec<()>, String>>()?;
    Ok(jobs.into_iter().map(|(lib, idx, _)| (lib, idx)).collect())
}

/// Compiles and runs every case; results in case order.
pub fn run(cases: Vec<HostCase>) -> Result<Vec<HostResult>, String> {
    let dir = std::env::temp_dir().join(format!("kiln-cuda-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let start = std::time::Instant::now();
    let libs = build(&dir, &cases, 2)?;
    let compiled = start.elapsed().as_secs_f64();
    let mut results: Vec<Option<HostResult>> = (0..cases.len()).map(|_| None).collect();
    for (lib_path, indices) in libs {
        // SAFETY: the library was just built from generated kernels and the header; loading it
        // runs no initialisers beyond C++ statics of those.
        let lib = unsafe { libloading::Library::new(&lib_path) }.map_err(|e| e.to_string())?;
        for i in indices {
            let c = &cases[i];
            let mut operands = c.operands.clone();
            let mut output = vec![f32::NAN; c.output_len];
            for (j, l) in c.kernel.launches.iter().enumerate() {
                let mut args: Vec<*mut c_void> = l
                    .args
                    .iter()
                    .map(|a| match a {
                        Arg::Input(k) => operands[*k].as_mut_ptr() as *mut c_void,
                        Arg::Output => output.as_mut_ptr() as *mut c_void,
                    })
                    .collect();
                let symbol = format!("kiln_case_{i}_launch_{j}");
                // SAFETY: the symbol is the launcher `unit` generated with this signature; every
                // argument points to a host buffer of the element count the kernel was
                // generated for (the case's operand and output shapes).
                unsafe {
                    let f: libloading::Symbol<unsafe extern "C" fn(*mut *mut c_void)> =
                        lib.get(symbol.as_bytes()).map_err(|e| format!("{}: {e}", c.name))?;
                    f(args.as_mut_ptr());
                }
            }
            results[i] = Some(HostResult { operands, output });
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "host CUDA: {} kernels compiled in {compiled:.1} s, run in {:.1} s",
        cases.len(),
        start.elapsed().as_secs_f64() - compiled
    );
    Ok(results.into_iter().map(|r| r.expect("every case ran")).collect())
}
