//! Generated CUDA C compiled for the host: every kernel's source goes, each in a namespace of its
//! own, into a C++ translation unit with `cuda_host.h` (CUDA's built-ins mapped onto host
//! threads), built into a shared library with the system C++ compiler and loaded with
//! libloading. A batch of kernels is split into a few units built in parallel (one compiler run
//! costs about a second, mostly the header's standard includes), and each library is cached on
//! disk under a hash of its source, the header and the flags, so a second run builds nothing.
//!
//! Kernels that never synchronise a block (no `__syncthreads`, no warp shuffle) run their threads
//! one after another on the calling thread; the others run a block's threads as real threads.

use kiln_kernels::cuda::CudaKernel;
use sha2::{Digest, Sha256};
use std::ffi::c_void;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The header mapping CUDA's built-ins onto host threads.
pub const HEADER: &str = include_str!("cuda_host.h");

/// The flags every unit is built with: C++20, IEEE arithmetic without contraction (a product is
/// rounded before any sum, as the kernels' `__fmul_rn` promises).
const FLAGS: [&str; 7] = ["-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-pthread", "-w"];

/// The C++ compiler: `$CXX`, else `c++`.
pub fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".into())
}

/// Whether a C++20 compiler is present.
pub fn available() -> Result<(), String> {
    match Command::new(compiler()).arg("--version").output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!("{} --version failed: {}", compiler(), String::from_utf8_lossy(&o.stderr))),
        Err(e) => Err(format!("no C++ compiler ({}): {e}; install g++ or clang, or set CXX", compiler())),
    }
}

/// Where compiled libraries are kept: `KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else
/// `~/.cache/kiln`, under `host/`; the temporary directory where none of them is set.
pub fn default_cache_dir() -> PathBuf {
    std::env::var_os("KILN_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("kiln")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("kiln")))
        .unwrap_or_else(|| std::env::temp_dir().join("kiln"))
        .join("host")
}

/// Whether `kernel` needs a block's threads to run at once (it synchronises them).
fn synchronises(kernel: &CudaKernel) -> bool {
    kernel.source.contains("__syncthreads") || kernel.source.contains("__shfl")
}

fn unit(kernels: &[(usize, &CudaKernel)]) -> String {
    let mut s = String::from("#include \"cuda_host.h\"\n");
    for &(i, k) in kernels {
        let launch = if synchronises(k) { "launch" } else { "launch_serial" };
        let _ = writeln!(s, "namespace kiln_k{i} {{\n{}\n}}", k.source.replace("extern \"C\" ", ""));
        // Each source is a translation unit of its own for NVRTC: the macros it defines (include
        // guards of its helpers) end with it.
        for name in k.source.lines().filter_map(|l| l.trim().strip_prefix("#define ")) {
            let name: String = name.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            let _ = writeln!(s, "#undef {name}");
        }
        for (j, l) in k.launches.iter().enumerate() {
            let _ = writeln!(
                s,
                "static void kiln_k{i}_body_{j}(void** a) {{ kiln_host::call(kiln_k{i}::{}, a); }}\n\
                 extern \"C\" void kiln_k{i}_launch_{j}(const unsigned* d, void** a) {{\n    \
                 kiln_host::{launch}(dim3{{d[0], d[1], d[2]}}, dim3{{d[3], d[4], d[5]}}, kiln_k{i}_body_{j}, a);\n}}",
                l.function
            );
        }
    }
    s
}

type LaunchFn = unsafe extern "C" fn(*const u32, *mut *mut c_void);

/// One launchable kernel function of a loaded library.
#[derive(Clone)]
pub struct HostFunction {
    name: String,
    serial: bool,
    f: LaunchFn,
    /// Keeps the library (and so `f`) loaded.
    _lib: Arc<libloading::Library>,
}

impl std::fmt::Debug for HostFunction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostFunction({})", self.name)
    }
}

impl HostFunction {
    /// The kernel function's name in the generated source.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether its threads run one after another (the kernel never synchronises a block).
    pub fn serial(&self) -> bool {
        self.serial
    }

