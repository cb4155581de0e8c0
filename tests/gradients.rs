//! Every differentiable op's gradient against central finite differences, on every backend.

mod common;

use common::{Draw, check_gradients};
use kiln::compiler::ir::{Op, Padding, PoolKind, Shape, Window2d};
use kiln::compiler::losses;
use kiln::prelude::*;

fn s(d: &[usize]) -> Shape {
    Shape::from(d)
}

macro_rules! grad_test {
    ($name:ident, [$(($shape:expr, $draw:expr)),+ $(,)?], $wrt:expr, $f:expr) => {
        backend_test!($name, |b: &mut dyn Backend| {
            check_gradients(b, stringify!($name), &[$((s(&$shape), $draw)),+], &$wrt, $f)
        });
    };
}

// ---- unary
grad_test!(neg, [([3, 4], Draw::Normal)], [0], |x: &[Tensor]| -&x[0]);
grad_test!(abs, [([3, 4], Draw::AwayFromZero)], [0], |x: &[Tensor]| x[0].abs());
grad_test!(relu, [([3, 4], Draw::AwayFromZero)], [0], |x: &[Tensor]| x[0].relu());
grad_test!(sigmoid, [([3, 4], Draw::Normal)], [0], |x: &[Tensor]| x[0].sigmoid());
grad_test!(tanh, [([3, 4], Draw::Normal)], [0], |x: &[Tensor]| x[0].tanh());
grad_test!(gelu, [([3, 4], Draw::Normal)], [0], |x: &[Tensor]| x[0].gelu());
grad_test!(exp, [([3, 4], Draw::Normal)], [0], |x: &[Tensor]| x[0].exp());
grad_test!(log, [([3, 4], Draw::Positive)], [0], |x: &[Tensor]| x[0].log());
grad_test!(sqrt, [([3, 4], Draw::Positive)], [0], |x: &[Tensor]| x[0].sqrt());
grad_test!(rsqrt, [([3, 4], Draw::Positive)], [0], |x: &[Tensor]| x[0].rsqrt());
grad_test!(square, [([3, 4], Draw::Normal)], [0], |x: &[Tensor]| x[0].square());
grad_test!(reciprocal, [([3, 4], Draw::Positive)], [0], |x: &[Tensor]| x[0].reciprocal());
grad_test!(erf, [([3, 4], Draw::Normal)], [0], |x: &[Tensor]| x[0].erf());

// ---- binary, with broadcasting both ways
grad_test!(add, [([3, 4], Draw::Normal), ([4], Draw::Normal)], [0, 1], |x: &[Tensor]| &x[0] + &x[1]);
grad_test!(sub, [([3, 1], Draw::Normal), ([2, 1, 4], Draw::Normal)], [0, 1], |x: &[Tensor]| &x[0] - &x[1]);
grad_test!(mul, [([2, 3, 4], Draw::Normal), ([3, 1], Draw::Normal)], [0, 1], |x: &[Tensor]| &x[0] * &x[1]);
grad_test!(div, [([3, 4], Draw::Normal), ([1, 4], Draw::Positive)], [0, 1], |x: &[Tensor]| &x[0] / &x[1]);
grad_test!(pow, [([3, 4], Draw::Positive), ([3, 4], Draw::Normal)], [0, 1], |x: &[Tensor]| x[0].pow(&x[1]));
grad_test!(maximum, [([12], Draw::Distinct), ([12], Draw::Distinct)], [0, 1], |x: &[Tensor]| {
    // Shifted by half the spacing of Distinct's values: no ties, where max has no derivative.
    x[0].maximum(&(&x[1] + 0.05))
});
grad_test!(minimum, [([12], Draw::Distinct), ([12], Draw::Distinct)], [0, 1], |x: &[Tensor]| {
    x[0].minimum(&(&x[1] + 0.05))
});
grad_test!(
    select,
    [([3, 4], Draw::Mask), ([3, 4], Draw::Normal), ([4], Draw::Normal)],
    [1, 2],
    |x: &[Tensor]| { x[0].select(&x[1], &x[2]) }
);

