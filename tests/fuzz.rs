//! Fuzzing the two readers of files from outside: the ONNX importer and checkpoint loading.
//!
//! A mutation fuzzer over the corpus checked in under `tests/fuzz_corpus/` (small ONNX models
//! from ONNX's backend tests, and safetensors checkpoints): each case takes a corpus file and
//! applies a few mutations (bit flips, interesting bytes and 64-bit lengths, insertions,
//! deletions, truncations, duplicated ranges, splices with another file), then feeds the result
//! to the reader. The property: a value or an error, never a panic, and never a hang (every case
//! has a deadline). ONNX files that import are also compiled, and run on the CPU when small; a
//! checkpoint that does not load leaves the trainer's variables bit-identical.
//!
//! Why a mutation loop of its own rather than `cargo fuzz` or bolero: libFuzzer through
//! `cargo fuzz` needs a nightly toolchain, which the build machines do not have, and random bytes
//! (what property-testing generators give) almost never get past a protobuf or safetensors
//! header, so they would test the first check alone; mutating files that parse reaches the
//! checks behind it (in CI about one case in ten still imports or reads).
//!
//! `KILN_FUZZ_ITERS=n` sets the cases per reader (a few hundred in CI; run 100,000 by hand:
//! `KILN_FUZZ_ITERS=100000 cargo test --release --test fuzz -- --nocapture`), `KILN_FUZZ_SEED=n`
//! the seed (fixed by default, so CI is reproducible). A failing case is written to
//! `target/kiln/fuzz/` and its path printed: add it to the corpus once fixed.

use kiln::prelude::*;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(20);

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn corpus(kind: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_corpus").join(kind);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    let out: Vec<Vec<u8>> = files.iter().map(|p| std::fs::read(p).unwrap()).collect();
    assert!(!out.is_empty(), "no corpus in {}", dir.display());
    out
}

/// Values worth trying where a length, a count or a dimension is read.
const INTERESTING: [u64; 12] =
    [0, 1, 2, 7, 0x7f, 0x80, 0xff, 0xffff, 0x7fff_ffff, 0xffff_ffff, 1 << 40, u64::MAX];

fn mutate(rng: &mut StdRng, corpus: &[Vec<u8>]) -> Vec<u8> {
    let mut data = corpus[rng.random_range(0..corpus.len())].clone();
    // Mostly one small change, so that most cases still parse and reach deeper checks.
    let changes = if rng.random_bool(0.6) { 1 } else { rng.random_range(2..=4) };
    for _ in 0..changes {
        let len = data.len();
        match rng.random_range(0..8) {
            0 if len > 0 => {
                let i = rng.random_range(0..len);
                data[i] ^= 1 << rng.random_range(0..8);
            }
            1 if len > 0 => {
                let i = rng.random_range(0..len);
                data[i] = INTERESTING[rng.random_range(0..INTERESTING.len())] as u8;
            }
            2 if len >= 8 => {
                let i = rng.random_range(0..=len - 8);
                let v = INTERESTING[rng.random_range(0..INTERESTING.len())];
                data[i..i + 8].copy_from_slice(&v.to_le_bytes());
            }
            3 => {
                let i = rng.random_range(0..=len);
                let n = rng.random_range(1..16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.random()).collect();
                data.splice(i..i, bytes);
            }
            4 if len > 0 => {
                let i = rng.random_range(0..len);
                let j = rng.random_range(i..=len.min(i + 32));
                data.drain(i..j);
            }
            5 if len > 0 => data.truncate(rng.random_range(0..len)),
            6 if len > 0 => {
                let i = rng.random_range(0..len);
                let j = rng.random_range(i..=len.min(i + 64));
                let piece = data[i..j].to_vec();
                let at = rng.random_range(0..=len);
                data.splice(at..at, piece);
            }
            _ => {
                let other = &corpus[rng.random_range(0..corpus.len())];
                if !other.is_empty() {
                    let from = rng.random_range(0..other.len());
                    let at = rng.random_range(0..=len);
                    data.truncate(at);
                    data.extend_from_slice(&other[from..]);
                }
            }
        }
    }
    data
}

