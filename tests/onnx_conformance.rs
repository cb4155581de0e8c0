//! ONNX's backend node tests (`onnx/backend/test/data/node` of the `onnx` package, installed by
//! `scripts/test.sh` into `.onnx/` and named by `KILN_ONNX_DATA`): every test's model is
//! imported, planned and run on the CPU backend with the test's inputs, and its outputs compared
//! with the test's expected outputs. Each test is passed, unsupported (the importer or compiler
//! says which op, attribute or dtype it does not support) or FAILED (a wrong value, or any other
//! error); a panic anywhere fails the test, as does any FAILED case or fewer passes than `FLOOR`.
//!
//! Integer and boolean graph inputs (shape, axes and index arguments, masks) are given to the
//! importer as initializers holding the test's values, as exporters write such arguments (the
//! summary counts the passes that rely on it); tests with other non-float inputs, or any
//! non-float output, are unsupported by dtype (kiln's tensors are f32).
//!
//! `cargo test --release --test onnx_conformance -- --nocapture` prints the summary.

use kiln::compiler::CompileError;
use kiln::onnx::import;
use kiln::onnx::proto::*;
use kiln::prelude::*;
use prost::Message;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The fewest node tests that must pass (what the importer reached; raise it with coverage).
const FLOOR: usize = 604;

/// Relative and absolute tolerance of a float output.
const TOLERANCE: f32 = 1e-4;

enum Outcome {
    /// With whether integer or boolean inputs were folded into the model.
    Passed(bool),
    /// Why, and the key it is counted under (the op, or "dtype", "opset", ...).
    Unsupported(String, String),
    Failed(String),
}

fn data_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("KILN_ONNX_DATA")?).join("node");
    dir.is_dir().then_some(dir)
}

fn read_tensor(path: &Path) -> Result<TensorProto, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    TensorProto::decode(bytes.as_slice()).map_err(|e| format!("{} is not a TensorProto: {e}", path.display()))
}

/// `prefix_0.pb`, `prefix_1.pb`, ... of a test data set, in order.
fn numbered(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    (0..).map(|i| dir.join(format!("{prefix}_{i}.pb"))).take_while(|p| p.is_file()).collect()
}

fn elem_type(v: &ValueInfoProto) -> Option<i32> {
    v.r#type.as_ref()?.tensor_type.as_ref().map(|t| t.elem_type.unwrap_or(0))
}

/// A float tensor's values from its protobuf (raw little-endian data or `float_data`).
fn floats(t: &TensorProto) -> Vec<f32> {
    match t.raw_data.as_deref() {
        Some(raw) if !raw.is_empty() => {
            raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        }
        _ => t.float_data.clone(),
    }
}

fn dims(t: &TensorProto) -> Vec<usize> {
    t.dims.iter().map(|&d| usize::try_from(d).unwrap_or(usize::MAX)).collect()
}

fn key_of(e: &kiln::Error) -> String {
    let text = e.to_string();
    // "node `name` (Op): ..." names the op; other messages are keyed by their first words.
    if let Some(op) = text.split_once(" (").and_then(|(_, rest)| rest.split_once(')')).map(|(op, _)| op)
        && text.starts_with("not supported: node")
    {
        return op.to_string();
    }
    if text.contains("opset") {
        return "opset".into();
    }
    if text.contains("element type") || text.contains("dtype") {
        return "dtype".into();
    }
    text.lines().next().unwrap_or("").chars().take(60).collect()
}

fn classify(e: kiln::Error) -> Outcome {
    match &e {
        kiln::Error::Compile(c) if matches!(**c, CompileError::Unsupported { .. }) => {
            Outcome::Unsupported(key_of(&e), e.to_string())
        }
        _ => Outcome::Failed(format!("error: {e}")),
    }
}

