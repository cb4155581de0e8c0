//! Every input gets a result or a clear error: one test per class of mistake that once panicked,
//! aborted, crashed or computed something else (issue "Sound").

use kiln::compiler::ir::Op;
use kiln::prelude::*;
use kiln::runtime::alloc::{BfcAllocator, CachingAllocator, HostSource};
use kiln::runtime::eager::{CpuEager, EagerExecutor};
use kiln::runtime::memory::{DeviceBudget, Policy, Tracker};

fn error_of(t: Tracer) -> String {
    match t.finish() {
        Ok(_) => panic!("the trace should have failed"),
        Err(e) => e.to_string(),
    }
}

/// Operands read twice by one op (`x * x`, `concat([a, a])`, `a.matmul(&a)`): the eager executor
/// counts each reader once, as the planned executor does.
#[test]
fn eager_counts_a_repeated_operand_once() {
    let t = Tracer::new("repeated");
    let x = t.input("x", [3, 3]);
    let a = x.relu() + 0.5;
    let sq = &a * &a;
    let cat = a.concat(&[&a, &sq], 0);
    let mm = a.matmul(&a);
    t.output("sq", &(&sq + 1.0));
    t.output("cat", &cat.sum(0, false));
    t.output("mm", &mm.tanh());
    let graph = t.finish().unwrap();
    let x = HostTensor::from_fn([3, 3], |i| i as f32 * 0.25 - 1.0).unwrap();
    let feed = [("x", &x)];

    let plan = compile(graph.clone(), &CompileOptions::default()).unwrap();
    let mut planned = CpuBackend::new(0);
    let id = planned.load(plan).unwrap();
    let expected = planned.call(id, &feed).unwrap();
    let scheduled = kiln::compiler::optimize(graph).unwrap();
    let mut bfc = EagerExecutor::new(BfcAllocator::new(HostSource::new(), 1 << 30), 0, CpuEager);
    let mut caching = EagerExecutor::new(CachingAllocator::new(HostSource::new(), None), 0, CpuEager);
    for call in 0..2 {
        for (name, run) in [
            ("bfc", bfc.run(&scheduled.graph, &scheduled.order, &feed).unwrap()),
            ("caching", caching.run(&scheduled.graph, &scheduled.order, &feed).unwrap()),
        ] {
            for ((n, e), (_, p)) in run.outputs.iter().zip(&expected) {
                assert_eq!(e, p, "{name} call {call}: output {n}");
            }
            assert_eq!(run.stats.in_use, 0, "{name} call {call}: every block returned");
        }
    }
}

/// Sizes that overflow `usize`, or exceed a tensor's 1 TiB, are trace-time errors naming the op.
#[test]
fn size_overflow_is_an_error_naming_the_op() {
    let huge = usize::MAX / 3;
    type Build = Box<dyn Fn(&Tracer)>;
    let cases: Vec<(&str, Build)> = vec![
        ("input", Box::new(move |t| drop(t.input("x", [huge, 4])))),
        ("fill", Box::new(move |t| drop(t.fill(1.0, [1 << 20, 1 << 20, 1 << 20])))),
        ("reshape", Box::new(move |t| drop(t.input("x", [4]).reshape([huge, 4, 1])))),
        ("broadcast_to", Box::new(move |t| drop(t.input("x", [1, 4]).broadcast_to([huge, 4])))),
        ("matmul", Box::new(|t| drop(t.input("a", [1 << 30, 1]).matmul(&t.input("b", [1, 1 << 30]))))),
        (
            "pad",
            Box::new(move |t| {
                drop(t.input("x", [4]).record(Op::Pad { axis: 0, before: huge, after: huge }, &[]))
            }),
        ),
        (
            "slice",
            Box::new(move |t| {
                drop(t.input("x", [4]).record(Op::Slice { axis: 0, start: 2, len: usize::MAX }, &[]))
            }),
        ),
        ("param", Box::new(move |t| drop(t.param("w", [huge, huge], Init::Zeros)))),
    ];
    for (op, build) in cases {
        let t = Tracer::new("huge");
        build(&t);
        let e = error_of(t);
        let named = if op == "param" { "`variable`" } else { op };
        assert!(e.contains(named), "{op}: {e}");
        assert!(e.contains("sound.rs"), "{op}: the error names the caller's line: {e}");
    }
}

#[test]
fn compile_options_are_checked() {
    let graph = || {
        let t = Tracer::new("g");
        t.output("y", &t.input("x", [2]).relu());
        t.finish().unwrap()
    };
    for alignment in [0, 1, 2, 3, 100, 1 << 40, usize::MAX] {
        let options = CompileOptions { alignment, ..Default::default() };
        let e = compile(graph(), &options).unwrap_err().to_string();
        assert!(e.contains("alignment"), "{alignment}: {e}");
    }
    let options = CompileOptions::default().with_devices(vec![]);
    assert!(compile(graph(), &options).unwrap_err().to_string().contains("devices is empty"));
    let same = kiln::compiler::DeviceSpec::new(0, "a");
    let options = CompileOptions::default().with_devices(vec![same.clone(), same]);
    assert!(compile(graph(), &options).unwrap_err().to_string().contains("unique"));
}

