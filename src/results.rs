//! Benchmark results as files, and the tables the README and the book render from them.
//!
//! Every benchmark writes its figures twice: `target/kiln/NAME.json` (the bench's own rows, for
//! whoever ran it) and a [`Record`] under `benches/results/` named `DATE-BENCH-COMMIT.json`,
//! which says what was measured, on which commit, date, machine and device. The records are the
//! history: older ones stay, and the tables in `README.md` and `docs/src/benchmarks.md` are
//! rendered from the newest record of each kind by `kiln render-docs`, never typed by hand
//! (`tests/docs.rs` fails when a table differs from what its record renders).
//!
//! A table sits in a Markdown file between `<!-- results:NAME -->` and `<!-- /results:NAME -->`;
//! [`render_into`] replaces what is between the markers.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// One benchmark run: what ran, where and when, and its figures.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    /// The benchmark: `memory`, `speed`, `peers`, `gpu-peers`, ...
    pub bench: String,
    /// The commit measured (`git rev-parse --short HEAD`, `-dirty` when the tree had changes).
    pub commit: String,
    /// The date of the run (UTC, `YYYY-MM-DD`).
    pub date: String,
    /// The time of day of the run (UTC, `HH:MM:SS`), which orders a day's records of one bench;
    /// empty in records written before it was kept (they count as the day's earliest).
    #[serde(default)]
    pub time: String,
    /// The machine: CPU model, logical cores and vector extensions.
    pub machine: String,
    /// The device the figures are of: `cpu`, or the GPU with its driver and CUDA version.
    pub device: String,
    /// The bench's figures, as it writes them to `target/kiln/NAME.json`.
    pub data: Value,
}

/// The folder of result records: `KILN_RESULTS_DIR` where set (a machine that runs a built
/// binary away from its checkout), else `benches/results` in the repository.
pub fn results_dir() -> PathBuf {
    match std::env::var_os("KILN_RESULTS_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("benches").join("results"),
    }
}

/// Writes `data` as bench `bench`'s record of today's run on `device` into [`results_dir`], and
/// returns the file's path.
pub fn record(bench: &str, device: &str, data: &impl Serialize) -> std::io::Result<PathBuf> {
    let rec = Record {
        bench: bench.to_string(),
        commit: commit(),
        date: today(),
        time: time_of_day(),
        machine: machine(),
        device: device.to_string(),
        data: serde_json::to_value(data).map_err(std::io::Error::other)?,
    };
    let dir = results_dir();
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{}-{}-{}.json", rec.date, bench, rec.commit));
    let text = serde_json::to_string_pretty(&rec).map_err(std::io::Error::other)?;
    std::fs::write(&path, text + "\n")?;
    Ok(path)
}

/// What every benchmark calls with its figures: writes `target/kiln/BENCH.json` (the figures
/// alone) and the run's [`Record`] under `benches/results/`, and prints both paths.
pub fn write(bench: &str, device: &str, data: &impl Serialize) -> std::io::Result<()> {
    let dir = crate::report::output_dir();
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{bench}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(data).map_err(std::io::Error::other)?)?;
    let rec = record(bench, device, data)?;
    println!("wrote {} and {}", path.display(), rec.display());
    Ok(())
}

/// The commit checked out in the repository, `-dirty` when its tree has uncommitted changes;
/// outside a git checkout, `KILN_COMMIT` where set, else `unknown`.
pub fn commit() -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["rev-parse", "--short", "HEAD"]) {
        Some(c) if !c.is_empty() => {
            let dirty =
                git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
            if dirty { format!("{c}-dirty") } else { c }
        }
        _ => std::env::var("KILN_COMMIT")
            .ok()
            .filter(|c| !c.is_empty())
            .unwrap_or_else(|| "unknown".to_string()),
    }
}

/// Today's date (UTC) as `YYYY-MM-DD`.
pub fn today() -> String {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    civil_date(secs / 86_400)
}

/// The time of day (UTC) as `HH:MM:SS`.
pub fn time_of_day() -> String {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let s = secs % 86_400;
    format!("{:02}:{:02}:{:02}", s / 3_600, s / 60 % 60, s % 60)
}

