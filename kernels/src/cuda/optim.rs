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
//! - update_loss_scale: GradScaler's scale update, one thread (`ir::Op::UpdateLossScale`).
//!
//! A gated update (`ir::Op::update_gate`, the last operand) reads its gate in every thread:
//! where it is not finite the thread returns before writing, and otherwise the gradient is
//! `__fmul_rn(grad[i], gate)`, as the CPU multiplies it.
//!
//! A tiled update (`rows`) writes a block of rows: the kernel moves the variable's and the
//! state's pointers to the block's first element and updates as many elements as the gradient
//! (just the block) holds. A ZeRO shard (`shard`) updates the rank's range of the variable, its
//! state holding just the (padded) shard and its gradient the shard's or the whole variable's.
//!
//! A product update (`ir::Grad::Product`) is the tiled GEMM of its gradient aᵀ·b whose store is
//! the update's arithmetic (`gemm::Sink::Update`): each thread applies the products it would
//! have stored, so the gradient is never in memory; Adam's step size is computed once per
//! thread before the K loop. One definition of each rule's arithmetic serves both kernels.
//!
//! Products that feed a sum are `__fmul_rn` (never fused), so the f32 updates are bitwise the
//! CPU's; α can differ from the CPU's in its last bit where CUDA's `pow` and glibc's do.

use super::codegen::{BLOCK, Code, Elems, dbl, flt, grid_for, grid_loop, header, idx_type, int, shape_text};
use super::gemm::{Gemm, Operand, Plain, Sink, Update};
use super::{Arg, CudaKernel, Launch};
use kiln_compiler::ir::{Rows, Shape, Shard};

/// C for "`x` is finite", from its exponent bits: exact under any math flags.
fn finite(x: &str) -> String {
    format!("((__float_as_int({x}) & 0x7f800000) != 0x7f800000)")
}

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

/// An update's code around one element: `setup` once per thread (Adam's step size from the
/// counter), `constants` (literals), `body` applying gradient `g` to element `i` of `var` and
/// the state (`state`, by parameter name); `counter` when the op reads an iteration counter.
struct Rule {
    name: &'static str,
    setup: Vec<String>,
    constants: Vec<String>,
    body: Vec<String>,
    state: Vec<&'static str>,
    counter: bool,
    describe: String,
}

fn sgd_rule(lr: f32, momentum: f32, nesterov: bool) -> Rule {
    let with_velocity = momentum != 0.0;
    let mut constants = vec![format!("const float lr = {};", flt(lr))];
    let mut body = Vec::new();
    if with_velocity {
        constants.push(format!("const float momentum = {};", flt(momentum)));
        body.push("const float vi = __fmul_rn(momentum, velocity[i]) - __fmul_rn(lr, g);".to_string());
        body.push("velocity[i] = vi;".into());
        body.push(if nesterov {
            "var[i] = var[i] + (__fmul_rn(momentum, vi) - __fmul_rn(lr, g));".into()
        } else {
            "var[i] = var[i] + vi;".into()
        });
    } else {
        body.push("var[i] = var[i] - __fmul_rn(lr, g);".into());
    }
    Rule {
        name: "sgd",
        setup: Vec::new(),
        constants,
        body,
        state: if with_velocity { vec!["velocity"] } else { Vec::new() },
        counter: false,
        describe: format!(
            "apply_sgd[lr {lr}, momentum {momentum}{}]",
            if nesterov { ", nesterov" } else { "" }
        ),
    }
}