fn run_case(dir: &Path) -> Outcome {
    let bytes = match std::fs::read(dir.join("model.onnx")) {
        Ok(b) => b,
        Err(e) => return Outcome::Failed(format!("cannot read model.onnx: {e}")),
    };
    let mut model = match ModelProto::decode(bytes.as_slice()) {
        Ok(m) => m,
        Err(_) => {
            // The importer must say so too.
            return match import(&bytes, &[]) {
                Ok(_) => Outcome::Failed("the model does not decode but imports".into()),
                Err(e) => classify(e),
            };
        }
    };
    let Some(graph) = model.graph.as_mut() else { return Outcome::Failed("no graph".into()) };
    // A drawn value is the generator's: kiln's (a function of seed, step and index) is not the
    // reference's, so such a test's outputs cannot be compared (the import is checked above
    // them in `onnx_train.rs`).
    let random = [
        "RandomUniformLike",
        "RandomUniform",
        "RandomNormal",
        "RandomNormalLike",
        "Bernoulli",
        "Multinomial",
    ];
    if graph.node.iter().any(|n| n.op_type.as_deref().is_some_and(|o| random.contains(&o))) {
        return Outcome::Unsupported(
            "random values".into(),
            "draws from a generator: kiln's values are not the reference's".into(),
        );
    }
    let set = dir.join("test_data_set_0");
    let (input_files, output_files) = (numbered(&set, "input"), numbered(&set, "output"));
    let initialised: Vec<String> = graph.initializer.iter().filter_map(|i| i.name.clone()).collect();
    let fed: Vec<usize> = (0..graph.input.len())
        .filter(|&i| !initialised.iter().any(|n| Some(n) == graph.input[i].name.as_ref()))
        .collect();
    // Types first: a sequence, optional, bool, double, ... input or output is unsupported.
    for &i in &fed {
        match elem_type(&graph.input[i]) {
            Some(FLOAT) | Some(INT64) | Some(INT32) | Some(BOOL) => {}
            t => return Outcome::Unsupported("dtype".into(), format!("input of element type {t:?}")),
        }
    }
    for o in &graph.output {
        if elem_type(o) != Some(FLOAT) {
            return Outcome::Unsupported(
                "dtype".into(),
                format!("output of element type {:?}", elem_type(o)),
            );
        }
    }
    if input_files.len() != fed.len() || output_files.len() != graph.output.len() {
        return Outcome::Failed(format!(
            "{} inputs and {} outputs in the data for {} and {} in the graph",
            input_files.len(),
            output_files.len(),
            fed.len(),
            graph.output.len()
        ));
    }
    let mut feeds = Vec::new();
    let mut sizes = Vec::new();
    let mut folded = false;
    for (&i, file) in fed.iter().zip(&input_files) {
        let mut t = match read_tensor(file) {
            Ok(t) => t,
            Err(e) => return Outcome::Failed(e),
        };
        let input = &mut graph.input[i];
        let name = input.name.clone().unwrap_or_default();
        if elem_type(input) != Some(FLOAT) {
            // An integer argument: an initializer with the test's values.
            t.name = Some(name);
            graph.initializer.push(t);
            folded = true;
            continue;
        }
        let shape = dims(&t);
        // Symbolic axes take the data's sizes by name; axes without any size take them in place.
        if let Some(tt) = input.r#type.as_mut().and_then(|ty| ty.tensor_type.as_mut()) {
            let declared = tt.shape.get_or_insert_with(Default::default);
            if declared.dim.len() != shape.len() {
                declared.dim =
                    shape.iter().map(|&d| Dimension { dim_value: Some(d as i64), dim_param: None }).collect();
            }
            for (d, &size) in declared.dim.iter_mut().zip(&shape) {
                match d.dim_param.as_deref() {
                    Some(p) if !p.is_empty() && d.dim_value.is_none() => sizes.push((p.to_string(), size)),
                    _ => *d = Dimension { dim_value: Some(size as i64), dim_param: None },
                }
            }
        }
        match HostTensor::new(Shape::new(shape), floats(&t)) {
            Ok(h) => feeds.push((name, h)),
            Err(e) => return Outcome::Failed(format!("input `{name}`: {e}")),
        }
    }
    let outputs: Vec<String> = graph.output.iter().map(|o| o.name.clone().unwrap_or_default()).collect();
    let imported = match import(&model.encode_to_vec(), &sizes) {
        Ok(i) => i,
        Err(e) => return classify(e),
    };
    let plan = match compile(imported.graph, &CompileOptions::default()) {
        Ok(p) => p,
        Err(e) => return classify(kiln::Error::from(e)),
    };
    let mut cpu = CpuBackend::new(0);
    let run = (|| {
        let id = cpu.load(plan)?;
        for (key, value) in &imported.weights {
            cpu.write_variable(key, value)?;
        }
        let feeds: Vec<(&str, &HostTensor)> = feeds.iter().map(|(n, t)| (n.as_str(), t)).collect();
        cpu.call(id, &feeds)
    })();
    let results = match run {
        Ok(r) => r,
        Err(e) => return Outcome::Failed(format!("run: {e}")),
    };
    for (name, file) in outputs.iter().zip(&output_files) {
        let want = match read_tensor(file) {
            Ok(t) => t,
            Err(e) => return Outcome::Failed(e),
        };
        let Some((_, got)) = results.iter().find(|(n, _)| n == name) else {
            return Outcome::Failed(format!("no output `{name}`"));
        };
        if got.shape().dims() != dims(&want).as_slice() {
            return Outcome::Failed(format!("output `{name}` has shape {} for {:?}", got.shape(), want.dims));
        }
        let want = floats(&want);
        if want.len() != got.data().len() {
            return Outcome::Failed(format!("output `{name}`: {} expected values", want.len()));
        }
        for (i, (&g, &w)) in got.data().iter().zip(&want).enumerate() {
            let close = if w.is_nan() {
                g.is_nan()
            } else if w.is_infinite() {
                g == w
            } else {
                (g - w).abs() <= TOLERANCE * (1.0 + w.abs())
            };
            if !close {
                return Outcome::Failed(format!("output `{name}` element {i}: {g} vs {w}"));
            }
        }
    }
    Outcome::Passed(folded)
}

