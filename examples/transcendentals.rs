//! The CPU's elementwise transcendentals over 1M floats in [-6, 6] (ln: (0, 12]): each op one plan of one
//! step, `CpuBackend::profile` medians of 15 runs on the default pool (every core).
//! `cargo run --release --example transcendentals`
//!
//! The baseline (libm's scalar calls, 2026-11-24, 2-core build machine): gelu 2.3 ms,
//! tanh 5.1 ms, sigmoid 3.4 ms, exp 1.6 ms, relu 0.07 ms. Figures of today's kernels are in
//! `kernels/src/cpu/vmath.rs`.
use kiln::compiler::ir::{BinaryOp, DType, DeviceId, Graph, Node, Op, Shape};
use kiln::prelude::*;
use kiln::runtime::{Backend, CpuBackend, HostTensor};

const N: usize = 1 << 20;

fn graph(name: &str, gradient: bool) -> Graph {
    let shape = Shape::new([N]);
    let node = |op: Op| Node {
        op,
        shape: shape.clone(),
        dtype: DType::F32,
        device: DeviceId(0),
        name: None,
        origin: None,
    };
    let mut g = Graph::new(name);
    let input = |n: &str| Op::Input { name: n.into(), shape: shape.clone(), dtype: DType::F32 };
    let x = g.add(node(input("x")), &[]);
    let y = if gradient {
        let dy = g.add(node(input("dy")), &[]);
        g.add(node(Op::Binary(BinaryOp::GeluGrad)), &[x, dy])
    } else {
        let t = Tracer::new(name);
        let x = t.input("x", [N]);
        let y = match name {
            "relu" => x.relu(),
            "exp" => x.exp(),
            "ln" => x.log(),
            "tanh" => x.tanh(),
            "sigmoid" => x.sigmoid(),
            "erf" => x.erf(),
            _ => x.gelu(),
        };
        t.output("y", &y);
        return t.finish().expect("one op traces");
    };
    g.set_output("y", y);
    g
}

fn main() -> Result<()> {
    let x = HostTensor::from_fn([N], |i| -6.0 + 12.0 * i as f32 / N as f32)?;
    let dy = HostTensor::from_fn([N], |i| (i as f32 * 0.37).sin())?;
    // ln over (0, 12].
    let positive = HostTensor::from_fn([N], |i| 12.0 * (i + 1) as f32 / N as f32)?;
    println!("{:<10} {:>9}", "op", "ms / 1M");
    for (name, gradient) in [
        ("relu", false),
        ("exp", false),
        ("ln", false),
        ("tanh", false),
        ("sigmoid", false),
        ("erf", false),
        ("gelu", false),
        ("gelu_grad", true),
    ] {
        let plan = compile(graph(name, gradient), &CompileOptions::default())?;
        let mut b = CpuBackend::new(0);
        let id = b.load(plan)?;
        let x = if name == "ln" { &positive } else { &x };
        let feeds: Vec<(&str, &HostTensor)> =
            if gradient { vec![("x", x), ("dy", &dy)] } else { vec![("x", x)] };
        b.call(id, &feeds)?;
        let rows = b.profile(id, 15)?;
        let ns: u64 = rows.iter().map(|r| r.1).sum();
        println!("{name:<10} {:>9.3}", ns as f64 / 1e6);
    }
    Ok(())
}