/// The proleptic Gregorian date of `days` since 1970-01-01 (Howard Hinnant's civil-from-days).
fn civil_date(days: u64) -> String {
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// The machine in words: CPU model, logical cores, and the widest vector extension the CPU has.
pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let flags = cpuinfo.lines().find(|l| l.starts_with("flags")).unwrap_or("");
    let has = |f: &str| flags.split_whitespace().any(|x| x == f);
    let isa = if has("avx512f") {
        ", AVX-512"
    } else if has("avx2") {
        ", AVX2"
    } else {
        ""
    };
    format!("{model}, {cores} cores{isa}")
}

/// Every record in `dir` (files that do not parse as a [`Record`] are older formats: skipped).
pub fn records(dir: &Path) -> std::io::Result<Vec<Record>> {
    let mut out = Vec::new();
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    for p in paths {
        let text = std::fs::read_to_string(&p)?;
        if let Ok(rec) = serde_json::from_str::<Record>(&text) {
            out.push(rec);
        }
    }
    Ok(out)
}

/// The newest record of `bench` (by date, then time of day, then file order), if any.
pub fn latest<'a>(records: &'a [Record], bench: &str) -> Option<&'a Record> {
    records.iter().filter(|r| r.bench == bench).max_by(|a, b| (&a.date, &a.time).cmp(&(&b.date, &b.time)))
}

/// A rendered table: its marker name and its Markdown.
pub struct Rendered {
    /// The marker name (`<!-- results:NAME -->`).
    pub name: &'static str,
    /// The Markdown between the markers.
    pub markdown: String,
}

/// Every table kiln's documents show, rendered from the newest records in `dir`. A table whose
/// record is missing says so instead of showing figures.
pub fn render_all(dir: &Path) -> std::io::Result<Vec<Rendered>> {
    let recs = records(dir)?;
    let t = |name, f: fn(&Record) -> String, bench| Rendered {
        name,
        markdown: latest(&recs, bench)
            .map(f)
            .unwrap_or_else(|| format!("(no `{bench}` record in benches/results yet)\n")),
    };
    Ok(vec![
        t("memory-train", |r| memory_table(r, "train"), "memory"),
        t("memory-forward", |r| memory_table(r, "forward"), "memory"),
        t("speed-cpu-train", |r| speed_table(r, "train"), "speed"),
        t("speed-cpu-forward", |r| speed_table(r, "forward"), "speed"),
        t("gpu-train", |r| gpu_table(r, "train"), "gpu-peers"),
        t("gpu-forward", |r| gpu_table(r, "forward"), "gpu-peers"),
        t("realscale", realscale_table, "realscale"),
        t("realscale-precision", realscale_precision_table, "realscale"),
        t("realscale-forward", forward_table, "forward"),
        t("realscale-training", training_table, "training"),
        t("gpu-training", gpu_training_table, "gpu-training"),
        t("products", products_table, "products"),
    ])
}

/// Replaces the text between each table's markers in `text`; markers absent from `text` are
/// skipped. Errors when a start marker has no end marker.
pub fn render_into(text: &str, tables: &[Rendered]) -> Result<String, String> {
    let mut out = text.to_string();
    for t in tables {
        let start = format!("<!-- results:{} -->", t.name);
        let end = format!("<!-- /results:{} -->", t.name);
        let Some(s) = out.find(&start) else { continue };
        let body = s + start.len();
        let Some(e) = out[body..].find(&end).map(|e| body + e) else {
            return Err(format!("`{start}` has no `{end}` after it"));
        };
        out.replace_range(body..e, &format!("\n{}", t.markdown));
    }
    Ok(out)
}

fn get<'a>(v: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(v, |v, k| v.get(k))
}

fn num(v: &Value, path: &[&str]) -> Option<f64> {
    get(v, path).and_then(Value::as_f64)
}

/// The entries of a record's array of rows (none where it holds no array).
fn entries(data: &Value) -> impl Iterator<Item = &Value> {
    data.as_array().into_iter().flatten()
}

/// A row's per-round ratios (`rounds`), two decimals each, separated by spaces.
fn rounds(v: &Value) -> String {
    let each = v.get("rounds").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_f64);
    each.map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" ")
}

/// Bytes in decimal units, three significant digits: `27.2 KB`, `36.6 MB`, `1.23 GB`.
fn size(bytes: Option<f64>) -> String {
    let Some(b) = bytes else { return "-".to_string() };
    let (v, unit) = match b {
        b if b >= 1e9 => (b / 1e9, "GB"),
        b if b >= 1e6 => (b / 1e6, "MB"),
        b if b >= 1e3 => (b / 1e3, "KB"),
        b => return format!("{b:.0} B"),
    };
    let digits = if v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else {
        2
    };
    format!("{v:.digits$} {unit}")
}

