//! The training effects: SGD (plain, momentum, Nesterov), Adam and assign_add, Keras 3 formulas
//! exactly as the CPU kernels compute them. They have no output argument: a thread per element
//! updates the variable (and optimizer state) operands in place.
//!
//! - SGD: var -= lr·g; with momentum v = momentum·v - lr·g, then var += v, or with Nesterov
//!   var += momentum·v - lr·g.
//! - Adam: t = iterations[0] + 1 (the counter is read on the device, not baked, since it changes
//!   every step); α = lr·√(1-β2^t)/(1-β1^t) in f64 with `pow`, as the CPU; then in f32
//!   m += (g - m)(1 - β1); v += (g² - v)(1 - β2); var -= α·m / (√v + ε).
//! - assign_add: var += value.
//!
//! A tiled update (`rows`) writes a block of rows: the kernel moves the variable's and the
//! state's pointers to the block's first element and updates as many elements as the gradient
//! (just the block) holds.
//!
//! Products that feed a sum are `__fmul_rn` (never fused), so the f32 updates are bitwise the
//! CPU's; α can differ from the CPU's in its last bit where CUDA's `pow` and glibc's do.

use super::codegen::{BLOCK, Code, dbl, flt, grid_for, grid_loop, header, idx_type, int, shape_text};
use super::{Arg, CudaKernel, Launch};
use kiln_compiler::ir::{Rows, Shape};

/// Moves the named pointer parameters to a block's first element.
fn shift(c: &mut Code, names: &[&str], offset: usize) {
    if offset > 0 {
        for name in names {
            c.line(format!("{name} += {};", int(offset)));
        }
    }
}

fn launch(function: &str, work: usize, inputs: usize) -> Launch {
    Launch {
        function: function.into(),
        grid: grid_for(work, BLOCK),
        block: [BLOCK, 1, 1],
        shared_bytes: 0,
        args: (0..inputs).map(Arg::Input).collect(),
    }
}

pub(crate) fn sgd(
    label: &str,
    lr: f32,
    momentum: f32,
    nesterov: bool,
    var: &Shape,
    rows: Option<Rows>,
    shapes: &[&Shape],
) -> CudaKernel {
    let (offset, n, part) = Rows::span(rows, var);
    let ty = idx_type(var.numel());
    let with_velocity = momentum != 0.0;
    let mut c = Code::new();
    c.line(header(label, shapes, None));
    let mut p = vec!["float* __restrict__ var", "const float* __restrict__ grad"];
    if with_velocity {
        p.push("float* __restrict__ velocity");
    }
    c.line(format!("extern \"C\" __global__ void kiln_apply_sgd({}) {{", p.join(", ")));
    c.line(format!("const float lr = {};", flt(lr)));
    if with_velocity {
        c.line(format!("const float momentum = {};", flt(momentum)));
    }
    shift(&mut c, if with_velocity { &["var", "velocity"] } else { &["var"] }, offset);
    c.line(grid_loop(ty, "i", n));
    c.line("const float g = grad[i];");
    if with_velocity {
        c.line("const float v = __fmul_rn(momentum, velocity[i]) - __fmul_rn(lr, g);");
        c.line("velocity[i] = v;");
        if nesterov {
            c.line("var[i] = var[i] + (__fmul_rn(momentum, v) - __fmul_rn(lr, g));");
        } else {
            c.line("var[i] = var[i] + v;");
        }
    } else {
        c.line("var[i] = var[i] - __fmul_rn(lr, g);");
    }
    c.line("}");
    c.line("}");
    let describe = format!(
        "apply_sgd[lr {lr}, momentum {momentum}{}] {}{part}",
        if nesterov { ", nesterov" } else { "" },
        shape_text(var)
    );
    CudaKernel {
        source: c.finish(),
        launches: vec![launch("kiln_apply_sgd", n, if with_velocity { 3 } else { 2 })],
        describe,
    }
}

/// `hyper` is (lr, beta1, beta2, epsilon).
pub(crate) fn adam(
    label: &str,
    hyper: [f32; 4],
    var: &Shape,
    rows: Option<Rows>,
    shapes: &[&Shape],
) -> CudaKernel {
    let [lr, beta1, beta2, epsilon] = hyper;
    let (offset, n, part) = Rows::span(rows, var);
    let ty = idx_type(var.numel());
    let mut c = Code::new();
    c.line(header(label, shapes, None));
    c.line(
        "extern \"C\" __global__ void kiln_apply_adam(float* __restrict__ var, const float* __restrict__ grad, \
         float* __restrict__ m, float* __restrict__ v, const float* __restrict__ iterations) {",
    );
    c.line("const double t = (double)iterations[0] + 1.0;");
    c.line(format!(
        "const float alpha = (float)({} * sqrt(1.0 - pow({}, t)) / (1.0 - pow({}, t)));",
        dbl(lr as f64),
        dbl(beta2 as f64),
        dbl(beta1 as f64)
    ));
    c.line(format!("const float one_minus_beta1 = {};", flt(1.0 - beta1)));
    c.line(format!("const float one_minus_beta2 = {};", flt(1.0 - beta2)));
    c.line(format!("const float epsilon = {};", flt(epsilon)));
    shift(&mut c, &["var", "m", "v"], offset);
    c.line(grid_loop(ty, "i", n));
    c.line("const float g = grad[i];");
    c.line("const float mi = m[i] + __fmul_rn(g - m[i], one_minus_beta1);");
    c.line("const float vi = v[i] + __fmul_rn(__fmul_rn(g, g) - v[i], one_minus_beta2);");
    c.line("m[i] = mi;");
    c.line("v[i] = vi;");
    c.line("var[i] = var[i] - __fmul_rn(alpha, mi) / (sqrtf(vi) + epsilon);");
    c.line("}");
    c.line("}");
    CudaKernel {
        source: c.finish(),
        launches: vec![launch("kiln_apply_adam", n, 5)],
        describe: format!(
            "apply_adam[lr {lr}, beta1 {beta1}, beta2 {beta2}, epsilon {epsilon}] {}{part}",
            shape_text(var)
        ),
    }
}

pub(crate) fn assign_add(label: &str, value: f32, var: &Shape) -> CudaKernel {
    let n = var.numel();
    let ty = idx_type(n);
    let mut c = Code::new();
    c.line(header(label, &[var], None));
    c.line("extern \"C\" __global__ void kiln_assign_add(float* __restrict__ var) {");
    c.line(format!("const float value = {};", flt(value)));
    c.line(grid_loop(ty, "i", n));
    c.line("var[i] = var[i] + value;");
    c.line("}");
    c.line("}");
    CudaKernel {
        source: c.finish(),
        launches: vec![launch("kiln_assign_add", n, 1)],
        describe: format!("assign_add[{value}] {}", shape_text(var)),
    }
}
