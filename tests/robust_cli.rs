//! The command line with bad flags: every mistake must end with a message on stderr and a nonzero
//! exit status (not a signal), and nothing may panic. A few well-formed variants (sizes written
//! `1e3MB`, `2 MiB`, ...) must succeed. Prints "CLI probes tried N, panics 0".

use std::process::Command;

const KILN: &str = env!("CARGO_BIN_EXE_kiln");

/// Mistakes: (arguments, a piece of the message that must be on stderr).
const MISTAKES: &[(&[&str], &str)] = &[
    (&["frobnicate"], "unrecognized subcommand"),
    (&["--nonsense"], "unexpected argument"),
    (&["bench-gpu", "extra"], "unexpected argument"),
    (&["bench-gemm", "--shapes", "1,2"], "not a product M,K,N"),
    (&["bench-gemm", "--shapes", "4096,0,4096"], "not a product M,K,N"),
    (&["bench-gemm", "--shapes", "a,b,c;1,1,1"], "not a product M,K,N"),
    (&["bench-gemm", "--shapes", "1,2,3,4"], "not a product M,K,N"),
    (&["bench-gemm", "--precision", "f8"], "--precision f8"),
    (&["memory"], "MODEL"),
    (&["memory", "nope"], "no zoo model `nope`"),
    (&["memory", "seed-mlp", "--mode", "bad"], "no mode `bad`"),
    (&["memory", "seed-mlp", "--batch", "0"], "--batch 0"),
    (&["memory", "mlp", "--batch", "0", "--mode", "forward"], "--batch 0"),
    (&["memory", "seed-mlp", "--batch", "-3"], "unexpected argument"),
    (&["memory", "seed-mlp", "--batch", "1e3"], "invalid value"),
    (&["memory", "seed-mlp", "--batch", "99999999999"], "above kiln's limit of 1 TiB per tensor"),
    (&["memory", "seed-mlp", "--batch", "18446744073709551615"], "more bytes than a usize can count"),
    (&["memory", "seed-mlp", "--batch", "18446744073709551616"], "invalid value"),
    (&["memory", "transformer", "--batch", "4611686018427387904"], "error"),
    (&["devices", "--limit", "cpu:0=0.5B"], "not a whole number of bytes"),
    (&["devices", "--limit", "cpu:0=-0GB"], "never negative"),
    (&["devices", "--limit", "cpu:0=-1"], "never negative"),
    (&["devices", "--limit", "cpu:0=NaN"], "unknown unit"),
    (&["devices", "--limit", "cpu:0=inf"], "unknown unit"),
    (&["devices", "--limit", "cpu:0=1e400"], "not a finite number"),
    (&["devices", "--limit", "cpu:0=99999999999TB"], "the most a usize counts"),
    (&["devices", "--limit", "cpu:0=18446744073709551616"], "the most a usize counts"),
    (&["devices", "--limit", "cpu:0="], "it is empty"),
    (&["devices", "--limit", "cpu:0=12XB"], "unknown unit `XB`"),
    (&["devices", "--limit", "cpu:0"], "is not DEVICE=VALUE"),
    (&["devices", "--limit", "="], "it is empty"),
    (&["devices", "--limit", "gpu:9=1GB"], "no physical device `gpu:9`"),
    (&["devices", "--limit", "cpu:0=0"], "a memory limit of 0 bytes"),
    (&["devices", "--limit", "cpu:0=1TiB", "--limit", "cpu:0=100000TB"], "exceeds the device's"),
    (&["devices", "--fraction", "cpu:0=NaN"], "must be in (0, 1], got NaN"),
    (&["devices", "--fraction", "cpu:0=1.5"], "must be in (0, 1], got 1.5"),
    (&["devices", "--fraction", "cpu:0=-0.1"], "must be in (0, 1]"),
    (&["devices", "--fraction", "cpu:0=abc"], "is not a fraction"),
    (&["devices", "--fraction", "cpu:0=0.5", "--growth", "cpu:0"], "exclude each other"),
    (&["devices", "--growth", "nope"], "set_memory_growth(\"nope\", ..): no physical device `nope`"),
    (
        &["devices", "--logical", "cpu:0=18446744073709551615,18446744073709551615"],
        "more bytes than a usize counts",
    ),
    (&["devices", "--logical", "cpu:0=0"], "logical device(s) [0]"),
    (&["devices", "--logical", "cpu:0=1GB,,2GB"], "it is empty"),
    (&["devices", "--logical", "cpu:0=1GB,-2GB"], "never negative"),
    (&["devices", "--logical", "nope=1GB"], "no physical device `nope`"),
    (&["torch-stream", "/nonexistent/ts.json"], "cannot read /nonexistent/ts.json"),
    (&["devices", "--visible", "gpu:9"], "no physical device `gpu:9`"),
    (&["devices", "--visible", "cpu:0,cpu:0"], "named twice"),
    (&["torch-stream", "Cargo.toml"], "not a torch_stream.py recording"),
    (&["memory", "/nonexistent/m.onnx"], "cannot read the model /nonexistent/m.onnx"),
    (&["train", "/nonexistent/m.onnx"], "cannot read the model /nonexistent/m.onnx"),
    (&["train", "README.md"], "not an ONNX model"),
    (&["train", "README.md", "--batch", "0"], "--batch 0"),
    (&["train", "README.md", "--steps", "-1"], "unexpected argument"),
    (&["train", "README.md", "--dim", "N"], "write NAME=N"),
    (&["train", "README.md", "--data", "/nonexistent.safetensors"], "cannot read"),
    (&["run", "/nonexistent/m.onnx"], "cannot read"),
    (&["run", "README.md"], "not an ONNX model"),
    (&["run", "README.md", "--bench", "0"], "--bench 0"),
    (&["run", "README.md", "--profile", "0"], "--profile 0"),
    (&["run", "README.md", "--threads", "0"], "--threads 0"),
    (&["run", "README.md", "--device", "tpu"], "unknown device `tpu`"),
    (&["run", "README.md", "--dim", "N"], "write NAME=N"),
    (&["run", "README.md", "--batch", "0"], "--batch 0"),
    (&["run", "README.md", "--input", "/nonexistent.npz"], "cannot read"),
    (&["run", "README.md", "--precision", "f8"], "unknown precision"),
    (&["memory", "seed-mlp", "--device", "gpu:0=1GB"], "--device is read for ONNX models"),
    (&["memory", "/nonexistent/m.onnx", "--device", "gpu:0"], "cannot read the model"),
    (&["memory", "seed-mlp", "--pytorch-stream", "/nonexistent.json"], "cannot read the recorded stream"),
    (&["memory", "seed-mlp", "--pytorch-stream", "Cargo.toml"], "not a torch_stream.py recording"),
    (
        &["memory", "seed-mlp", "--pytorch-stream", "benches/data/torch_stream.json:gpt9"],
        "has no model `gpt9`",
    ),
    (&["memory", "seed-mlp", "--pytorch-stream", "/nonexistent/a:b.json"], "stream /nonexistent/a:b.json"),
    (&["memory", "seed-mlp", "--mode", "forward", "--pytorch-stream", "Cargo.toml"], "pass --mode train"),
    (
        &["memory", "seed-mlp", "--batch", "3", "--pytorch-stream", "benches/data/torch_stream.json"],
        "a batch of its own",
    ),
];