fn ms(t: Option<f64>) -> String {
    t.map_or("-".to_string(), |t| if t < 1.0 { format!("{t:.3}") } else { format!("{t:.2}") })
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => {
            let r = a / b;
            if r >= 0.1 { format!("{r:.2}") } else { format!("{r:.2e}") }
        }
        _ => "-".to_string(),
    }
}

fn markdown_table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut s = format!("| {} |\n", headers.join(" | "));
    s += &format!(
        "|{}\n",
        headers.iter().enumerate().map(|(i, _)| if i == 0 { "---|" } else { "---:|" }).collect::<String>()
    );
    for r in rows {
        s += &format!("| {} |\n", r.join(" | "));
    }
    s
}

fn provenance(r: &Record, how: &str) -> String {
    format!("\n{how}, commit `{}`, {}. Machine: {}. Device: {}.\n", r.commit, r.date, r.machine, r.device)
}

/// The zoo's models first, in the zoo's order, then any other by name.
fn model_order(name: &str) -> (usize, String) {
    let zoo = ["seed-mlp", "mlp", "cnn", "transformer"];
    (zoo.iter().position(|m| *m == name).unwrap_or(zoo.len()), name.to_string())
}

/// The record's rows (its data is an array of them) of `mode` (`train` or `forward`, in any
/// case: benches write their mode names as their enums serialise).
fn rows_in_mode<'a>(r: &'a Record, mode: &str) -> Vec<&'a Value> {
    let rows = r.data.as_array().map(|a| a.iter()).into_iter().flatten();
    rows.filter(|v| v.get("mode").and_then(Value::as_str).is_some_and(|m| m.eq_ignore_ascii_case(mode)))
        .collect()
}

/// The memory table: kiln's plan beside eager allocators, PyTorch's replayed stream and XLA.
fn memory_table(r: &Record, mode: &str) -> String {
    let rows: Vec<Vec<String>> = rows_in_mode(r, mode)
        .into_iter()
        .map(|v| {
            let dev = num(v, &["device_bytes"]);
            let planned = num(v, &["planned_total_bytes"]);
            let torch = num(v, &["pytorch_replayed", "workspace_peak_reserved"]);
            let xla = num(v, &["xla_total_bytes"]);
            vec![
                v.get("model").and_then(Value::as_str).unwrap_or("?").to_string(),
                num(v, &["batch"]).map_or("-".into(), |b| format!("{b}")),
                size(planned),
                size(dev),
                format!(
                    "{:.3}",
                    num(v, &["arena_bytes"]).unwrap_or(0.0)
                        / num(v, &["lower_bound_bytes"]).unwrap_or(1.0).max(1.0)
                ),
                size(num(v, &["eager_bfc_peak_reserved_bytes"])),
                size(torch),
                ratio(dev, torch),
                size(xla),
                ratio(planned, xla),
            ]
        })
        .collect();
    let mut s = markdown_table(
        &[
            "model",
            "batch",
            "kiln planned",
            "kiln device",
            "arena / lower bound",
            "eager BFC reserved",
            "PyTorch reserved",
            "kiln / PyTorch",
            "XLA",
            "kiln / XLA",
        ],
        &rows,
    );
    s += &provenance(r, "`cargo bench --bench memory`");
    s
}

