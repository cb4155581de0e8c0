//! Run-time compilation of kernel sources with NVRTC, cached in memory and on disk.
//!
//! The cache key is a SHA-256 of the source, the compile options, the target architecture and
//! NVRTC's version, so a second run of the same plans compiles nothing, and a new NVRTC or GPU
//! never reuses stale PTX (burn/cubecl cache their kernels the same way). The disk cache lives in
//! `KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`, under `ptx/`; writes go
//! through a temporary file and a rename, so concurrent runs never read half a file.

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
    pub compiled: usize,
    pub from_memory: usize,
    pub from_disk: usize,
    pub compile_seconds: f64,
}

pub struct NvrtcCompiler {
    /// `compute_90` for an sm_90 device: PTX the driver finishes for the exact chip at load.
    arch: String,
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

    pub fn arch(&self) -> &str {
        &self.arch
    }

    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    pub fn stats(&self) -> CompileStats {
        *self.stats.lock().expect("stats lock")
    }

    /// The cache key of `source` under this compiler's options, architecture and version.
    pub fn key(&self, source: &str) -> String {
        let mut h = Sha256::new();
        h.update(source.as_bytes());
        for o in options(&self.arch) {
            h.update([0]);
            h.update(o.as_bytes());
        }
        h.update(format!("\0{}\0nvrtc {}.{}", self.arch, self.version.0, self.version.1).as_bytes());
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// PTX for `source`, from the memory cache, the disk cache, or NVRTC.
    pub fn compile(&self, source: &str) -> Result<Arc<String>> {
        Ok(self.compile_all(&[source])?.remove(0))
    }

    /// PTX for every source; the misses are compiled in parallel.
    pub fn compile_all(&self, sources: &[&str]) -> Result<Vec<Arc<String>>> {
        let keys: Vec<String> = sources.iter().map(|s| self.key(s)).collect();
        let mut found: Vec<Option<Arc<String>>> = Vec::with_capacity(sources.len());
        let (mut from_memory, mut from_disk) = (0, 0);
        for key in &keys {
            let hit = self.memory.lock().expect("cache lock").get(key).cloned();
            if hit.is_some() {
                from_memory += 1;
                found.push(hit);
                continue;
            }
            let disk =
                self.disk.as_ref().and_then(|d| std::fs::read_to_string(d.join(format!("{key}.ptx"))).ok());
            if let Some(ptx) = disk {
                from_disk += 1;
                let ptx = Arc::new(ptx);
                self.memory.lock().expect("cache lock").insert(key.clone(), ptx.clone());
                found.push(Some(ptx));
            } else {
                found.push(None);
            }
        }
        let start = Instant::now();
        let mut misses: Vec<usize> = (0..sources.len()).filter(|&i| found[i].is_none()).collect();
        // The same source twice compiles once.
        misses.dedup_by_key(|i| keys[*i].clone());
        let compiled: Vec<(usize, Result<String>)> =
            misses.par_iter().map(|&i| (i, self.nvrtc_compile(sources[i]))).collect();
        let compiled_count = compiled.len();
        for (i, ptx) in compiled {
            let ptx = Arc::new(ptx?);
            if let Some(dir) = &self.disk {
                store(dir, &keys[i], &ptx);
            }
            self.memory.lock().expect("cache lock").insert(keys[i].clone(), ptx);
        }
        let mut stats = self.stats.lock().expect("stats lock");
        stats.compiled += compiled_count;
        stats.from_memory += from_memory;
        stats.from_disk += from_disk;
        stats.compile_seconds += start.elapsed().as_secs_f64();
        drop(stats);
        let memory = self.memory.lock().expect("cache lock");
        Ok(keys.iter().map(|k| memory[k].clone()).collect())
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

fn store(dir: &std::path::Path, key: &str, ptx: &str) {
    // A failed write only costs a recompilation next time.
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = dir.join(format!("{key}.{}.tmp", std::process::id()));
    if std::fs::write(&tmp, ptx).is_ok() {
        let _ = std::fs::rename(&tmp, dir.join(format!("{key}.ptx")));
    }
}