/// Well-formed invocations that must succeed (quickly: no training).
const ACCEPTED: &[&[&str]] = &[
    &["devices", "--limit", "cpu:0=1e3MB"],
    &["devices", "--limit", "cpu:0=2 MiB"],
    &["devices", "--limit", "cpu:0=512"],
    &["devices", "--logical", "cpu:0=1.5MiB,4MB,2048KB"],
    &["devices", "--fraction", "cpu:0=0.5"],
    &["memory", "seed-mlp", "--batch", "3", "--mode", "forward"],
    &["memory", "seed-mlp", "--pytorch-stream", "benches/data/torch_stream.json"],
    &["torch-stream"],
];

fn run(args: &[&str]) -> (Option<i32>, String) {
    let out =
        Command::new(KILN).args(args).env_remove("RUST_BACKTRACE").output().expect("the kiln binary runs");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn no_panic(args: &[&str], stderr: &str) -> Result<(), String> {
    if stderr.contains("panicked") || stderr.contains("RUST_BACKTRACE") {
        return Err(format!("kiln {args:?} panicked:\n{stderr}"));
    }
    Ok(())
}

#[test]
fn bad_flags_fail_cleanly_with_a_message() {
    let mut failures = Vec::new();
    let mut panics = 0;
    let mut tried = 0;
    for (args, expect) in MISTAKES {
        tried += 1;
        let (code, stderr) = run(args);
        if let Err(e) = no_panic(args, &stderr) {
            panics += 1;
            failures.push(e);
            continue;
        }
        match code {
            Some(0) => {
                failures.push(format!("kiln {args:?} succeeded; expected an error containing {expect:?}"))
            }
            None => failures.push(format!("kiln {args:?} was killed by a signal:\n{stderr}")),
            Some(_) if !stderr.contains(expect) => {
                failures.push(format!("kiln {args:?}: stderr lacks {expect:?}:\n{stderr}"))
            }
            Some(_) => {}
        }
    }
    for args in ACCEPTED {
        tried += 1;
        let (code, stderr) = run(args);
        if let Err(e) = no_panic(args, &stderr) {
            panics += 1;
            failures.push(e);
        } else if code != Some(0) {
            failures.push(format!("kiln {args:?} failed ({code:?}):\n{stderr}"));
        }
    }
    eprintln!("CLI probes tried {tried}, panics {panics}");
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// `kiln bench-gpu` asked for explicitly with no usable CUDA device: "skipped: no CUDA device
/// (<reason>)" on stderr and status 2. (Where a GPU works, the benchmark would run: not here.)
#[test]
fn bench_gpu_without_a_device_says_skipped_and_fails() {
    if let Ok(d) = kiln::runtime::cuda::probe().usable() {
        eprintln!(
            "a CUDA device is present ({}): `kiln bench-gpu` would run the benchmark; not probed",
            d.name
        );
        return;
    }
    let (code, stderr) = run(&["bench-gpu"]);
    assert!(no_panic(&["bench-gpu"], &stderr).is_ok(), "{stderr}");
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("skipped: no CUDA device ("), "{stderr}");
}

/// A reader that closes the pipe early (`kiln devices | head -1`) ends kiln quietly, never with
/// a panic on the broken pipe.
#[test]
fn a_closed_stdout_pipe_is_no_panic() {
    use std::process::Stdio;
    let mut child = Command::new(KILN)
        .args(["memory", "seed-mlp", "--mode", "forward"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the kiln binary runs");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("kiln ends");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn the_main_job_prints_each_epoch_once_when_stdout_is_not_a_terminal() {
    for args in [&[][..], &["--quiet"][..]] {
        let out = Command::new(KILN).args(args).output().expect("run kiln");
        assert!(out.status.success(), "kiln {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let epoch_lines = text.lines().filter(|l| l.to_lowercase().starts_with("epoch ")).count();
        assert_eq!(epoch_lines, 5, "kiln {args:?} should print 5 epoch lines, printed:\n{text}");
    }
}

/// Runs kiln with its address space limited to `bytes` (RLIMIT_AS): an allocation the limit
/// refuses must end in an error, never an abort.
#[cfg(unix)]
fn run_limited(args: &[&str], bytes: u64) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(KILN);
    cmd.args(args).env_remove("RUST_BACKTRACE");
    // SAFETY: the closure runs in the child between fork and exec and calls only setrlimit,
    // which is async-signal-safe; the struct it passes lives on the closure's stack.
    unsafe {
        cmd.pre_exec(move || {
            let limit = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    cmd.output().expect("the kiln binary runs")
}

#[cfg(unix)]
#[test]
fn a_batch_too_large_for_the_host_is_an_error_not_an_abort() {
    for args in [
        &["memory", "cnn", "--batch", "100000"][..],
        &["memory", "mlp", "--batch", "4000000", "--mode", "forward"][..],
    ] {
        let out = run_limited(args, 4_000_000_000);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(1),
            "kiln {args:?} should fail with an error, got {:?}:\n{stderr}",
            out.status
        );
        assert!(
            stderr.contains("out of memory") || stderr.contains("cannot allocate"),
            "kiln {args:?}:\n{stderr}"
        );
        assert!(
            !stderr.contains("panicked") && !stderr.contains("memory allocation of"),
            "kiln {args:?}:\n{stderr}"
        );
    }
}

/// `kiln memory --pytorch-stream`: the recorded stream replayed beside the plan, its reserved
/// peak the committed recording's own for the zoo model named.
#[test]
fn memory_replays_a_recorded_stream_beside_the_plan() {
    let out = Command::new(KILN)
        .args(["memory", "seed-mlp", "--pytorch-stream", "benches/data/torch_stream.json"])
        .output()
        .expect("the kiln binary runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let replayed = kiln::torch_stream::committed_figures("seed-mlp").unwrap().expect("seed-mlp is recorded");
    let line =
        stdout.lines().find(|l| l.starts_with("eager: PyTorch's recorded stream")).expect("the replay line");
    let reserved = format!("reserved {} B", kiln::report::bytes(replayed.peak_reserved));
    assert!(line.contains("seed-mlp") && line.contains(&reserved), "{line}");
}