/// The real-scale table: one training step of each architecture, kiln's plan beside PyTorch's
/// replayed stream (eager attention and SDPA) and XLA's buffer assignment for the Flax version
/// (records older than that column show `-`), and the step's plan time.
fn realscale_table(r: &Record) -> String {
    let rows: Vec<Vec<String>> = entries(&r.data)
        .map(|v| {
            let dev = num(v, &["kiln_device_bytes"]);
            let torch = num(v, &["pytorch_reserved_bytes"]);
            let sdpa = num(v, &["pytorch_sdpa_reserved_bytes"]);
            vec![
                v.get("model").and_then(Value::as_str).unwrap_or("?").to_string(),
                num(v, &["batch"]).map_or("-".into(), |b| format!("{b}")),
                size(dev),
                size(torch),
                size(sdpa),
                ratio(dev, torch),
                ratio(dev, sdpa),
                ratio(num(v, &["kiln_eager_caching_reserved_bytes"]), torch),
                size(num(v, &["xla_total_bytes"])),
                ratio(num(v, &["kiln_planned_total_bytes"]), num(v, &["xla_total_bytes"])),
                format!(
                    "{:.3}",
                    num(v, &["kiln_arena_bytes"]).unwrap_or(0.0)
                        / num(v, &["kiln_lower_bound_bytes"]).unwrap_or(1.0).max(1.0)
                ),
                num(v, &["step_gflop"]).map_or("-".into(), |g| format!("{g:.1}")),
                ratio(num(v, &["kiln_product_gflop"]), num(v, &["pytorch_product_gflop"])),
                num(v, &["kiln_plan_ms"]).map_or("-".into(), |t| format!("{:.1} s", t / 1e3)),
            ]
        })
        .collect();
    let mut s = markdown_table(
        &[
            "model",
            "batch",
            "kiln device",
            "PyTorch reserved",
            "PyTorch SDPA",
            "kiln / PyTorch",
            "kiln / SDPA",
            "kiln eager / PyTorch",
            "XLA (Flax)",
            "kiln planned / XLA",
            "arena / lower bound",
            "GFLOP",
            "product FLOPs / 3x PyTorch's forward",
            "plan time",
        ],
        &rows,
    );
    let versions = r.data.as_array().into_iter().flatten().find_map(|v| v.get("xla_versions")?.as_str());
    if let Some(versions) = versions {
        s += &format!(
            "\nXLA: the buffer assignment (argument + output + temp - alias) of the Flax version's \
             jitted step on jaxlib's CPU backend, YNNPACK library fusion off ({versions}).\n"
        );
    }
    s += &provenance(r, "`cargo bench --bench realscale`");
    s
}

/// The real-scale steps in bf16 mixed precision: kiln's f32 and bf16 plans beside PyTorch's
/// AMP bf16 stream (records older than these columns show `-`).
fn realscale_precision_table(r: &Record) -> String {
    let rows: Vec<Vec<String>> = entries(&r.data)
        .map(|v| {
            let half = num(v, &["kiln_bf16_device_bytes"]);
            let amp = num(v, &["pytorch_amp_reserved_bytes"]);
            vec![
                v.get("model").and_then(Value::as_str).unwrap_or("?").to_string(),
                num(v, &["batch"]).map_or("-".into(), |b| format!("{b}")),
                size(num(v, &["kiln_device_bytes"])),
                size(half),
                size(amp),
                ratio(half, amp),
                ratio(num(v, &["kiln_bf16_planned_total_bytes"]), num(v, &["kiln_planned_total_bytes"])),
            ]
        })
        .collect();
    let mut s = markdown_table(
        &[
            "model",
            "batch",
            "kiln f32 device",
            "kiln bf16 device",
            "PyTorch AMP bf16",
            "kiln bf16 / AMP",
            "kiln bf16 / f32",
        ],
        &rows,
    );
    s += "\nkiln bf16: the plan for kernels that read half values (`--precision bf16`); PyTorch AMP bf16: \
          its step under the CUDA autocast lists (`scripts/peers/torch_stream.py --amp bf16`), replayed \
          through the caching-allocator model with cuBLAS's workspaces; bf16 / f32: planned totals.\n";
    s += &provenance(r, "`cargo bench --bench realscale`");
    s
}

/// The forward-pass speed table: kiln beside onnxruntime's CPU provider on the real-scale
/// architectures (`benches/forward.rs`).
fn forward_table(r: &Record) -> String {
    let rows: Vec<Vec<String>> = entries(&r.data)
        .map(|v| {
            vec![
                v.get("model").and_then(Value::as_str).unwrap_or("?").to_string(),
                num(v, &["batch"]).map_or("-".into(), |b| format!("{b}")),
                num(v, &["threads"]).map_or("-".into(), |t| format!("{t}")),
                ms(num(v, &["kiln_ms"])),
                ms(num(v, &["ort_ms"])),
                num(v, &["ratio"]).map_or("-".into(), |x| format!("{x:.2}")),
                rounds(v),
                num(v, &["difference"]).map_or("-".into(), |x| format!("{x:.1e}")),
            ]
        })
        .collect();
    let mut s = markdown_table(
        &[
            "model",
            "batch",
            "threads",
            "kiln ms",
            "onnxruntime ms",
            "kiln / onnxruntime",
            "by round",
            "outputs apart",
        ],
        &rows,
    );
    s += "\nThe same inference export and inputs on both sides, interleaved rounds, the median of the rounds' \
          ratios; outputs apart: the largest difference over onnxruntime's largest magnitude.\n";
    s += &provenance(r, "`cargo bench --bench forward`");
    s
}