// ---- with a scalar
grad_test!(scalar_add_mul, [([3, 4], Draw::Normal)], [0], |x: &[Tensor]| (&x[0] + 2.0) * 3.0);
grad_test!(scalar_rsub_rdiv, [([3, 4], Draw::Positive)], [0], |x: &[Tensor]| 1.0 - 2.0 / &x[0]);
grad_test!(scalar_pow, [([3, 4], Draw::Positive)], [0], |x: &[Tensor]| x[0].pow(3.0)
    + x[0].pow(2.0)
    + x[0].pow(0.5));
grad_test!(clamp, [([3, 4], Draw::AwayFromZero)], [0], |x: &[Tensor]| x[0].clamp(-0.9, 0.9) * 1.5);

// ---- matmul: every transpose, batched with broadcasting
grad_test!(matmul, [([3, 5], Draw::Normal), ([5, 4], Draw::Normal)], [0, 1], |x: &[Tensor]| x[0]
    .matmul(&x[1]));
grad_test!(matmul_ta, [([5, 3], Draw::Normal), ([5, 4], Draw::Normal)], [0, 1], |x: &[Tensor]| x[0]
    .matmul_t(&x[1], true, false));
grad_test!(matmul_tb, [([3, 5], Draw::Normal), ([4, 5], Draw::Normal)], [0, 1], |x: &[Tensor]| x[0]
    .matmul_t(&x[1], false, true));
grad_test!(matmul_tab, [([5, 3], Draw::Normal), ([4, 5], Draw::Normal)], [0, 1], |x: &[Tensor]| x[0]
    .matmul_t(&x[1], true, true));
grad_test!(matmul_batched, [([2, 3, 4], Draw::Normal), ([4, 2], Draw::Normal)], [0, 1], |x: &[Tensor]| x[0]
    .matmul(&x[1]));
grad_test!(
    matmul_batch_broadcast,
    [([2, 1, 3, 4], Draw::Normal), ([3, 4, 2], Draw::Normal)],
    [0, 1],
    |x: &[Tensor]| { x[0].matmul(&x[1]) }
);

// ---- layout
grad_test!(reshape, [([3, 4], Draw::Normal)], [0], |x: &[Tensor]| x[0].reshape([2, 6]).sigmoid());
grad_test!(permute, [([2, 3, 4], Draw::Normal)], [0], |x: &[Tensor]| x[0].permute(&[2, 0, 1]));
grad_test!(transpose, [([3, 4], Draw::Normal)], [0], |x: &[Tensor]| x[0].t());
grad_test!(broadcast_to, [([3, 1], Draw::Normal)], [0], |x: &[Tensor]| x[0].broadcast_to([2, 3, 4]));
grad_test!(copy, [([3, 4], Draw::Normal)], [0], |x: &[Tensor]| x[0].copy());
grad_test!(
    concat,
    [([2, 3], Draw::Normal), ([2, 1], Draw::Normal), ([2, 2], Draw::Normal)],
    [0, 1, 2],
    |x: &[Tensor]| { x[0].concat(&[&x[1], &x[2]], 1) }
);
grad_test!(slice, [([4, 5], Draw::Normal)], [0], |x: &[Tensor]| x[0].slice(1, 1, 3));
grad_test!(pad, [([3, 2], Draw::Normal)], [0], |x: &[Tensor]| x[0].pad(0, 1, 2));

