//! Run-time compilation of kernel sources with NVRTC, cached in memory and on disk.
//!
//! The cache key is a SHA-256 of the source, the compile options, the target architecture and
//! NVRTC's version, so a second run of the same plans compiles nothing, and a new NVRTC or GPU
//! never reuses stale PTX (burn/cubecl cache their kernels the same way). The disk cache lives in
//! `KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`, under `ptx/`; writes go
//! through a temporary file (named by process, thread and a counter, so no two writes share one)
//! and a rename, so concurrent runs and threads never read half a file.
//!
//! The backend loads cubins (`compile_images`): machine code for the device's own `sm_XY`, which
//! the driver loads without its JIT, so an NVRTC newer than the driver works. Where NVRTC cannot
//! target that architecture, PTX for `compute_XY` is the fallback, left to the driver's JIT.

use super::probe;
use crate::error::{Result, RuntimeError};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// How many kernels came from where, and the time spent compiling.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct CompileStats {
    /// Kernels compiled by NVRTC (cache misses; a source asked for twice in one call counts once).
    pub compiled: usize,
    /// Kernels found in the in-memory cache.
    pub from_memory: usize,
    /// Kernels read from the disk cache.
    pub from_disk: usize,
    /// Wall-clock seconds spent compiling the misses, summed over calls.
    pub compile_seconds: f64,
}

/// What the driver loads: a cubin for the device's architecture, or PTX for its JIT.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Image {
    /// Machine code for the device's own `sm_XY`, loaded without the driver's JIT.
    Cubin(Vec<u8>),
    /// PTX for `compute_XY`, which the driver's JIT compiles at load.
    Ptx(String),
}

impl Image {
    /// The image's kind for reports: `cubin` or `PTX`.
    pub fn describe(&self) -> &'static str {
        match self {
            Image::Cubin(_) => "cubin",
            Image::Ptx(_) => "PTX",
        }
    }
}

/// Compiles kernel sources for one device's architecture with NVRTC, through an in-memory and
/// an on-disk cache (see the module's doc), counting where each kernel came from.
pub struct NvrtcCompiler {
    /// `compute_90` for an sm_90 device: PTX the driver finishes for the exact chip at load.
    arch: String,
    /// `sm_90` for an sm_90 device: the cubin's target.
    sm: String,
    images: Mutex<HashMap<String, Arc<Image>>>,
    version: (i32, i32),
    disk: Option<PathBuf>,
    memory: Mutex<HashMap<String, Arc<String>>>,
    stats: Mutex<CompileStats>,
}

/// The options every kernel is compiled with: the target, C++17, IEEE-exact arithmetic
/// (no fast math, precise division and square root, no flush to zero), as the CPU kernels compute.
pub fn options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--fmad=true".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--ftz=false".into(),
    ]
}

fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("KILN_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("kiln")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("kiln")))?;
    Some(base.join("ptx"))
}

impl NvrtcCompiler {
    /// A compiler for compute capability `major.minor`; fails (without panicking) when NVRTC is
    /// missing.
    pub fn new(compute_capability: (i32, i32)) -> Result<Self> {
        let info = probe::nvrtc().map_err(RuntimeError::Cuda)?;
        Ok(NvrtcCompiler {
            arch: format!("compute_{}{}", compute_capability.0, compute_capability.1),
            sm: format!("sm_{}{}", compute_capability.0, compute_capability.1),
            images: Mutex::new(HashMap::new()),
            version: info.version,
            disk: default_cache_dir(),
            memory: Mutex::new(HashMap::new()),
            stats: Mutex::new(CompileStats::default()),
        })
    }

    /// Uses `dir` for the disk cache (None: memory only).
    pub fn with_disk_cache(mut self, dir: Option<PathBuf>) -> Self {
        self.disk = dir;
        self
    }

    /// The PTX target, e.g. `compute_90`.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// NVRTC's version as (major, minor).
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// How many kernels came from where so far, and the time spent compiling.
    pub fn stats(&self) -> CompileStats {
        *self.stats.lock().expect("stats lock")
    }

