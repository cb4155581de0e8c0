#!/usr/bin/env python3
"""XLA's buffer assignment for one training step of the Flax versions of the real-scale models.

The models are those of models.py, at its batches and input shapes, written for Flax:

- gpt2: transformers' FlaxGPT2LMHeadModel (GPT-2 small, tied head), logits [4, 256, 50257].
- bert: transformers' FlaxBertModel without its pooler, an all-ones attention mask as second
  input, last hidden state [8, 256, 768].
- vit_b_16: transformers' FlaxViTForImageClassification configured as torchvision's ViT-B/16
  (16x16 patches, 768 wide, 12 layers and heads, MLP 3072, exact GELU, LayerNorm eps 1e-6,
  final LayerNorm, a 1000-way head on the class token), logits [16, 1000].
- resnet50: transformers' FlaxResNetForImageClassification with ResNetConfig's defaults (the
  ResNet-50 of torchvision: bottlenecks 3-4-6-3, stride in the 3x3 convolution), [32, 1000].
- efficientnet_b0, mobilenet_v3_small: written below in flax.linen with torchvision's
  architecture (channels, kernels, strides, expansions, squeeze-and-excitation, activations,
  BatchNorm epsilon and momentum, classifier), [32, 1000] and [2, 1000].

Token ids are int32 (JAX without x64; PyTorch's are int64) and images NCHW 3x224x224 as
PyTorch's, transposed to NHWC inside the step. Dropout is off everywhere (the transformers'
probabilities are 0 as in models.py; torchvision's classifier dropout and EfficientNet's
stochastic depth are left out), BatchNorm runs in training mode on batch statistics and its
running statistics are updated and returned.

The step: forward, MSE against a target of the output's shape, gradients, optax.adam (lr 1e-3,
eps 1e-7: PyTorch's Adam), all in one jax.jit with the parameters, the BatchNorm statistics and
the optimizer state donated; inputs and target are arguments, the loss an output. Nothing runs:
the step is lowered from jax.ShapeDtypeStruct and compiled on the CPU backend, and
compiled.memory_analysis() is read. total = argument + output + temp - alias, as in
scripts/peers/xla_memory.py.

Library fusion: where jaxlib's CPU backend has YNNPACK fusion (xla_cpu_experimental_ynn_fusion_type),
the main figures are compiled with it emptied, so that every intermediate is an XLA buffer; the
default flags' temp and total are reported beside them (default_flags_*).

Usage: xla.py [--models gpt2,resnet50,...]   prints one JSON object on stdout:
       {"jax", "jaxlib", "flax", "optax", "transformers", "backend",
        "models": {name: {"argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
                          "total_bytes", "parameters", "parameter_bytes", "batch_stats", "batch",
                          "default_flags_temp_bytes", "default_flags_total_bytes"}}}
       (parameters: the model's trainable element count; batch_stats: BatchNorm running
       statistics' element count).
"""

import argparse
import json
import math
import os
import sys
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

import flax  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "peers"))
import models  # noqa: E402
from xla_memory import raw_figures  # noqa: E402  (the zoo's XLA figures, counted alike)

F32 = jnp.float32
LR, ADAM_EPS = 1e-3, 1e-7
IMAGE = (3, 224, 224)

# ---------------------------------------------------------------- torchvision's CNNs in flax.linen