// ---- reductions and normalisers
grad_test!(sum, [([2, 3, 4], Draw::Normal)], [0], |x: &[Tensor]| x[0].sum([0, 2], false));
grad_test!(sum_keepdims, [([2, 3, 4], Draw::Normal)], [0], |x: &[Tensor]| x[0].sum(1, true));
grad_test!(mean, [([2, 3, 4], Draw::Normal)], [0], |x: &[Tensor]| x[0].mean(-1, false));
grad_test!(mean_all, [([3, 4], Draw::Normal)], [0], |x: &[Tensor]| x[0].mean(.., false));
grad_test!(max, [([3, 4], Draw::Distinct)], [0], |x: &[Tensor]| x[0].max(1, false));
grad_test!(max_keepdims, [([2, 3, 4], Draw::Distinct)], [0], |x: &[Tensor]| x[0].max([0, 2], true));
grad_test!(softmax, [([3, 5], Draw::Normal)], [0], |x: &[Tensor]| x[0].softmax(-1));
grad_test!(softmax_axis0, [([3, 5], Draw::Normal)], [0], |x: &[Tensor]| x[0].softmax(0));
grad_test!(log_softmax, [([3, 5], Draw::Normal)], [0], |x: &[Tensor]| x[0].log_softmax(-1));

// ---- convolution, pooling, embedding
grad_test!(
    conv2d_same,
    [([2, 5, 5, 3], Draw::Normal), ([3, 3, 3, 2], Draw::Normal)],
    [0, 1],
    |x: &[Tensor]| { x[0].conv2d(&x[1], [1, 1], Padding::Same) }
);
grad_test!(
    conv2d_valid_stride2,
    [([1, 7, 6, 2], Draw::Normal), ([3, 2, 2, 3], Draw::Normal)],
    [0, 1],
    |x: &[Tensor]| { x[0].conv2d(&x[1], [2, 2], Padding::Valid) }
);
grad_test!(
    conv2d_same_stride2,
    [([1, 6, 6, 2], Draw::Normal), ([3, 3, 2, 2], Draw::Normal)],
    [0, 1],
    |x: &[Tensor]| { x[0].conv2d(&x[1], [2, 2], Padding::Same) }
);
// ---- attention (`Op::Attention`, differentiated through `Op::AttentionGrad`)
grad_test!(
    attention,
    [([2, 3, 5, 4], Draw::Normal), ([2, 3, 7, 4], Draw::Normal), ([2, 3, 7, 4], Draw::Normal)],
    [0, 1, 2],
    |x: &[Tensor]| { x[0].attention(&x[1], &x[2], None, 0.5, false) }
);
grad_test!(
    attention_causal,
    [([1, 2, 6, 3], Draw::Normal), ([1, 2, 6, 3], Draw::Normal), ([1, 2, 6, 3], Draw::Normal)],
    [0, 1, 2],
    |x: &[Tensor]| { x[0].attention(&x[1], &x[2], None, 0.7, true) }
);
grad_test!(
    attention_causal_fewer_queries_with_learned_bias,
    [([2, 4, 3], Draw::Normal), ([2, 6, 3], Draw::Normal), ([2, 6, 3], Draw::Normal), ([4, 6], Draw::Normal)],
    [0, 1, 2, 3],
    |x: &[Tensor]| { x[0].attention(&x[1], &x[2], Some(&x[3]), 0.6, true) }
);
grad_test!(
    attention_padding_mask,
    [
        ([2, 2, 5, 4], Draw::Normal),
        ([2, 2, 5, 4], Draw::Normal),
        ([2, 2, 5, 4], Draw::Normal),
        ([2, 1, 1, 5], Draw::Mask)
    ],
    [0, 1, 2],
    |x: &[Tensor]| {
        x[0].record(
            Op::Attention { scale: 0.5, causal: false },
            &[&x[0], &x[1], &x[2], &(x[3].mul(1e9) - 1e9)],
        )
    }
);
/// A window over `size` with a stride, explicit pads `[top, left, bottom, right]`, a dilation
/// and a group count.
fn window(size: [usize; 2], stride: usize, pads: [usize; 4], dilation: usize, groups: usize) -> Window2d {
    let padding = Padding::Explicit { before: [pads[0], pads[1]], after: [pads[2], pads[3]] };
    Window2d::new(size, [stride; 2], padding).dilated([dilation; 2]).grouped(groups)
}
grad_test!(
    conv2d_depthwise,
    [([2, 5, 6, 4], Draw::Normal), ([3, 3, 1, 4], Draw::Normal)],
    [0, 1],
    |x: &[Tensor]| { x[0].conv2d_window(&x[1], window([3, 3], 1, [1, 1, 1, 1], 1, 4)) }
);
grad_test!(
    conv2d_depthwise_multiplier_stride2_asymmetric,
    [([1, 7, 6, 3], Draw::Normal), ([3, 3, 1, 6], Draw::Normal)],
    [0, 1],
    |x: &[Tensor]| { x[0].conv2d_window(&x[1], window([3, 3], 2, [0, 1, 1, 0], 1, 3)) }
);
grad_test!(
    conv2d_grouped,
    [([2, 5, 5, 6], Draw::Normal), ([3, 2, 3, 4], Draw::Normal)],
    [0, 1],
    |x: &[Tensor]| { x[0].conv2d_window(&x[1], window([3, 2], 1, [1, 0, 1, 1], 1, 2)) }
);
grad_test!(
    conv2d_dilated,
    [([1, 7, 7, 2], Draw::Normal), ([3, 3, 2, 3], Draw::Normal)],
    [0, 1],
    |x: &[Tensor]| { x[0].conv2d_window(&x[1], window([3, 3], 1, [2, 2, 2, 2], 2, 1)) }
);
grad_test!(
    conv2d_dilated_grouped_stride2,
    [([1, 9, 8, 4], Draw::Normal), ([3, 3, 2, 4], Draw::Normal)],
    [0, 1],
    |x: &[Tensor]| { x[0].conv2d_window(&x[1], window([3, 3], 2, [1, 2, 0, 1], 2, 2)) }
);
grad_test!(
    conv2d_dense_asymmetric_pads,
    [([1, 6, 6, 2], Draw::Normal), ([3, 3, 2, 3], Draw::Normal)],
    [0, 1],
    |x: &[Tensor]| { x[0].conv2d_window(&x[1], window([3, 3], 2, [0, 0, 1, 1], 1, 1)) }
);
grad_test!(max_pool2d_asymmetric_pads, [([1, 6, 5, 2], Draw::Distinct)], [0], |x: &[Tensor]| {
    x[0].pool2d_window(PoolKind::Max, window([3, 3], 2, [0, 1, 1, 1], 1, 1))
});
grad_test!(avg_pool2d_asymmetric_pads, [([2, 5, 5, 2], Draw::Normal)], [0], |x: &[Tensor]| {
    x[0].pool2d_window(PoolKind::Avg, window([3, 3], 2, [1, 0, 1, 2], 1, 1))
});
grad_test!(max_pool2d, [([2, 4, 4, 3], Draw::Distinct)], [0], |x: &[Tensor]| x[0].max_pool2d(
    [2, 2],
    [2, 2],
    Padding::Valid
));
grad_test!(max_pool2d_overlapping, [([1, 5, 5, 2], Draw::Distinct)], [0], |x: &[Tensor]| {
    x[0].max_pool2d([3, 3], [2, 2], Padding::Same)
});
grad_test!(avg_pool2d, [([2, 5, 5, 2], Draw::Normal)], [0], |x: &[Tensor]| x[0].avg_pool2d(
    [2, 2],
    [2, 2],
    Padding::Same
));
grad_test!(gather, [([6, 3], Draw::Normal), ([2, 4], Draw::Ids(6))], [0], |x: &[Tensor]| x[0].gather(&x[1]));