/// The real-scale CPU training-step table: kiln beside PyTorch eager and torch.compile
/// (`benches/training.rs`).
fn training_table(r: &Record) -> String {
    let rows: Vec<Vec<String>> = entries(&r.data)
        .map(|v| {
            let compile = match num(v, &["over_compile"]) {
                Some(x) => format!("{x:.2}"),
                None => v.get("compile_note").and_then(Value::as_str).unwrap_or("-").to_string(),
            };
            vec![
                v.get("model").and_then(Value::as_str).unwrap_or("?").to_string(),
                num(v, &["batch"]).map_or("-".into(), |b| format!("{b}")),
                num(v, &["threads"]).map_or("-".into(), |t| format!("{t}")),
                ms(num(v, &["kiln_ms"])),
                ms(num(v, &["torch_eager_ms"])),
                ms(num(v, &["torch_compile_ms"])),
                num(v, &["over_eager"]).map_or("-".into(), |x| format!("{x:.2}")),
                rounds(v),
                compile,
            ]
        })
        .collect();
    let mut s = markdown_table(
        &[
            "model",
            "batch",
            "threads",
            "kiln ms",
            "PyTorch eager ms",
            "torch.compile ms",
            "kiln / eager",
            "by round",
            "kiln / compile",
        ],
        &rows,
    );
    s += "\nOne training step (MSE against a target of the output's shape, gradients, Adam) of the same \
          architecture and batch on both sides: kiln on the training-mode ONNX export, PyTorch on the \
          module it was exported from; kiln / eager is the median of the rounds' ratios, torch.compile \
          is timed once after them.\n";
    s += &provenance(r, "`cargo bench --bench training`");
    s
}

/// The GPU training table: the real-scale steps on one GPU, kiln against PyTorch eager (TF32 off
/// and on) and `torch.compile` (`scripts/gpu/checklist.sh realscale`, `scripts/gpu/results.py
/// --realscale`). A run that failed shows its cause under the table.
fn gpu_training_table(r: &Record) -> String {
    let models = r.data.get("models").and_then(Value::as_object);
    let order = |name: &str| {
        let known = ["resnet50", "efficientnet_b0", "mobilenet_v3_small", "vit_b_16", "gpt2", "bert"];
        (known.iter().position(|m| *m == name).unwrap_or(known.len()), name.to_string())
    };
    let mut models: Vec<(&String, &Value)> = models.into_iter().flatten().collect();
    models.sort_by_key(|(name, _)| order(name));
    let mut failures = String::new();
    let rows: Vec<Vec<String>> = models
        .into_iter()
        .map(|(name, v)| {
            for (field, who) in [
                ("kiln_error", "kiln"),
                ("torch_eager_error", "PyTorch eager"),
                ("torch_eager_tf32_error", "PyTorch eager, TF32"),
                ("torch_compile_error", "torch.compile"),
            ] {
                if let Some(why) = v.get(field).and_then(Value::as_str) {
                    failures += &format!("- {name}, {who}: {}\n", why.replace('`', "'"));
                }
            }
            let kiln = num(v, &["kiln_ms"]);
            let (eager, compile) = (num(v, &["torch_eager_ms"]), num(v, &["torch_compile_ms"]));
            vec![
                name.clone(),
                num(v, &["batch"]).map_or("-".into(), |b| format!("{b}")),
                ms(kiln),
                ms(eager),
                ms(num(v, &["torch_eager_tf32_ms"])),
                ms(compile),
                ratio(kiln, eager),
                ratio(kiln, compile),
            ]
        })
        .collect();
    let mut s = markdown_table(
        &[
            "model",
            "batch",
            "kiln ms",
            "PyTorch eager ms",
            "eager, TF32 ms",
            "torch.compile ms",
            "kiln / eager",
            "kiln / compile",
        ],
        &rows,
    );
    if !failures.is_empty() {
        s += &format!("\nRuns that gave no time:\n\n{failures}");
    }
    if let Some(method) = r.data.get("method").and_then(Value::as_str) {
        s += &format!("\nMethod: {method}.\n");
    }
    s += &provenance(r, "`scripts/gpu/checklist.sh realscale`");
    s
}