/// `hyper` is (lr, beta1, beta2, epsilon).
fn adam_rule(hyper: [f32; 4]) -> Rule {
    let [lr, beta1, beta2, epsilon] = hyper;
    Rule {
        name: "adam",
        setup: vec![
            "const double kiln_t = (double)iterations[0] + 1.0;".into(),
            format!(
                "const float alpha = (float)({} * sqrt(1.0 - pow({}, kiln_t)) / (1.0 - pow({}, kiln_t)));",
                dbl(lr as f64),
                dbl(beta2 as f64),
                dbl(beta1 as f64)
            ),
        ],
        constants: vec![
            format!("const float one_minus_beta1 = {};", flt(1.0 - beta1)),
            format!("const float one_minus_beta2 = {};", flt(1.0 - beta2)),
            format!("const float epsilon = {};", flt(epsilon)),
        ],
        body: vec![
            "const float mi = m[i] + __fmul_rn(g - m[i], one_minus_beta1);".into(),
            "const float vi = v[i] + __fmul_rn(__fmul_rn(g, g) - v[i], one_minus_beta2);".into(),
            "m[i] = mi;".into(),
            "v[i] = vi;".into(),
            "var[i] = var[i] - __fmul_rn(alpha, mi) / (sqrtf(vi) + epsilon);".into(),
        ],
        state: vec!["m", "v"],
        counter: true,
        describe: format!("apply_adam[lr {lr}, beta1 {beta1}, beta2 {beta2}, epsilon {epsilon}]"),
    }
}

impl Rule {
    /// The variable's parameter, the stored gradient's (with `grad`), the state's and, with a
    /// counter, the counter's.
    fn params(&self, grad: bool) -> String {
        let mut p = vec!["float* __restrict__ var".to_string()];
        if grad {
            p.push("const float* __restrict__ grad".into());
        }
        p.extend(self.state.iter().map(|n| format!("float* __restrict__ {n}")));
        if self.counter {
            p.push("const float* __restrict__ iterations".into());
        }
        p.join(", ")
    }

    /// The kernel over a stored gradient (operand 1), `n` elements of the variable from
    /// `span.var`, of the gradient from `span.grad` and of the state from `span.state` (a tiled
    /// update's block, or a rank's shard); with `gated`, the last operand is the gate.
    fn kernel(self, label: &str, var: &Shape, span: &Span, shapes: &[&Shape], gated: bool) -> CudaKernel {
        let ty = idx_type(var.numel());
        let function = format!("kiln_apply_{}", self.name);
        let mut c = Code::new();
        c.line(header(label, shapes, None));
        let gate_param = if gated { ", const float* __restrict__ gate" } else { "" };
        c.line(format!("extern \"C\" __global__ void {function}({}{gate_param}) {{", self.params(true)));
        if gated {
            c.line("const float kiln_gate = gate[0];");
            c.line(format!("if (!{}) return;", finite("kiln_gate")));
        }
        for l in self.setup.iter().chain(&self.constants) {
            c.line(l);
        }
        shift(&mut c, &["var"], span.var);
        shift(&mut c, &["grad"], span.grad);
        shift(&mut c, &self.state, span.state);
        c.line(grid_loop(ty, "i", span.n));
        c.line(if gated {
            "const float g = __fmul_rn(grad[i], kiln_gate);"
        } else {
            "const float g = grad[i];"
        });
        for l in &self.body {
            c.line(l);
        }
        c.line("}");
        c.line("}");
        let inputs = 2 + self.state.len() + usize::from(self.counter) + usize::from(gated);
        CudaKernel {
            source: c.finish(),
            launches: vec![launch(&function, span.n, inputs)],
            describe: format!(
                "{} {}{}{}",
                self.describe,
                shape_text(var),
                span.part,
                if gated { " gated" } else { "" }
            ),
        }
    }