def make_divisible(v, divisor=8):
    """torchvision's _make_divisible: the nearest multiple of `divisor`, never 10% below `v`."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class ConvNormAct(nn.Module):
    """torchvision's Conv2dNormActivation: a bias-free convolution padded by (k - 1) // 2,
    BatchNorm in training mode, then the activation (none where `act` is None)."""

    features: int
    kernel: int = 1
    stride: int = 1
    groups: int = 1
    act: object = None
    bn_eps: float = 1e-5
    bn_momentum: float = 0.1  # PyTorch's convention: the new statistics' weight

    @nn.compact
    def __call__(self, x):
        p = (self.kernel - 1) // 2
        x = nn.Conv(
            self.features,
            (self.kernel, self.kernel),
            strides=self.stride,
            padding=((p, p), (p, p)),
            feature_group_count=self.groups,
            use_bias=False,
        )(x)
        x = nn.BatchNorm(use_running_average=False, momentum=1.0 - self.bn_momentum, epsilon=self.bn_eps)(x)
        return x if self.act is None else self.act(x)


class SqueezeExcitation(nn.Module):
    """torchvision's SqueezeExcitation: global average, 1x1 convolution to `squeeze` channels with
    bias, `act`, 1x1 convolution back with bias, `scale_act`, times the input."""

    squeeze: int
    act: object = nn.relu
    scale_act: object = nn.sigmoid

    @nn.compact
    def __call__(self, x):
        s = jnp.mean(x, axis=(1, 2), keepdims=True)
        s = self.act(nn.Conv(self.squeeze, (1, 1))(s))
        s = self.scale_act(nn.Conv(x.shape[-1], (1, 1))(s))
        return x * s


# EfficientNet-B0's stages (torchvision's MBConvConfig list at width and depth 1.0):
# expand ratio, kernel, stride, input channels, output channels, blocks.
EFFICIENTNET_B0 = [
    (1, 3, 1, 32, 16, 1),
    (6, 3, 2, 16, 24, 2),
    (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 3),
    (6, 5, 1, 80, 112, 3),
    (6, 5, 2, 112, 192, 4),
    (6, 3, 1, 192, 320, 1),
]


class MBConv(nn.Module):
    """torchvision's MBConv: 1x1 expansion (SiLU) where the ratio is not 1, depthwise k x k (SiLU),
    squeeze-and-excitation to input // 4 channels (SiLU, sigmoid), 1x1 projection; the residual
    where stride 1 keeps the width (stochastic depth left out)."""

    expand: int
    kernel: int
    stride: int
    cin: int
    cout: int

    @nn.compact
    def __call__(self, x):
        expanded = make_divisible(self.cin * self.expand)
        y = x
        if expanded != self.cin:
            y = ConvNormAct(expanded, 1, act=nn.silu)(y)
        y = ConvNormAct(expanded, self.kernel, self.stride, groups=expanded, act=nn.silu)(y)
        y = SqueezeExcitation(max(1, self.cin // 4), act=nn.silu)(y)
        y = ConvNormAct(self.cout, 1)(y)
        if self.stride == 1 and self.cin == self.cout:
            y = y + x
        return y


class EfficientNetB0(nn.Module):
    """torchvision's efficientnet_b0: 3x3/2 stem to 32 (SiLU), the MBConv stages, 1x1 to 1280 (SiLU),
    global average, Linear(1280, 1000); BatchNorm eps 1e-5, momentum 0.1."""

    @nn.compact
    def __call__(self, x):
        x = ConvNormAct(EFFICIENTNET_B0[0][3], 3, 2, act=nn.silu)(x)
        for expand, kernel, stride, cin, cout, blocks in EFFICIENTNET_B0:
            for i in range(blocks):
                x = MBConv(expand, kernel, stride if i == 0 else 1, cin if i == 0 else cout, cout)(x)
        x = ConvNormAct(4 * EFFICIENTNET_B0[-1][4], 1, act=nn.silu)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(1000)(x)


# MobileNetV3-small's blocks (torchvision's InvertedResidualConfig list at width 1.0):
# input channels, kernel, expanded channels, output channels, SE, hardswish (else ReLU), stride.
MOBILENET_V3_SMALL = [
    (16, 3, 16, 16, True, False, 2),
    (16, 3, 72, 24, False, False, 2),
    (24, 3, 88, 24, False, False, 1),
    (24, 5, 96, 40, True, True, 2),
    (40, 5, 240, 40, True, True, 1),
    (40, 5, 240, 40, True, True, 1),
    (40, 5, 120, 48, True, True, 1),
    (48, 5, 144, 48, True, True, 1),
    (48, 5, 288, 96, True, True, 2),
    (96, 5, 576, 96, True, True, 1),
    (96, 5, 576, 96, True, True, 1),
]
MOBILENET_BN = {"bn_eps": 1e-3, "bn_momentum": 0.01}


class InvertedResidual(nn.Module):
    """torchvision's MobileNetV3 InvertedResidual: 1x1 expansion where the width changes, depthwise
    k x k, squeeze-and-excitation to make_divisible(expanded // 4) (ReLU, hardsigmoid) where
    asked, 1x1 projection; the residual where stride 1 keeps the width."""

    cin: int
    kernel: int
    expanded: int
    cout: int
    se: bool
    hardswish: bool
    stride: int

    @nn.compact
    def __call__(self, x):
        act = nn.hard_swish if self.hardswish else nn.relu
        y = x
        if self.expanded != self.cin:
            y = ConvNormAct(self.expanded, 1, act=act, **MOBILENET_BN)(y)
        y = ConvNormAct(self.expanded, self.kernel, self.stride, groups=self.expanded, act=act, **MOBILENET_BN)(y)
        if self.se:
            y = SqueezeExcitation(make_divisible(self.expanded // 4), scale_act=nn.hard_sigmoid)(y)
        y = ConvNormAct(self.cout, 1, **MOBILENET_BN)(y)
        if self.stride == 1 and self.cin == self.cout:
            y = y + x
        return y


class MobileNetV3Small(nn.Module):
    """torchvision's mobilenet_v3_small: 3x3/2 stem to 16 (hardswish), the inverted residuals, 1x1
    to 576 (hardswish), global average, Linear(576, 1024), hardswish, Linear(1024, 1000);
    BatchNorm eps 1e-3, momentum 0.01."""

    @nn.compact
    def __call__(self, x):
        x = ConvNormAct(MOBILENET_V3_SMALL[0][0], 3, 2, act=nn.hard_swish, **MOBILENET_BN)(x)
        for cfg in MOBILENET_V3_SMALL:
            x = InvertedResidual(*cfg)(x)
        x = ConvNormAct(6 * MOBILENET_V3_SMALL[-1][3], 1, act=nn.hard_swish, **MOBILENET_BN)(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.hard_swish(nn.Dense(1024)(x))
        return nn.Dense(1000)(x)


# ---------------------------------------------------------------- the six models


class Model:
    """A model's abstract variables, its inputs' specs and its forward pass.

    `variables` is {"params": ..., "batch_stats": ...} (batch_stats absent without BatchNorm), of
    jax.ShapeDtypeStruct; `forward(params, stats, inputs)` returns (output, new stats)."""

    def __init__(self, variables, inputs, forward):
        self.params = variables["params"]
        self.stats = variables.get("batch_stats", {})
        self.inputs = inputs
        self.forward = forward


def image_input(batch):
    return (jax.ShapeDtypeStruct((batch, *IMAGE), F32),)


def token_inputs(name, batch):
    ids = jax.ShapeDtypeStruct((batch, models.SEQ), jnp.int32)
    return (ids,) if name == "gpt2" else (ids, ids)


def linen_model(module, batch):
    x = jnp.zeros((1, IMAGE[1], IMAGE[2], IMAGE[0]), F32)
    variables = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), x))

    def forward(params, stats, inputs):
        nhwc = jnp.transpose(inputs[0], (0, 2, 3, 1))
        out, new = module.apply({"params": params, "batch_stats": stats}, nhwc, mutable=["batch_stats"])
        return out, new["batch_stats"]

    return Model(dict(variables), image_input(batch), forward)


def hf_variables(model):
    """A transformers Flax model's variables as abstract shapes (nothing initialised)."""
    v = jax.eval_shape(lambda: model.init_weights(jax.random.PRNGKey(0), model.input_shape))
    v = flax.core.unfreeze(v)
    return v if "params" in v else {"params": v}


def gpt2(batch):
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    cfg = GPT2Config(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False)
    model = FlaxGPT2LMHeadModel(cfg, _do_init=False)

    def forward(params, stats, inputs):
        return model(inputs[0], params=params, train=False, return_dict=False)[0], stats

    return Model(hf_variables(model), token_inputs("gpt2", batch), forward)


def bert(batch):
    from transformers import BertConfig, FlaxBertModel

    cfg = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = FlaxBertModel(cfg, add_pooling_layer=False, _do_init=False)

    def forward(params, stats, inputs):
        ids, mask = inputs
        return model(ids, mask, params=params, train=False, return_dict=False)[0], stats

    return Model(hf_variables(model), token_inputs("bert", batch), forward)


def vit_b_16(batch):
    from transformers import FlaxViTForImageClassification, ViTConfig

    cfg = ViTConfig(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        layer_norm_eps=1e-6,
        image_size=224,
        patch_size=16,
        qkv_bias=True,
        num_labels=1000,
    )
    model = FlaxViTForImageClassification(cfg, _do_init=False)

    def forward(params, stats, inputs):
        # The wrapper takes NCHW pixels and transposes them to NHWC itself.
        return model(inputs[0], params=params, train=False, return_dict=False)[0], stats

    return Model(hf_variables(model), image_input(batch), forward)


def resnet50(batch):
    from transformers import FlaxResNetForImageClassification, ResNetConfig

    cfg = ResNetConfig(num_labels=1000)  # the defaults are ResNet-50's
    model = FlaxResNetForImageClassification(cfg, _do_init=False)

    def forward(params, stats, inputs):
        # NCHW pixels, transposed inside; train=True: batch statistics, running ones updated.
        out, new = model(
            inputs[0], params={"params": params, "batch_stats": stats}, train=True, return_dict=False
        )
        return out[0], new["batch_stats"]

    return Model(hf_variables(model), image_input(batch), forward)


MODELS = {
    "gpt2": gpt2,
    "resnet50": resnet50,
    "vit_b_16": vit_b_16,
    "bert": bert,
    "efficientnet_b0": lambda batch: linen_model(EfficientNetB0(), batch),
    "mobilenet_v3_small": lambda batch: linen_model(MobileNetV3Small(), batch),
}

# ---------------------------------------------------------------- measurement

YNN_FLAG = "xla_cpu_experimental_ynn_fusion_type"


def has_ynn_fusion():
    """Whether this jaxlib's CPU compiler knows the YNNPACK fusion flag."""
    try:
        jax.jit(lambda a: a + 1.0).lower(jax.ShapeDtypeStruct((2,), F32)).compile(compiler_options={YNN_FLAG: ""})
        return True
    except Exception:
        return False


def count(tree):
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(tree))