/// The product table: kiln's CPU products shape by shape against one core's measured FMA peak
/// (`benches/products.rs`).
fn products_table(r: &Record) -> String {
    let rows: Vec<Vec<String>> = r
        .data
        .get("rows")
        .and_then(Value::as_array)
        .map(|a| a.iter())
        .into_iter()
        .flatten()
        .map(|v| {
            let fraction = num(v, &["fraction_of_peak"]);
            let goal = match (v.get("large").and_then(Value::as_bool), fraction) {
                (Some(true), Some(f)) if f >= 0.8 => "met",
                (Some(true), Some(_)) => "below",
                _ => "-",
            };
            vec![
                v.get("product").and_then(Value::as_str).unwrap_or("?").to_string(),
                v.get("shape").and_then(Value::as_str).unwrap_or("?").to_string(),
                num(v, &["fmas"]).map_or("-".into(), |f| format!("{:.0}M", f / 1e6)),
                ms(num(v, &["ms"])),
                num(v, &["gfma_per_s"]).map_or("-".into(), |x| format!("{x:.1}")),
                fraction.map_or("-".into(), |x| format!("{x:.2}")),
                goal.to_string(),
            ]
        })
        .collect();
    let mut s = markdown_table(
        &["product", "shape", "multiply-adds", "ms", "GFMA/s", "of peak", "goal (large: ≥ 0.8)"],
        &rows,
    );
    let peak = num(&r.data, &["peak_gfma_per_s_per_core"]).map_or("-".into(), |p| format!("{p:.1}"));
    let isa = r.data.get("isa").and_then(Value::as_str).unwrap_or("?");
    let threads = num(&r.data, &["threads"]).map_or("-".into(), |t| format!("{t}"));
    s += &format!(
        "\nOne op compiled alone, median of its runs on {threads} thread(s); of peak: against one core's \
         measured FMA peak, {peak} GFMA/s ({isa}), times the threads. Large: at least 10^8 multiply-adds.\n"
    );
    s += &provenance(r, "`cargo bench --bench products`");
    s
}

/// The CPU speed table: kiln beside JAX jit, PyTorch eager and torch.compile.
fn speed_table(r: &Record, mode: &str) -> String {
    let rows: Vec<Vec<String>> = rows_in_mode(r, mode)
        .into_iter()
        .map(|v| {
            vec![
                v.get("model").and_then(Value::as_str).unwrap_or("?").to_string(),
                num(v, &["batch"]).map_or("-".into(), |b| format!("{b}")),
                ms(num(v, &["kiln_ms"])),
                ms(num(v, &["jax_ms"])),
                ms(num(v, &["torch_ms"])),
                ms(num(v, &["torch_compile_ms"])),
                num(v, &["kiln_over_fastest_peer"]).map_or("-".into(), |x| format!("{x:.2}")),
            ]
        })
        .collect();
    let mut s = markdown_table(
        &[
            "model",
            "batch",
            "kiln ms",
            "JAX jit ms",
            "PyTorch eager ms",
            "torch.compile ms",
            "kiln / fastest peer",
        ],
        &rows,
    );
    s += &provenance(r, "`cargo bench --bench speed` (medians of interleaved rounds)");
    s
}