    /// Runs the kernel over `grid` x `block` with `args` as its pointer parameters, in order;
    /// one launch at a time in the process (the header's `__shared__` arrays and launch
    /// geometry are process-wide statics).
    ///
    /// # Safety
    /// Every argument must point to host memory holding everything the kernel reads and writes
    /// for this geometry (the shapes it was generated for), and nothing else may use that
    /// memory during the call.
    pub unsafe fn launch(&self, grid: [u32; 3], block: [u32; 3], args: &mut [*mut c_void]) {
        static LAUNCH: Mutex<()> = Mutex::new(());
        let _one = LAUNCH.lock().unwrap_or_else(|e| e.into_inner());
        let _named = super::fault::Running::new(&self.name);
        let dims = [grid[0], grid[1], grid[2], block[0], block[1], block[2]];
        // SAFETY: `f` is the launcher `unit` generated with this signature, kept alive by
        // `_lib`; the caller guarantees the arguments (above); `LAUNCH` keeps other launches out.
        unsafe { (self.f)(dims.as_ptr(), args.as_mut_ptr()) }
    }
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A name for a temporary file in `dir` that no other write (thread or process) uses.
pub fn unique_temp(dir: &Path, stem: &str, ext: &str) -> PathBuf {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let thread =
        format!("{:?}", std::thread::current().id()).replace(|c: char| !c.is_ascii_alphanumeric(), "");
    dir.join(format!("{stem}.{}.{thread}.{n}.{ext}", std::process::id()))
}

/// Builds one unit's library into `cache` (or finds it there) and returns its path.
fn build_unit(cache: &Path, source: &str) -> Result<PathBuf, String> {
    let mut h = Sha256::new();
    h.update(HEADER.as_bytes());
    h.update(source.as_bytes());
    h.update(compiler().as_bytes());
    for f in FLAGS {
        h.update([0]);
        h.update(f.as_bytes());
    }
    let key: String = h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect();
    let lib = cache.join(format!("{key}.so"));
    if lib.is_file() {
        return Ok(lib);
    }
    let header = unique_temp(cache, &key, "h");
    let cpp = unique_temp(cache, &key, "cpp");
    let tmp = unique_temp(cache, &key, "so");
    let written = std::fs::write(
        &cpp,
        source.replace("#include \"cuda_host.h\"", &format!("#include \"{}\"", header.display())),
    )
    .and_then(|_| std::fs::write(&header, HEADER));
    written.map_err(|e| format!("writing {}: {e}", cpp.display()))?;
    let out = Command::new(compiler())
        .args(FLAGS)
        .arg("-o")
        .arg(&tmp)
        .arg(&cpp)
        .output()
        .map_err(|e| format!("running {}: {e}", compiler()))?;
    let _ = std::fs::remove_file(&cpp);
    let _ = std::fs::remove_file(&header);
    if !out.status.success() {
        let log = String::from_utf8_lossy(&out.stderr);
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("{} failed on generated kernels:\n{}", compiler(), &log[..log.len().min(4000)]));
    }
    std::fs::rename(&tmp, &lib).map_err(|e| format!("caching {}: {e}", lib.display()))?;
    Ok(lib)
}

/// Compiles `kernels` into at most `units` libraries under `cache` (built in parallel, or found
/// there) and returns, per kernel, one function per launch.
pub fn compile(
    kernels: &[&CudaKernel],
    cache: &Path,
    units: usize,
) -> Result<Vec<Vec<HostFunction>>, String> {
    std::fs::create_dir_all(cache).map_err(|e| format!("creating {}: {e}", cache.display()))?;
    let indexed: Vec<(usize, &CudaKernel)> = kernels.iter().copied().enumerate().collect();
    let per = indexed.len().div_ceil(units.max(1)).max(1);
    let chunks: Vec<&[(usize, &CudaKernel)]> = indexed.chunks(per).collect();
    let built: Vec<Result<PathBuf, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> =
            chunks.iter().map(|chunk| scope.spawn(move || build_unit(cache, &unit(chunk)))).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("compiler thread panicked".into())))
            .collect()
    });
    let mut out: Vec<Vec<HostFunction>> = vec![Vec::new(); kernels.len()];
    for (chunk, path) in chunks.iter().zip(built) {
        let path = path?;
        // SAFETY: the library was built from generated kernels and the header; loading it runs
        // no initialisers beyond the C++ statics of those.
        let lib = Arc::new(
            unsafe { libloading::Library::new(&path) }.map_err(|e| format!("{}: {e}", path.display()))?,
        );
        for &(i, k) in chunk.iter() {
            for (j, l) in k.launches.iter().enumerate() {
                let symbol = format!("kiln_k{i}_launch_{j}");
                // SAFETY: `unit` defined this symbol with exactly the `LaunchFn` signature.
                let f: LaunchFn = unsafe { lib.get::<LaunchFn>(symbol.as_bytes()) }
                    .map(|s| *s)
                    .map_err(|e| format!("`{}` ({symbol}): {e}", l.function))?;
                out[i].push(HostFunction {
                    name: l.function.clone(),
                    serial: !synchronises(k),
                    f,
                    _lib: lib.clone(),
                });
            }
        }
    }
    Ok(out)
}