def measure(name, ynn):
    batch = models.BATCH[name]
    m = MODELS[name](batch)
    tx = optax.adam(LR, eps=ADAM_EPS)
    opt_state = jax.eval_shape(tx.init, m.params)
    y = jax.ShapeDtypeStruct(models.out_shape(name, batch), F32)

    def step(params, stats, opt_state, inputs, y):
        def loss_of(p):
            out, new_stats = m.forward(p, stats, inputs)
            return jnp.mean(jnp.square(out - y)), new_stats

        (loss, new_stats), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_stats, opt_state, loss

    out_spec = jax.eval_shape(lambda p, s, i: m.forward(p, s, i)[0], m.params, m.stats, m.inputs)
    if out_spec.shape != y.shape:
        raise SystemExit(f"{name}: output {out_spec.shape}, expected {y.shape}")
    lowered = jax.jit(step, donate_argnums=(0, 1, 2)).lower(m.params, m.stats, opt_state, m.inputs, y)
    if ynn:
        out = raw_figures(lowered.compile(compiler_options={YNN_FLAG: ""}))
        default = raw_figures(lowered.compile())
    else:
        out = raw_figures(lowered.compile())
        default = out
    out["default_flags_temp_bytes"] = default["temp_bytes"]
    out["default_flags_total_bytes"] = default["total_bytes"]
    out["parameters"] = count(m.params)
    out["parameter_bytes"] = 4 * out["parameters"]
    out["batch_stats"] = count(m.stats)
    out["batch"] = batch
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"unknown model(s) {unknown}; known: {list(MODELS)}")
    import jaxlib
    import transformers

    ynn = has_ynn_fusion()
    report = {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "transformers": transformers.__version__,
        "backend": jax.default_backend(),
        "ynn_fusion_off": ynn,
        "models": {},
    }
    for n in names:
        report["models"][n] = measure(n, ynn)
        print(f"{n}: {report['models'][n]['total_bytes'] / 1e6:,.0f} MB", file=sys.stderr)
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