// ---- losses (gradients with respect to the predictions)
grad_test!(binary_crossentropy, [([6, 1], Draw::Positive), ([6, 1], Draw::Mask)], [0], |x: &[Tensor]| {
    losses::binary_crossentropy(&(&x[0] * 0.4), &x[1])
});
grad_test!(softmax_crossentropy, [([4, 5], Draw::Normal), ([4, 5], Draw::Mask)], [0], |x: &[Tensor]| {
    losses::softmax_crossentropy(&x[0], &x[1])
});
grad_test!(mean_squared_error, [([4, 3], Draw::Normal), ([4, 3], Draw::Normal)], [0, 1], |x: &[Tensor]| {
    losses::mean_squared_error(&x[0], &x[1])
});

// ---- a whole layer: gradients flow through Dense's parameters' consumers
grad_test!(
    dense_chain,
    [([4, 3], Draw::Normal), ([3, 5], Draw::Normal), ([5], Draw::Normal)],
    [0, 1, 2],
    |x: &[Tensor]| { (x[0].matmul(&x[1]) + &x[2]).tanh() }
);

// ---- a three-layer network with its loss, parameters as inputs: checks the whole backward graph
// (accumulation, in-place reuse, transposed matmuls) at once.
grad_test!(
    mlp_with_loss,
    [
        ([6, 2], Draw::Normal),
        ([2, 5], Draw::Normal),
        ([5], Draw::Normal),
        ([5, 4], Draw::Normal),
        ([4], Draw::Normal),
        ([4, 1], Draw::Normal),
        ([1], Draw::Normal),
        ([6, 1], Draw::Mask)
    ],
    [0, 1, 2, 3, 4, 5, 6],
    |x: &[Tensor]| {
        let h = (x[0].matmul(&x[1]) + &x[2]).tanh();
        let h = (h.matmul(&x[3]) + &x[4]).tanh();
        let p = (h.matmul(&x[5]) + &x[6]).sigmoid();
        losses::binary_crossentropy(&p, &x[7])
    }
);