    /// The kernel that computes the gradient aᵀ·b (a[M, R] = operand 1, b[M, C] = operand 2)
    /// with the tiled GEMM and applies each product as it would store it: the gradient is
    /// never in memory. The state follows from operand 3.
    fn product_kernel(self, label: &str, shapes: &[&Shape], scratch: usize, e: &Elems) -> CudaKernel {
        let (var, a, b) = (shapes[0], shapes[1], shapes[2]);
        let (r, cols, m) = product_dims(shapes);
        let ty = idx_type(shapes.iter().map(|s| s.numel()).max().unwrap_or(0));
        let mut names = vec!["var"];
        names.extend(&self.state);
        let with_alpha = !self.setup.is_empty();
        let mut definition = format!(
            "__device__ __forceinline__ void kiln_update(float g, {ty} i{}, {}) {{\n",
            if with_alpha { ", float alpha" } else { "" },
            names.iter().map(|n| format!("float* __restrict__ {n}")).collect::<Vec<_>>().join(", ")
        );
        // Half factors: the gradient is their product rounded to their type (`ir::Grad::Product`).
        if !e.input_f32(1) {
            definition.push_str(&format!("{{ {} rounded; rounded = g; g = rounded; }}\n", e.input(1)));
        }
        for l in self.constants.iter().chain(&self.body) {
            definition.push_str(l);
            definition.push('\n');
        }
        definition.push('}');
        let call = if with_alpha { format!("alpha, {}", names.join(", ")) } else { names.join(", ") };
        let mut args = vec![Arg::Input(0)];
        args.extend((3..3 + self.state.len() + usize::from(self.counter)).map(Arg::Input));
        let gemm = Gemm {
            name: format!("kiln_apply_{}_product", self.name),
            m: r,
            n: cols,
            k: m,
            batch: 1,
            a: Operand {
                k_contiguous: false,
                load: format!("v = src[gk * {} + gr];", int(r)),
                batch_offset: "0".into(),
                plain: Some(Plain { ld: r, offset: 0, batch_granule: 0 }),
            },
            b: Operand {
                k_contiguous: false,
                load: format!("v = src[gk * {} + gr];", int(cols)),
                batch_offset: "0".into(),
                plain: Some(Plain { ld: cols, offset: 0, batch_granule: 0 }),
            },
            ty,
            args: [Arg::Input(1), Arg::Input(2)],
            sink: Sink::Update(Update {
                definition,
                params: self.params(false),
                args,
                prelude: self.setup.clone(),
                call,
            }),
            scratch,
            elems: e.clone(),
        };
        let mut c = Code::new();
        c.line(header(label, shapes, None));
        let (launches, tiling) = gemm.generate(&mut c);
        CudaKernel {
            source: c.finish(),
            launches,
            describe: format!(
                "{} {} from {}ᵀ @ {} ({tiling})",
                self.describe,
                shape_text(var),
                shape_text(a),
                shape_text(b)
            ),
        }
    }
}

/// Where an update over a stored gradient reads and writes: `n` elements of the variable from
/// `var`, of the gradient from `grad`, of the state from `state`, and the describe text's part.
struct Span {
    var: usize,
    grad: usize,
    state: usize,
    n: usize,
    part: String,
}

impl Span {
    /// A tiled update's block of rows (the gradient holds just the block, the state is the
    /// variable's shape), or a rank's shard (`ir::infer` checked: no rows, no product; the state
    /// holds the padded shard from 0; the gradient is the shard's from 0 or the variable's,
    /// read from the shard's first element), as the CPU kernel reads them.
    fn of(var: &Shape, grad: &Shape, rows: Option<Rows>, shard: Option<Shard>) -> Span {
        match shard {
            Some(sh) => {
                let r = sh.range(var.numel());
                Span {
                    var: r.start,
                    grad: if grad == var { r.start } else { 0 },
                    state: 0,
                    n: r.len(),
                    part: format!(" shard {} of {} ({}..{})", sh.rank, sh.ranks, r.start, r.end),
                }
            }
            None => {
                let (offset, n, part) = Rows::span(rows, var);
                Span { var: offset, grad: 0, state: offset, n, part }
            }
        }
    }
}

/// The update's kernel: over a stored gradient, or computing it (`product`; checked against
/// the variable by `ir::infer`, as `rows` and `shard` are).
fn update(
    rule: Rule,
    label: &str,
    (rows, product, shard, gated): At,
    shapes: &[&Shape],
    (scratch, e): (usize, &Elems),
) -> CudaKernel {
    // `ir::infer` refuses a gated product update: the gate reads the stored gradient.
    if product && !gated {
        rule.product_kernel(label, shapes, scratch, e)
    } else {
        let span = Span::of(shapes[0], shapes[1], rows, shard);
        rule.kernel(label, shapes[0], &span, shapes, gated)
    }
}