/// The GPU table: kiln's plan beside PyTorch eager and JAX jit on one GPU, time and memory.
fn gpu_table(r: &Record, mode: &str) -> String {
    let models = r.data.get("models").and_then(Value::as_object);
    let mut models: Vec<(&String, &Value)> = models.into_iter().flatten().collect();
    models.sort_by_key(|(name, _)| model_order(name));
    let rows: Vec<Vec<String>> = models
        .into_iter()
        .filter_map(|(name, m)| {
            let m = m.get(mode)?;
            let kiln = num(m, &["kiln", "step_ms"]);
            let torch = num(m, &["torch", "step_ms"]);
            let jax = num(m, &["jax", "step_ms"]);
            let fastest = [torch, jax].into_iter().flatten().reduce(f64::min);
            let planned = num(m, &["kiln", "planned_total_bytes"]);
            let torch_alloc = num(m, &["torch", "max_memory_allocated"]);
            let xla = num(m, &["jax", "xla_total_bytes"]);
            Some(vec![
                name.clone(),
                ms(kiln),
                ms(torch),
                ms(jax),
                ratio(kiln, fastest),
                size(planned),
                size(torch_alloc),
                size(num(m, &["torch", "max_memory_reserved"])),
                size(xla),
                ratio(planned, torch_alloc),
                ratio(planned, xla),
            ])
        })
        .collect();
    let mut s = markdown_table(
        &[
            "model",
            "kiln ms",
            "PyTorch ms",
            "JAX ms",
            "kiln / fastest",
            "kiln planned",
            "PyTorch allocated",
            "PyTorch reserved",
            "XLA",
            "kiln / PyTorch allocated",
            "kiln / XLA",
        ],
        &rows,
    );
    s += &provenance(r, "`kiln bench-gpu` and `scripts/gpu/peers.py`");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_date(0), "1970-01-01");
        assert_eq!(civil_date(11_016), "2000-02-29");
        assert_eq!(civil_date(20_785), "2026-11-28");
    }

    /// A day's records of one bench: the latest time of day wins, whatever the commits' names
    /// (file order sorts them by hash); a record without a time is the day's earliest.
    #[test]
    fn the_latest_record_of_a_day_is_the_latest_run() {
        let rec = |commit: &str, date: &str, time: &str| Record {
            bench: "memory".into(),
            commit: commit.into(),
            date: date.into(),
            time: time.into(),
            machine: String::new(),
            device: "cpu".into(),
            data: Value::Null,
        };
        let records = [
            rec("0aaaaaa", "2026-11-28", "07:30:00"),
            rec("fffffff", "2026-11-28", ""),
            rec("bbbbbbb", "2026-11-28", "06:00:00"),
            rec("ccccccc", "2026-11-27", "23:59:59"),
        ];
        assert_eq!(latest(&records, "memory").map(|r| r.commit.as_str()), Some("0aaaaaa"));
        assert!(latest(&records, "speed").is_none());
        assert!(time_of_day().len() == 8 && time_of_day().as_bytes()[2] == b':');
    }

    #[test]
    fn markers_are_replaced_and_an_unclosed_one_is_an_error() {
        let t = [Rendered { name: "x", markdown: "new\n".into() }];
        let text = "a\n<!-- results:x -->\nold\n<!-- /results:x -->\nb\n";
        assert_eq!(render_into(text, &t).unwrap(), "a\n<!-- results:x -->\nnew\n<!-- /results:x -->\nb\n");
        assert!(render_into("<!-- results:x -->", &t).is_err());
        assert_eq!(render_into("none", &t).unwrap(), "none");
    }

    /// The GPU training table: ratios from the figures, models in the architectures' order, and
    /// a run that gave no time named with its cause instead of a figure.
    #[test]
    fn the_gpu_training_table_shows_ratios_and_names_failures() {
        let data = serde_json::json!({
            "method": "m",
            "models": {
                "vit_b_16": {"batch": 16, "kiln_ms": 90.0, "torch_eager_ms": 60.0, "torch_compile_ms": 45.0},
                "resnet50": {"batch": 32, "kiln_ms": 30.0, "torch_eager_ms": 40.0},
                "bert": {"batch": 8, "kiln_error": "not supported: `Cast`", "torch_eager_ms": 37.0}
            }
        });
        let r = Record {
            bench: "gpu-training".into(),
            commit: "abc1234".into(),
            date: "2026-11-29".into(),
            time: String::new(),
            machine: "host".into(),
            device: "gpu".into(),
            data,
        };
        let table = gpu_training_table(&r);
        let rows: Vec<&str> = table.lines().filter(|l| l.starts_with("| ")).skip(1).collect();
        assert!(rows[0].starts_with("| resnet50 | 32 | 30.00 | 40.00 | - | - | 0.75 | - |"), "{table}");
        assert!(
            rows[1].starts_with("| vit_b_16 | 16 | 90.00 | 60.00 | - | 45.00 | 1.50 | 2.00 |"),
            "{table}"
        );
        assert!(rows[2].starts_with("| bert | 8 | - | 37.00 |"), "{table}");
        assert!(table.contains("- bert, kiln: not supported: 'Cast'"), "{table}");
        assert!(table.contains("commit `abc1234`"), "{table}");
    }
}