/// An operand needed only for its shape is not a data dependency: average pooling's gradient
/// reads dy alone, so nothing in the backward pass reads the pooled input (a convolution's
/// output here), which dies at the pool.
#[test]
fn avg_pool_gradient_does_not_read_the_pooled_input() {
    use kiln::compiler::autodiff::gradients;
    use kiln::compiler::ir::{Init, Op, PoolKind};
    let t = Tracer::new("avg");
    let x = t.input("x", [2, 8, 8, 3]);
    let w = t.param("w", [3, 3, 3, 4], Init::GlorotUniform);
    let pooled = x.conv2d(&w, [1, 1], Padding::Same).avg_pool2d([2, 2], [2, 2], Padding::Valid);
    let loss = pooled.mean([0, 1, 2, 3], false);
    t.output("loss", &loss);
    let graph = t.finish().unwrap();
    let (loss, w) = (graph.output("loss").unwrap(), graph.variable("w").unwrap());
    let (g, _) = gradients(graph, loss, &[w]).unwrap();
    let conv = g.node_ids().find(|&n| matches!(g.node(n).op, Op::Conv2d { .. })).unwrap();
    let readers: Vec<String> = g.users(conv).iter().map(|&u| g.node(u).op.name().to_string()).collect();
    assert_eq!(readers, ["avg_pool2d"], "only the pool reads the convolution's output");
    assert!(g.node_ids().any(|n| matches!(g.node(n).op, Op::AvgPool2dGrad { .. })));
    assert!(!g.node_ids().any(|n| matches!(g.node(n).op, Op::Pool2dGrad { kind: PoolKind::Avg, .. })));
}

// ---- composed layers and activations
grad_test!(gelu_tanh, [([3, 4], Draw::Normal)], [0], |x: &[Tensor]| x[0].gelu_tanh());
grad_test!(rms_norm, [([3, 8], Draw::Normal)], [0], |x: &[Tensor]| {
    kiln::compiler::nn::RmsNorm::new().forward(&x[0])
});
grad_test!(layer_norm_without_affine, [([3, 8], Draw::Normal)], [0], |x: &[Tensor]| {
    kiln::compiler::nn::LayerNorm::new().center(false).scale(false).epsilon(1e-5).forward(&x[0])
});
grad_test!(tril, [([2, 3, 4], Draw::Normal)], [0], |x: &[Tensor]| x[0].tril(0) + x[0].tril(-1));