#[test]
fn onnx_node_tests() {
    let Some(root) = data_dir() else {
        let why = "no ONNX test data: set KILN_ONNX_DATA to onnx/backend/test/data of the onnx package \
                   (scripts/test.sh installs it into .onnx/)";
        if std::env::var("KILN_REQUIRE_ONNX_DATA").is_ok_and(|v| v == "1") {
            panic!("KILN_REQUIRE_ONNX_DATA=1 but {why}");
        }
        eprintln!("skipped: {why}");
        return;
    };
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&root)
        .expect("the node test directory reads")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("model.onnx").is_file())
        .collect();
    cases.sort();
    assert!(cases.len() > 100, "only {} node tests under {}", cases.len(), root.display());
    let only = std::env::var("KILN_ONNX_ONLY").ok();
    let (mut passed, mut failed, mut panicked) = (Vec::new(), Vec::new(), Vec::new());
    let mut folded_passes = 0;
    let mut unsupported: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let start = std::time::Instant::now();
    for dir in &cases {
        let name = dir.file_name().unwrap_or_default().to_string_lossy().into_owned();
        if only.as_ref().is_some_and(|o| !name.contains(o.as_str())) {
            continue;
        }
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_case(dir))) {
            Ok(Outcome::Passed(folded)) => {
                folded_passes += usize::from(folded);
                passed.push(name)
            }
            Ok(Outcome::Unsupported(key, why)) => {
                if only.is_some() {
                    eprintln!("{name}: unsupported: {why}");
                }
                unsupported.entry(key).or_default().push(name)
            }
            Ok(Outcome::Failed(why)) => failed.push(format!("{name}: {why}")),
            Err(_) => panicked.push(name),
        }
    }
    let total_unsupported: usize = unsupported.values().map(Vec::len).sum();
    let mut keys: Vec<(&String, usize)> = unsupported.iter().map(|(k, v)| (k, v.len())).collect();
    keys.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    println!(
        "onnx node tests ({}): {} passed, {total_unsupported} unsupported, {} FAILED, {} panicked of {} in {:.1} s",
        root.display(),
        passed.len(),
        failed.len(),
        panicked.len(),
        cases.len(),
        start.elapsed().as_secs_f64()
    );
    println!(
        "passed ({folded_passes} with integer or boolean inputs folded as initializers): {}",
        passed.join(" ")
    );
    let keys: Vec<String> = keys.iter().map(|(k, n)| format!("{k} {n}")).collect();
    println!("unsupported by op or cause: {}", keys.join(", "));
    for f in &failed {
        println!("FAILED {f}");
    }
    assert!(panicked.is_empty(), "panics in {panicked:?}");
    assert!(failed.is_empty(), "{} node tests FAILED:\n{}", failed.len(), failed.join("\n"));
    assert!(
        only.is_some() || passed.len() >= FLOOR,
        "{} node tests passed, below the floor of {FLOOR}",
        passed.len()
    );
}