/// Runs `f` on `input` in a thread of its own: a panic or a run past the deadline fails the
/// test, with the input saved for a reproducer.
fn check(
    reader: &str,
    case: usize,
    input: Vec<u8>,
    f: impl Fn(&[u8]) -> Result<(), String> + Send + std::panic::RefUnwindSafe + 'static,
) {
    let (tx, rx) = mpsc::channel();
    let data = input.clone();
    std::thread::spawn(move || {
        let outcome = std::panic::catch_unwind(|| f(&data));
        let _ = tx.send(outcome.map_err(|p| {
            p.downcast_ref::<String>()
                .cloned()
                .or(p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()
        }));
    });
    let failure = match rx.recv_timeout(DEADLINE) {
        Ok(Ok(Ok(()) | Err(_))) => return,
        Ok(Err(panic)) => format!("panicked: {panic}"),
        Err(_) => format!("ran past {DEADLINE:?}"),
    };
    let dir = kiln::report::output_dir().join("fuzz");
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(format!("{reader}-{case}.bin"));
    let _ = std::fs::write(&path, &input);
    panic!("{reader} case {case} {failure}; the input is {}", path.display());
}

fn quiet_panics() {
    std::panic::set_hook(Box::new(|_| {}));
}

fn import_compile_run(bytes: &[u8]) -> Result<(), String> {
    let imported = kiln::onnx::import(bytes, &[]).map_err(|e| e.to_string())?;
    let plan = compile(imported.graph, &CompileOptions::default()).map_err(|e| e.to_string())?;
    let mut feeds = Vec::new();
    for b in &plan.inputs {
        let v = plan.value(b.value);
        let n = v.shape.checked_numel().unwrap_or(usize::MAX);
        if n > 1 << 16 {
            return Err("too large to run".to_string());
        }
        let t = match v.dtype {
            DType::I64 => HostTensor::from_i64(v.shape.clone(), vec![0; n]),
            DType::I32 => HostTensor::from_i32(v.shape.clone(), vec![0; n]),
            DType::Bool => HostTensor::from_bool(v.shape.clone(), vec![false; n]),
            _ => HostTensor::from_fn(v.shape.clone(), |i| (i % 7) as f32 * 0.25),
        };
        feeds.push((b.name.clone(), t.map_err(|e| e.to_string())?));
    }
    let mut cpu = CpuBackend::new(0);
    let program = cpu.load(plan).map_err(|e| e.to_string())?;
    for (key, value) in &imported.weights {
        cpu.write_variable(key, value).map_err(|e| e.to_string())?;
    }
    let refs: Vec<(&str, &HostTensor)> = feeds.iter().map(|(n, t)| (n.as_str(), t)).collect();
    cpu.call(program, &refs).map(|_| ()).map_err(|e| e.to_string())
}

#[test]
fn the_onnx_importer_never_panics_or_hangs() {
    quiet_panics();
    let corpus = corpus("onnx");
    let iters = env_number("KILN_FUZZ_ITERS", 400) as usize;
    let mut rng = StdRng::seed_from_u64(env_number("KILN_FUZZ_SEED", 1));
    // The corpus itself must import (the fuzzer mutates working files).
    for (i, file) in corpus.iter().enumerate() {
        check("onnx-corpus", i, file.clone(), import_compile_run);
    }
    let mut imported = 0;
    for case in 0..iters {
        let input = mutate(&mut rng, &corpus);
        imported += usize::from(kiln::onnx::import(&input, &[]).is_ok());
        check("onnx", case, input, import_compile_run);
    }
    println!("onnx: {iters} cases, {imported} imported");
}

/// A trainer whose variables match the corpus's `mlp_*` checkpoints: Dense(3) on 4 inputs, Adam.
fn trainer() -> Trainer {
    let config =
        TrainConfig { loss: Loss::MeanSquaredError, optimizer: Adam::new(0.01).into(), metrics: vec![] };
    let mut t = Trainer::new(Sequential::new().add(Dense::new(3)), config, Box::new(CpuBackend::new(3)));
    t.train_program(Shape::new([2, 4]), Shape::new([2, 3])).expect("the trainer's step compiles");
    t
}

fn variables(t: &Trainer) -> Vec<(String, Vec<u32>)> {
    let plan = t.plans()[0];
    plan.variables
        .iter()
        .map(|v| {
            let bits =
                t.backend().read_variable(&v.key).unwrap().data().iter().map(|x| x.to_bits()).collect();
            (v.key.clone(), bits)
        })
        .collect()
}

/// Loads `bytes` as a checkpoint, written to a file in `dir`.
fn load_checkpoint(dir: &Path, bytes: &[u8]) -> Result<(), String> {
    let path = dir.join(format!("{:?}.safetensors", std::thread::current().id()).replace(['(', ')'], ""));
    std::fs::write(&path, bytes).map_err(|e| e.to_string())?;
    let mut t = trainer();
    let before = variables(&t);
    let loaded = t.load(&path);
    let _ = std::fs::remove_file(&path);
    if loaded.is_err() {
        assert!(variables(&t) == before, "a refused load changed the trainer's variables");
    }
    loaded.map_err(|e| e.to_string())
}

#[test]
fn checkpoint_loading_never_panics_or_hangs() {
    quiet_panics();
    let corpus = corpus("safetensors");
    let iters = env_number("KILN_FUZZ_ITERS", 400) as usize;
    let mut rng = StdRng::seed_from_u64(env_number("KILN_FUZZ_SEED", 1));
    // The cases' files, removed when the test ends (passed or not).
    let tmp = tempfile::tempdir().unwrap();
    let mut loaded = 0;
    for case in 0..iters {
        let input = mutate(&mut rng, &corpus);
        let probe = tmp.path().join("kiln-fuzz-probe.safetensors");
        if std::fs::write(&probe, &input).is_ok() {
            loaded += usize::from(kiln::runtime::checkpoint::read(&probe).is_ok());
            let _ = std::fs::remove_file(&probe);
        }
        let dir = tmp.path().to_path_buf();
        check("checkpoint", case, input, move |bytes| load_checkpoint(&dir, bytes));
    }
    println!("checkpoints: {iters} cases, {loaded} read");
}