/// Where an update writes and from what: (rows, product, shard, gated) of the op.
pub(crate) type At = (Option<Rows>, bool, Option<Shard>, bool);

/// The (M, N, K) of a product update's gradient aᵀ·b (operands 1 and 2).
pub(crate) fn product_dims(shapes: &[&Shape]) -> (usize, usize, usize) {
    (shapes[0].dims()[0], shapes[0].dims()[1], shapes[1].dims()[0])
}

/// `at` is (rows, product, shard, gated) of the op.
pub(crate) fn sgd(
    label: &str,
    (lr, momentum, nesterov): (f32, f32, bool),
    at: At,
    shapes: &[&Shape],
    scratch: (usize, &Elems),
) -> CudaKernel {
    update(sgd_rule(lr, momentum, nesterov), label, at, shapes, scratch)
}

/// `hyper` is (lr, beta1, beta2, epsilon), `at` (rows, product, shard, gated) of the op.
pub(crate) fn adam(
    label: &str,
    hyper: [f32; 4],
    at: At,
    shapes: &[&Shape],
    scratch: (usize, &Elems),
) -> CudaKernel {
    update(adam_rule(hyper), label, at, shapes, scratch)
}

pub(crate) fn assign_add(label: &str, value: f32, var: &Shape, gated: bool) -> CudaKernel {
    let n = var.numel();
    let ty = idx_type(n);
    let mut c = Code::new();
    c.line(header(label, &[var], None));
    if gated {
        c.line("extern \"C\" __global__ void kiln_assign_add(float* __restrict__ var, const float* __restrict__ gate) {");
        c.line(format!("if (!{}) return;", finite("gate[0]")));
    } else {
        c.line("extern \"C\" __global__ void kiln_assign_add(float* __restrict__ var) {");
    }
    c.line(format!("const float value = {};", flt(value)));
    c.line(grid_loop(ty, "i", n));
    c.line("var[i] = var[i] + value;");
    c.line("}");
    c.line("}");
    CudaKernel {
        source: c.finish(),
        launches: vec![launch("kiln_assign_add", n, 1 + usize::from(gated))],
        describe: format!("assign_add[{value}] {}{}", shape_text(var), if gated { " gated" } else { "" }),
    }
}

/// One thread (of a warp): (scale, good steps) from the gate, as `cpu::optim::loss_scale_after`.
pub(crate) fn update_loss_scale(label: &str, growth: f32, backoff: f32, interval: u32) -> CudaKernel {
    let one = Shape::scalar();
    let mut c = Code::new();
    c.line(header(label, &[&one, &one, &one], None));
    c.line("extern \"C\" __global__ void kiln_update_loss_scale(float* __restrict__ scale, float* __restrict__ good, const float* __restrict__ gate) {");
    c.line("if (threadIdx.x != 0) return;");
    c.line(format!("if (!{}) {{", finite("gate[0]")));
    c.line(format!("scale[0] = __fmul_rn(scale[0], {});", flt(backoff)));
    c.line("good[0] = 0.0f;");
    c.line("return;");
    c.line("}");
    c.line("const float next = good[0] + 1.0f;");
    c.line(format!("if (next >= {}) {{", flt(interval as f32)));
    c.line(format!("const float grown = __fmul_rn(scale[0], {});", flt(growth)));
    c.line(format!("if ({}) scale[0] = grown;", finite("grown")));
    c.line("good[0] = 0.0f;");
    c.line("} else {");
    c.line("good[0] = next;");
    c.line("}");
    c.line("}");
    CudaKernel {
        source: c.finish(),
        launches: vec![Launch {
            function: "kiln_update_loss_scale".into(),
            grid: [1, 1, 1],
            block: [32, 1, 1],
            shared_bytes: 0,
            args: (0..3).map(Arg::Input).collect(),
        }],
        describe: format!("update_loss_scale[growth {growth}, backoff {backoff}, interval {interval}]"),
    }
}
