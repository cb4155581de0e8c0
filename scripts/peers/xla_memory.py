#!/usr/bin/env python3
"""XLA's memory figures for kiln's zoo models, from JAX's buffer assignment (CPU backend).

Each model is written here in plain jax.numpy / jax.nn / jax.lax with exactly the architecture,
shapes, batch size, dtype (f32), loss and optimizer of its kiln twin (src/zoo.rs, src/peers.rs,
compiler/src/nn, compiler/src/losses.rs, compiler/src/optim.rs). Nothing runs: every function is
only lowered and compiled from abstract shapes, and `compiled.memory_analysis()` is read.

- forward: jit(apply)(params, x) -> model output; no donation.
- train: jit(step, donate params, Adam m, v and the iteration counter)(params, m, v, it, x, y)
  -> (params', m', v', it', loss, metric), one Adam step with Keras's semantics as kiln's
  ApplyAdam kernel computes it.

total = argument + output + temp - alias (the bytes XLA holds for one call; donated arguments
that an output reuses are counted once).

Library fusion: jaxlib 0.10's CPU backend hands whole subgraphs (convolutions, dots, pools and
the elementwise ops between them) to YNNPACK as one custom fusion, whose intermediates YNNPACK
allocates itself at run time, outside XLA's buffer assignment (cnn forward: temp 0 bytes with two
8 MiB activations alive inside the fusion). The main figures are therefore compiled with
`xla_cpu_experimental_ynn_fusion_type` set to the empty list, so that every intermediate is an
XLA buffer; the default-flags figures (temp and total) are reported beside them.

Usage: xla_memory.py [--models seed-mlp,mlp,...]   prints one JSON object on stdout.
       xla_memory.py --time STEPS [--models ...]    times STEPS jitted forward passes and training steps per model
                                                    instead (after two warm-up steps), in ms.
"""

import argparse
import json
import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

F32 = jnp.float32

# ---------------------------------------------------------------- layers (kiln's math)


class Builder:
    """Collects parameter shapes in declaration order (the keys kiln's scopes would give)."""

    def __init__(self):
        self.shapes = {}

    def param(self, key, shape):
        assert key not in self.shapes, key
        self.shapes[key] = tuple(shape)
        return key


def dense(b, scope, fan_in, units, activation=None, bias=True):
    """activation(x @ kernel + bias), kernel [in, units] (kiln's Dense)."""
    k = b.param(f"{scope}/kernel", (fan_in, units))
    bb = b.param(f"{scope}/bias", (units,)) if bias else None

    def apply(p, x):
        y = jnp.matmul(x, p[k])
        if bb is not None:
            y = y + p[bb]
        return act(activation, y)

    return apply


def act(name, y):
    if name is None:
        return y
    if name == "relu":
        return jax.nn.relu(y)
    if name == "sigmoid":
        return jax.nn.sigmoid(y)
    if name == "gelu":
        # Exact GELU, x * Phi(x) (kiln's kernels use erf).
        return jax.nn.gelu(y, approximate=False)
    raise ValueError(name)