    /// The cache key of `source` under this compiler's options, architecture and version.
    pub fn key(&self, source: &str) -> String {
        self.key_for(source, &self.arch)
    }

    /// The cache key of the image (`compile_images`) of `source`.
    pub fn image_key(&self, source: &str) -> String {
        format!("{}-image", self.key_for(source, &self.sm))
    }

    fn key_for(&self, source: &str, arch: &str) -> String {
        let mut h = Sha256::new();
        h.update(source.as_bytes());
        for o in options(arch) {
            h.update([0]);
            h.update(o.as_bytes());
        }
        h.update(format!("\0{}\0nvrtc {}.{}", arch, self.version.0, self.version.1).as_bytes());
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// What the backend loads for every source: a cubin for the device's `sm_XY`, or where NVRTC
    /// cannot make one, PTX for `compute_XY`. Cached in memory and on disk like `compile_all`.
    pub fn compile_images(&self, sources: &[&str]) -> Result<Vec<Arc<Image>>> {
        let keys: Vec<String> = sources.iter().map(|s| self.image_key(s)).collect();
        self.cached(
            &keys,
            &self.images,
            |dir, key| {
                std::fs::read(dir.join(format!("{key}.cubin")))
                    .ok()
                    .map(Image::Cubin)
                    .or_else(|| std::fs::read_to_string(dir.join(format!("{key}.ptx"))).ok().map(Image::Ptx))
            },
            |i| self.image_compile(sources[i]),
            |dir, key, image| match image {
                Image::Cubin(b) => store(dir, &format!("{key}.cubin"), b),
                Image::Ptx(p) => store(dir, &format!("{key}.ptx"), p.as_bytes()),
            },
        )
    }

    /// The value of every key: from `table` (memory), else `read` from the disk cache, else
    /// `make` (the misses in parallel, the same key once) and `write` to the disk cache; the
    /// statistics count each.
    fn cached<T: Send + Sync>(
        &self,
        keys: &[String],
        table: &Mutex<HashMap<String, Arc<T>>>,
        read: impl Fn(&std::path::Path, &str) -> Option<T>,
        make: impl Fn(usize) -> Result<T> + Sync,
        write: impl Fn(&std::path::Path, &str, &T),
    ) -> Result<Vec<Arc<T>>> {
        let (mut from_memory, mut from_disk) = (0, 0);
        let mut misses: Vec<usize> = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            if table.lock().expect("cache lock").contains_key(key) {
                from_memory += 1;
            } else if let Some(value) = self.disk.as_ref().and_then(|d| read(d, key)) {
                from_disk += 1;
                table.lock().expect("cache lock").insert(key.clone(), Arc::new(value));
            } else {
                misses.push(i);
            }
        }
        let start = Instant::now();
        // The same source twice compiles once.
        misses.sort_by(|a, b| keys[*a].cmp(&keys[*b]));
        misses.dedup_by_key(|i| keys[*i].clone());
        let compiled: Vec<(usize, Result<T>)> = misses.par_iter().map(|&i| (i, make(i))).collect();
        let compiled_count = compiled.len();
        for (i, value) in compiled {
            let value = value?;
            if let Some(dir) = &self.disk {
                write(dir, &keys[i], &value);
            }
            table.lock().expect("cache lock").insert(keys[i].clone(), Arc::new(value));
        }
        let mut stats = self.stats.lock().expect("stats lock");
        stats.compiled += compiled_count;
        stats.from_memory += from_memory;
        stats.from_disk += from_disk;
        stats.compile_seconds += start.elapsed().as_secs_f64();
        drop(stats);
        let table = table.lock().expect("cache lock");
        Ok(keys.iter().map(|k| table[k].clone()).collect())
    }