#[test]
fn half_precision_is_refused_where_it_enters() {
    let t = Tracer::new("f16");
    t.input_typed("x", [2], DType::F16);
    let e = error_of(t);
    assert!(e.contains("f16") && e.contains("f32"), "{e}");
    let t = Tracer::new("bf16");
    t.variable("w", [2], DType::BF16, kiln::compiler::ir::VarRole::Parameter, Init::Zeros);
    assert!(error_of(t).contains("bf16"));
}

#[test]
fn names_are_not_silently_replaced_or_shared() {
    let t = Tracer::new("outputs");
    let x = t.input("x", [2]);
    t.output("y", &x.relu());
    t.output("y", &x.tanh());
    assert!(error_of(t).contains("an output named \"y\" already exists"));

    let t = Tracer::new("params");
    t.param("w", [2], Init::Zeros);
    t.param("w", [2], Init::Zeros);
    let e = error_of(t);
    assert!(e.contains("already exists") && e.contains("shared_param"), "{e}");

    // Tying on purpose: one variable.
    let t = Tracer::new("tied");
    let x = t.input("x", [1, 2]);
    let w1 = t.shared_param("w", [2, 2], Init::GlorotUniform);
    let w2 = t.shared_param("w", [2, 2], Init::GlorotUniform);
    assert_eq!(w1.id(), w2.id());
    t.output("y", &x.matmul(&w1).matmul(&w2));
    let plan = compile(t.finish().unwrap(), &CompileOptions::default()).unwrap();
    assert_eq!(plan.variables.len(), 1);
}

#[test]
fn tensors_of_another_trace_are_errors() {
    let (a, b) = (Tracer::new("a"), Tracer::new("b"));
    let x = a.input("x", [2]);
    let y = b.input("y", [2]);
    let z = &x + &y;
    b.output("z", &z);
    assert!(error_of(b).contains("belongs to another trace"));
    assert!(error_of(a.clone()).contains("different traces"));
    let other = Tracer::new("c");
    let id = Tracer::new("d").input("w", [3]).id().unwrap();
    let t = other.tensor(id);
    assert!(t.id().is_none());
    assert!(error_of(other).contains("not in this trace"));
}

fn embedding_plan() -> Plan {
    let t = Tracer::new("embed");
    let ids = t.input("ids", [3]);
    let table = t.param("table", [4, 2], Init::GlorotUniform);
    t.output("rows", &table.gather(&ids));
    compile(t.finish().unwrap(), &CompileOptions::default()).unwrap()
}

#[test]
fn gather_ids_out_of_range_or_fractional_fail_on_the_cpu() {
    let mut backend = CpuBackend::new(0);
    let id = backend.load(embedding_plan()).unwrap();
    let ok = HostTensor::new([3], vec![0.0, 3.0, 1.0]).unwrap();
    backend.call(id, &[("ids", &ok)]).unwrap();
    for (bad, what) in [(4.0, "outside the table"), (-1.0, "outside the table"), (1.5, "not a whole number")]
    {
        let ids = HostTensor::new([3], vec![0.0, bad, 1.0]).unwrap();
        let e = backend.call(id, &[("ids", &ids)]).unwrap_err().to_string();
        assert!(e.contains(what) && e.contains("position 1") && e.contains("input `ids`"), "{e}");
    }
}

#[test]
fn inputs_must_be_fed() {
    let mut backend = CpuBackend::new(0);
    let id = backend.load(embedding_plan()).unwrap();
    let e = backend.run(id).unwrap_err().to_string();
    assert!(e.contains("before its input `ids` was fed"), "{e}");
    let e = backend.call(id, &[]).unwrap_err().to_string();
    assert!(e.contains("without its input `ids`"), "{e}");
    let e = backend.call(id, &[("idz", &HostTensor::zeros([3]).unwrap())]).unwrap_err().to_string();
    assert!(e.contains("without its input `ids`"), "{e}");
    assert!(backend.run(id + 7).unwrap_err().to_string().contains("no program"));
    assert!(backend.plan(id + 7).is_err());
}

/// A region larger than the machine can give is an error naming the device and the size.
#[test]
fn allocation_failure_is_an_error() {
    let budget = DeviceBudget {
        name: "cpu:0".into(),
        policy: Policy::Preallocate { fraction: 1.0 },
        limit: None,
        capacity: 1 << 62,
    };
    let e = match CpuBackend::with_budgets(0, vec![budget], Tracker::default()) {
        Ok(_) => panic!("a 4 EiB region cannot be allocated"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("cpu:0") && e.contains("cannot allocate"), "{e}");
}
