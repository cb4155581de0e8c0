use kiln_compiler::ir::{Init, dump};
use kiln_compiler::trace::Tracer;

#[test]
fn traces_dense_and_reports_mistakes() {
    let t = Tracer::new("mlp");
    let x = t.input("x", [32, 100]);
    let w = t.param("w", [100, 10], Init::GlorotUniform);
    let b = t.param("b", [10], Init::Zeros);
    let y = (x.matmul(&w) + &b).relu();
    let s = 1.0 - y.sigmoid() * 2.0;
    t.output("y", &s);
    let g = t.finish().unwrap();
    println!("{}", dump(&g));

    let t = Tracer::new("bad");
    let x = t.input("x", [32, 100]);
    let w = t.param("w", [10, 1], Init::GlorotUniform);
    let y = x.matmul(&w).relu();
    t.output("y", &y);
    let e = t.finish().unwrap_err().to_string();
    println!("{e}");
    assert!(e.contains("trace_smoke.rs:19:15"), "{e}");
}