def conv(b, scope, cin, filters, activation="relu"):
    """3x3 SAME convolution, NHWC input, HWIO kernel, bias (kiln's Conv2D)."""
    k = b.param(f"{scope}/kernel", (3, 3, cin, filters))
    bb = b.param(f"{scope}/bias", (filters,))

    def apply(p, x):
        y = lax.conv_general_dilated(
            x, p[k], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return act(activation, y + p[bb])

    return apply


def max_pool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def avg_pool(x):
    return lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0


def layer_norm(b, scope, d, eps):
    """(x - mean) * rsqrt(var + eps) * gamma + beta over the last axis (kiln's LayerNorm)."""
    g = b.param(f"{scope}/gamma", (d,))
    be = b.param(f"{scope}/beta", (d,))

    def apply(p, x):
        centered = x - jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
        return centered * lax.rsqrt(var + eps) * p[g] + p[be]

    return apply


def attention(b, scope, d, heads):
    """Self-attention: q, k, v and output projections Dense(d) with biases; softmax(q k^T / sqrt(dh)) v."""
    q = dense(b, f"{scope}/query", d, d)
    k = dense(b, f"{scope}/key", d, d)
    v = dense(b, f"{scope}/value", d, d)
    o = dense(b, f"{scope}/output", d, d)
    dh = d // heads

    def apply(p, x):
        bs, s, _ = x.shape

        def split(t):
            return jnp.transpose(jnp.reshape(t, (bs, s, heads, dh)), (0, 2, 1, 3))

        qh, kh, vh = split(q(p, x)), split(k(p, x)), split(v(p, x))
        scores = jnp.matmul(qh, jnp.swapaxes(kh, -1, -2)) * (1.0 / math.sqrt(dh))
        context = jnp.matmul(jax.nn.softmax(scores, axis=-1), vh)
        merged = jnp.reshape(jnp.transpose(context, (0, 2, 1, 3)), (bs, s, d))
        return o(p, merged)

    return apply


def embedding(b, scope, vocab, d):
    """Rows of a [vocab, d] table gathered by ids stored as f32 (kiln's Embedding)."""
    t = b.param(f"{scope}/embeddings", (vocab, d))

    def apply(p, ids):
        return jnp.take(p[t], ids.astype(jnp.int32), axis=0)

    return apply


def pre_ln_block(b, scope, d, heads, hidden, eps=1e-5):
    ln1 = layer_norm(b, f"{scope}/attention/ln", d, eps)
    att = attention(b, f"{scope}/attention/mha", d, heads)
    ln2 = layer_norm(b, f"{scope}/mlp/ln", d, eps)
    up = dense(b, f"{scope}/mlp/up", d, hidden, "gelu")
    down = dense(b, f"{scope}/mlp/down", hidden, d)

    def apply(p, x):
        x = x + att(p, ln1(p, x))
        return x + down(p, up(p, ln2(p, x)))

    return apply


# ---------------------------------------------------------------- losses and metrics (compiler/src/losses.rs)

EPSILON = 1e-7


def binary_crossentropy(pred, y):
    """On probabilities, clamped to [eps, 1 - eps] as Keras (and kiln) do."""
    p = jnp.clip(pred, EPSILON, 1.0 - EPSILON)
    return -jnp.mean(y * jnp.log(p) + (1.0 - y) * jnp.log(1.0 - p))


def softmax_crossentropy(logits, labels):
    return jnp.mean(-jnp.sum(labels * jax.nn.log_softmax(logits, axis=-1), axis=-1))


def binary_accuracy(pred, y):
    return jnp.mean((pred > 0.5).astype(F32) == y, dtype=F32)


def categorical_accuracy(pred, y):
    is_max = (pred == jnp.max(pred, axis=-1, keepdims=True)).astype(F32)
    return jnp.mean(jnp.sum(y * is_max, axis=-1))


# ---------------------------------------------------------------- models


def seed_mlp(b):
    l1 = dense(b, "dense", 100, 10, "relu")
    l2 = dense(b, "dense_1", 10, 1, "sigmoid")
    return (lambda p, x: l2(p, l1(p, x))), (32, 100), (32, 1), "bce"


def mlp(b):
    ls = [dense(b, "dense", 784, 1024, "relu"), dense(b, "dense_1", 1024, 1024, "relu"), dense(b, "dense_2", 1024, 10)]

    def apply(p, x):
        for layer in ls:
            x = layer(p, x)
        return x

    return apply, (256, 784), (256, 10), "softmax"


def cnn(b):
    c = [conv(b, "conv2d", 3, 32), conv(b, "conv2d_1", 32, 32), conv(b, "conv2d_2", 32, 64), conv(b, "conv2d_3", 64, 64)]
    d1 = dense(b, "dense", 8 * 8 * 64, 128, "relu")
    d2 = dense(b, "dense_1", 128, 10)

    def apply(p, x):
        x = max_pool(c[1](p, c[0](p, x)))
        x = max_pool(c[3](p, c[2](p, x)))
        x = jnp.reshape(x, (x.shape[0], -1))
        return d2(p, d1(p, x))

    return apply, (64, 32, 32, 3), (64, 10), "softmax"


def transformer_of(batch, seq, vocab, d, heads, hidden, blocks):
    def build(b):
        emb = embedding(b, "embedding", vocab, d)
        bl = [pre_ln_block(b, f"block_{i}", d, heads, hidden) for i in range(blocks)]
        ln = layer_norm(b, "layer_normalization", d, 1e-5)
        head = dense(b, "dense", d, vocab)

        def apply(p, ids):
            x = emb(p, ids)
            for block in bl:
                x = block(p, x)
            return head(p, ln(p, x))

        return apply, (batch, seq), (batch, seq, vocab), "softmax"

    return build


def res_mlp(b):
    """Dense(512, relu) input projection, 6 x [x + relu(Dense(512))(relu(Dense(512))(x))], Dense(10)."""
    proj = dense(b, "dense", 784, 512, "relu")
    blocks = [
        (dense(b, f"residual_{i}/dense", 512, 512, "relu"), dense(b, f"residual_{i}/dense_1", 512, 512, "relu"))
        for i in range(6)
    ]
    head = dense(b, "dense_1", 512, 10)

    def apply(p, x):
        x = proj(p, x)
        for f, g in blocks:
            x = x + g(p, f(p, x))
        return head(p, x)

    return apply, (256, 784), (256, 10), "softmax"


def vgg_avg(b):
    """32x32x3: (conv 32 relu) x2, avg-pool, (conv 64) x2, avg-pool, (conv 128) x2, avg-pool, dense 256 relu, dense 10."""
    widths = [(3, 32), (32, 32), (32, 64), (64, 64), (64, 128), (128, 128)]
    c = [conv(b, f"conv2d_{i}", cin, cout) for i, (cin, cout) in enumerate(widths)]
    d1 = dense(b, "dense", 4 * 4 * 128, 256, "relu")
    d2 = dense(b, "dense_1", 256, 10)

    def apply(p, x):
        for i in range(0, 6, 2):
            x = avg_pool(c[i + 1](p, c[i](p, x)))
        x = jnp.reshape(x, (x.shape[0], -1))
        return d2(p, d1(p, x))

    return apply, (64, 32, 32, 3), (64, 10), "softmax"


MODELS = {
    "seed-mlp": seed_mlp,
    "mlp": mlp,
    "cnn": cnn,
    "transformer": transformer_of(8, 128, 1000, 256, 4, 1024, 1),
    "res-mlp": res_mlp,
    "vgg-avg": vgg_avg,
    "transformer-2": transformer_of(16, 64, 500, 128, 4, 512, 2),
}

# ---------------------------------------------------------------- Adam (compiler/src/optim.rs, Keras semantics)

BETA1, BETA2, ADAM_EPS = 0.9, 0.999, 1e-7


def adam_update(lr, p, g, m, v, it):
    t = it + 1.0
    alpha = lr * jnp.sqrt(1.0 - BETA2**t) / (1.0 - BETA1**t)
    m = m + (g - m) * (1.0 - BETA1)
    v = v + (g * g - v) * (1.0 - BETA2)
    return p - alpha * m / (jnp.sqrt(v) + ADAM_EPS), m, v


# ---------------------------------------------------------------- measurement


# Every YNNPACK library fusion off: intermediates stay in XLA's buffer assignment.
NO_LIBRARY_FUSION = {"xla_cpu_experimental_ynn_fusion_type": ""}


def figures(lowered):
    out = raw_figures(lowered.compile(compiler_options=NO_LIBRARY_FUSION))
    default = raw_figures(lowered.compile())
    out["default_flags_temp_bytes"] = default["temp_bytes"]
    out["default_flags_total_bytes"] = default["total_bytes"]
    return out


def raw_figures(compiled):
    m = compiled.memory_analysis()
    arg, out, temp, alias = (
        int(m.argument_size_in_bytes),
        int(m.output_size_in_bytes),
        int(m.temp_size_in_bytes),
        int(m.alias_size_in_bytes),
    )
    return {
        "argument_bytes": arg,
        "output_bytes": out,
        "temp_bytes": temp,
        "alias_bytes": alias,
        "total_bytes": arg + out + temp - alias,
    }


def measure(name):
    b = Builder()
    apply, x_shape, y_shape, loss_kind = MODELS[name](b)
    lr = 0.01 if name == "seed-mlp" else 1e-3
    if loss_kind == "bce":
        loss_fn, metric_fn = binary_crossentropy, binary_accuracy
    else:
        loss_fn, metric_fn = softmax_crossentropy, categorical_accuracy

    spec = lambda shape: jax.ShapeDtypeStruct(shape, F32)  # noqa: E731
    params = {k: spec(s) for k, s in b.shapes.items()}
    x, y = spec(x_shape), spec(y_shape)
    it = spec(())

    forward = jax.jit(apply).lower(params, x)

    def step(params, m, v, it, x, y):
        def loss_of(p):
            pred = apply(p, x)
            return loss_fn(pred, y), metric_fn(pred, y)

        (loss, metric), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        new_p, new_m, new_v = {}, {}, {}
        for k in params:
            new_p[k], new_m[k], new_v[k] = adam_update(lr, params[k], grads[k], m[k], v[k], it)
        return new_p, new_m, new_v, it + 1.0, loss, metric

    train = jax.jit(step, donate_argnums=(0, 1, 2, 3)).lower(params, params, params, it, x, y)

    param_bytes = 4 * sum(math.prod(s) for s in b.shapes.values())
    return {
        "batch": x_shape[0],
        "parameters": len(b.shapes),
        "parameter_bytes": param_bytes,
        "forward": figures(forward),
        "train": figures(train),
    }


def time_steps(name, steps):
    """Milliseconds of each of `steps` jitted forward passes (jit(apply)(params, x)) and of as many
    jitted, donated training steps, on real arrays (uniform x, one-hot or binary y, Glorot-like
    parameters), each after two warm-up calls (compilation)."""
    import time

    b = Builder()
    apply, x_shape, y_shape, loss_kind = MODELS[name](b)
    lr = 0.01 if name == "seed-mlp" else 1e-3
    loss_fn = binary_crossentropy if loss_kind == "bce" else softmax_crossentropy
    key = jax.random.PRNGKey(0)
    params = {}
    for i, (k, s) in enumerate(b.shapes.items()):
        params[k] = jax.random.uniform(jax.random.fold_in(key, i), s, F32, -0.05, 0.05)
    m = {k: jnp.zeros_like(v) for k, v in params.items()}
    v = {k: jnp.zeros_like(p) for k, p in params.items()}
    it = jnp.zeros((), F32)
    if name.startswith("transformer"):
        vocab = y_shape[-1]
        x = jax.random.randint(jax.random.fold_in(key, 998), x_shape, 0, vocab).astype(F32)
    else:
        x = jax.random.uniform(jax.random.fold_in(key, 998), x_shape, F32)
    if loss_kind == "bce":
        y = (jax.random.uniform(jax.random.fold_in(key, 999), y_shape) > 0.5).astype(F32)
    else:
        labels = jax.random.randint(jax.random.fold_in(key, 999), y_shape[:-1], 0, y_shape[-1])
        y = jax.nn.one_hot(labels, y_shape[-1], dtype=F32)

    def step(params, m, v, it, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(apply(p, x), y))(params)
        new_p, new_m, new_v = {}, {}, {}
        for k in params:
            new_p[k], new_m[k], new_v[k] = adam_update(lr, params[k], grads[k], m[k], v[k], it)
        return new_p, new_m, new_v, it + 1.0, loss

    forward = jax.jit(apply)
    forward_times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        forward(params, x).block_until_ready()
        if i >= 2:
            forward_times.append((time.perf_counter() - t0) * 1e3)
    train = jax.jit(step, donate_argnums=(0, 1, 2, 3))
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        params, m, v, it, loss = train(params, m, v, it, x, y)
        loss.block_until_ready()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return {"train_step_ms": times, "forward_ms": forward_times}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--time", type=int, default=0, help="time this many forward passes and training steps per model")
    args = ap.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"unknown model(s) {unknown}; known: {list(MODELS)}")
    import jaxlib

    out = {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "models": {n: (time_steps(n, args.time) if args.time else measure(n)) for n in names},
    }
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