/// The nine real architectures of `onnx/backend/test/data/light` (AlexNet, DenseNet-121,
/// Inception v1 and v2, ResNet-50, ShuffleNet, SqueezeNet, VGG-19, ZFNet-512: their weights
/// replaced by constants), each imported, planned and run on the CPU with the input ONNX's own
/// runner feeds them (`arange(n) / n`, symbolic axes of size 1), against the reference outputs
/// beside them: every element within 1e-3 of the output's largest magnitude.
#[test]
fn light_models_match_their_reference_outputs() {
    let Some(root) =
        std::env::var_os("KILN_ONNX_DATA").map(|d| PathBuf::from(d).join("light")).filter(|d| d.is_dir())
    else {
        if std::env::var("KILN_REQUIRE_ONNX_DATA").is_ok_and(|v| v == "1") {
            panic!("KILN_REQUIRE_ONNX_DATA=1 but there is no light/ model directory");
        }
        eprintln!("skipped: no ONNX test data (KILN_ONNX_DATA)");
        return;
    };
    let mut models: Vec<PathBuf> = std::fs::read_dir(&root)
        .expect("the light model directory reads")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "onnx"))
        .collect();
    models.sort();
    assert_eq!(models.len(), 9, "the nine light models under {}", root.display());
    let mut failures = Vec::new();
    for path in &models {
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        let bytes = std::fs::read(path).unwrap();
        let model = ModelProto::decode(bytes.as_slice()).unwrap();
        let graph = model.graph.as_ref().unwrap();
        // Symbolic axes of every input take size 1, as ONNX's runner sizes them.
        let dims: Vec<(String, usize)> = graph
            .input
            .iter()
            .filter_map(|i| i.r#type.as_ref()?.tensor_type.as_ref()?.shape.as_ref())
            .flat_map(|s| s.dim.iter().filter_map(|d| d.dim_param.clone().filter(|p| !p.is_empty())))
            .map(|p| (p, 1))
            .collect();
        let start = std::time::Instant::now();
        let outcome = (|| -> Result<(f32, f32, usize, usize), String> {
            let imported = import(&bytes, &dims).map_err(|e| format!("import: {e}"))?;
            let inputs = imported.graph.inputs();
            let [x_node] = inputs.as_slice() else {
                return Err(format!("{} graph inputs after import, not one", inputs.len()));
            };
            let node = imported.graph.node(*x_node);
            let kiln::compiler::ir::Op::Input { name: in_name, .. } = &node.op else { unreachable!() };
            let in_name = in_name.clone();
            let n = node.shape.numel();
            let x =
                HostTensor::new(node.shape.clone(), (0..n).map(|i| (i as f64 / n as f64) as f32).collect())
                    .unwrap();
            let plan =
                compile(imported.graph, &CompileOptions::default()).map_err(|e| format!("compile: {e}"))?;
            let (arena, bound) = (plan.memory.arena_bytes, plan.memory.lower_bound_bytes);
            let mut cpu = CpuBackend::new(0);
            let id = cpu.load(plan).map_err(|e| format!("load: {e}"))?;
            for (key, value) in &imported.weights {
                cpu.write_variable(key, value).map_err(|e| e.to_string())?;
            }
            let out = cpu.call(id, &[(in_name.as_str(), &x)]).map_err(|e| format!("run: {e}"))?;
            let want = floats(&read_tensor(&root.join(format!("{name}_output_0.pb")))?);
            let got = out[0].1.data();
            if got.len() != want.len() {
                return Err(format!("{} values for {} expected", got.len(), want.len()));
            }
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
            let err = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
            if err.is_nan() || err > 1e-3 * scale {
                return Err(format!("max error {err:e} against the reference's largest magnitude {scale:e}"));
            }
            Ok((err, scale, arena, bound))
        })();
        match outcome {
            Ok((err, scale, arena, bound)) => println!(
                "{name}: matches (max error {err:.2e} of {scale:.2e}); arena {arena} B, lower bound {bound} B, {:.1} s",
                start.elapsed().as_secs_f64()
            ),
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    assert!(failures.is_empty(), "light models that do not match:\n{}", failures.join("\n"));
}

/// ResNet-50 from `light/` trains from the file (`kiln::onnx::train`, what `kiln train` runs):
/// its constant weights are parameters (persistent, none recomputed into the arena) that the
/// steps change, its batch normalisations run in training mode (batch statistics, running
/// statistics updated), the loss falls, and the step's arena sits at its lower bound. (Some
/// weights get no gradient: a convolution's bias before a batch-statistics normalisation, which
/// removes any constant shift, and filters whose every value starts at 0.02 alike.)
#[test]
fn resnet50_trains_from_onnx() {
    let Some(path) = std::env::var_os("KILN_ONNX_DATA")
        .map(|d| PathBuf::from(d).join("light").join("light_resnet50.onnx"))
        .filter(|p| p.is_file())
    else {
        if std::env::var("KILN_REQUIRE_ONNX_DATA").is_ok_and(|v| v == "1") {
            panic!("KILN_REQUIRE_ONNX_DATA=1 but there is no light_resnet50.onnx");
        }
        eprintln!("skipped: no ONNX test data (KILN_ONNX_DATA)");
        return;
    };
    let bytes = std::fs::read(&path).unwrap();
    let sizes = kiln::onnx::train::sizes(&bytes, Some(2), &[]).unwrap();
    let run = kiln::onnx::train::train(&bytes, &sizes, 3, &Device::cpu(), None, |_, _| {}).unwrap();
    assert!(run.losses.iter().all(|l| l.is_finite()), "{:?}", run.losses);
    let plans = run.trainer.plans();
    let plan = plans[0];
    // The parameters the file gave as equal values (`Init::Constant`) that hold other values now.
    let (mut constant, mut moved, mut stats, mut stats_moved) = (0, 0, 0, 0);
    for v in plan.variables.iter().filter(|v| v.role == kiln::compiler::ir::VarRole::Parameter) {
        if let kiln::compiler::ir::Init::Constant(c) = v.init {
            constant += 1;
            let now = run.trainer.backend().read_variable(&v.key).unwrap();
            let m = now.data().iter().any(|&x| x != c);
            moved += usize::from(m);
            if v.key.contains("_bn_r") {
                stats += 1;
                stats_moved += usize::from(m);
            }
        }
    }
    println!("{moved} of {constant} constant weights moved");
    assert!(constant > 200 && moved * 4 >= constant * 3, "{moved} of {constant} constant weights trained");
    // Batch normalisation in training mode: the running means and variances follow their
    // batches (92 of the 106 are stored as constants; the others are initializers).
    assert!(stats > 80 && stats_moved == stats, "{stats_moved} of {stats} running statistics updated");
    assert!(run.losses[2] < run.losses[0], "the loss falls: {:?}", run.losses);
    // ResNet-50's 25.6M weights (and Adam's two moments) are variables, not arena values.
    assert!(plan.memory.parameter_bytes > 90_000_000, "parameters {} B", plan.memory.parameter_bytes);
    // Adam's two moments of every weight with a gradient (not of the running statistics).
    assert!(plan.memory.optimizer_state_bytes > plan.memory.parameter_bytes);
    let (arena, bound) = (plan.memory.arena_bytes, plan.memory.lower_bound_bytes);
    assert!(arena as f64 <= 1.02 * bound as f64, "arena {arena} B, lower bound {bound} B");
    println!(
        "resnet50 batch 2: losses {:?}, arena {arena} B, {:.1} s",
        run.losses,
        run.elapsed.as_secs_f64()
    );
}