    /// A cubin for `sm_XY`, else PTX for `compute_XY` (the error names both attempts).
    fn image_compile(&self, source: &str) -> Result<Image> {
        match cubin(source, &self.sm) {
            Ok(bytes) => Ok(Image::Cubin(bytes)),
            Err(why) => self.nvrtc_compile(source).map(Image::Ptx).map_err(|e| {
                RuntimeError::Cuda(format!(
                    "{e}\n(a cubin for {} failed first: {why}; NVRTC {}.{})",
                    self.sm, self.version.0, self.version.1
                ))
            }),
        }
    }

    /// PTX for `source`, from the memory cache, the disk cache, or NVRTC.
    pub fn compile(&self, source: &str) -> Result<Arc<String>> {
        Ok(self.compile_all(&[source])?.remove(0))
    }

    /// PTX for every source; the misses are compiled in parallel.
    pub fn compile_all(&self, sources: &[&str]) -> Result<Vec<Arc<String>>> {
        let keys: Vec<String> = sources.iter().map(|s| self.key(s)).collect();
        self.cached(
            &keys,
            &self.memory,
            |dir, key| std::fs::read_to_string(dir.join(format!("{key}.ptx"))).ok(),
            |i| self.nvrtc_compile(sources[i]),
            |dir, key, ptx| store(dir, &format!("{key}.ptx"), ptx.as_bytes()),
        )
    }

    fn nvrtc_compile(&self, source: &str) -> Result<String> {
        let opts = cudarc::nvrtc::CompileOptions { options: options(&self.arch), ..Default::default() };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| {
            let first = source.lines().next().unwrap_or("");
            let why = match e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
                other => format!("{other:?}"),
            };
            RuntimeError::Cuda(format!("NVRTC could not compile the kernel `{first}`:\n{why}"))
        })?;
        Ok(ptx.to_src())
    }
}

/// NVRTC's cubin for `source` on `sm` (e.g. `sm_90`), or NVRTC's log.
fn cubin(source: &str, sm: &str) -> std::result::Result<Vec<u8>, String> {
    use cudarc::nvrtc::{result, sys};
    let src = std::ffi::CString::new(source).map_err(|_| "the source holds a NUL byte".to_string())?;
    let prog = result::create_program(&src, None).map_err(|e| format!("{e:?}"))?;
    let opts = options(sm);
    // SAFETY: `prog` is a live program; the options are plain strings.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    let out = match compiled {
        Err(e) => {
            // SAFETY: `prog` is live.
            let log = unsafe { result::get_program_log(prog) }
                .map(|l| l.iter().map(|&c| c as u8 as char).collect::<String>())
                .unwrap_or_default();
            Err(format!("{e:?}: {}", log.trim_end_matches('\0')))
        }
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled; nvrtcGetCUBINSize writes one usize.
            let sized = unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }.result();
            let mut bytes = vec![0u8; size];
            // SAFETY: `bytes` holds the `size` bytes nvrtcGetCUBIN writes.
            let got =
                sized.and_then(|_| unsafe { sys::nvrtcGetCUBIN(prog, bytes.as_mut_ptr().cast()) }.result());
            match got {
                Ok(()) if size > 0 => Ok(bytes),
                Ok(()) => Err(format!("NVRTC made no cubin for {sm}")),
                Err(e) => Err(format!("nvrtcGetCUBIN: {e:?}")),
            }
        }
    };
    // SAFETY: destroyed once, not used after.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// The temporary file a cache write goes through: unique per process, thread and write, so two
/// threads storing the same kernel never write one file at once.
pub fn temp_path(dir: &std::path::Path, name: &str) -> PathBuf {
    super::emulator::host::unique_temp(dir, name, "tmp")
}

fn store(dir: &std::path::Path, name: &str, bytes: &[u8]) {
    // A failed write only costs a recompilation next time.
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = temp_path(dir, name);
    if std::fs::write(&tmp, bytes).is_ok() {
        if std::fs::rename(&tmp, dir.join(name)).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    } else {
        let _ = std::fs::remove_file(&tmp);
    }
}
