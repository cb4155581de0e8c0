"""The real-scale architectures, as kiln's real-scale comparison trains them: torchvision's
ResNet-50, EfficientNet-B0, MobileNetV3-small and ViT-B/16 on 224x224 images, transformers'
GPT-2 small and BERT-base on 256 tokens; random weights, dropout off in the transformers
(their configs' probabilities 0). One training step is MSE against a target of the output's
shape and Adam (lr 1e-3, eps 1e-7), as `kiln train` / `kiln memory --mode train` run it.

`specs(torch, nn)` gives torch_stream.py's entries: name -> (build, make_x, make_y, loss, lr),
the transformers both with eager attention (`gpt2`, `bert`) and with PyTorch's SDPA
(`gpt2-sdpa`, `bert-sdpa`). `build(name)` and `example(torch, name, batch)` are what export.py
exports."""

SEQ = 256
BATCH = {
    "resnet50": 32,
    "efficientnet_b0": 32,
    "mobilenet_v3_small": 2,
    "vit_b_16": 16,
    "gpt2": 4,
    "bert": 8,
}


def out_shape(name, batch):
    if name == "gpt2":
        return (batch, SEQ, 50257)
    if name == "bert":
        return (batch, SEQ, 768)
    return (batch, 1000)


def build(name, attn="eager"):
    """The model, its first output alone (a transformers model returns a tuple)."""
    import torch

    if name in ("gpt2", "bert"):
        if name == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False)
            cfg._attn_implementation = attn
            inner = GPT2LMHeadModel(cfg)
        else:
            from transformers import BertConfig, BertModel

            cfg = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
            cfg._attn_implementation = attn
            inner = BertModel(cfg, add_pooling_layer=False)

        import transformers

        # transformers 5 looks for packed sequences when GPT-2 gets no mask (torch.diff, which
        # the TorchScript exporter lacks): there GPT-2 gets a mask of ones.
        masked = int(transformers.__version__.split(".")[0]) >= 5

        class First(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = inner

            def forward(self, *xs):
                if name == "bert" and len(xs) == 1:
                    xs = (xs[0], torch.ones_like(xs[0]))
                # A tuple in every transformers version (a config's return_dict=False breaks
                # GPT2LMHeadModel in transformers 5, whose inner model then returns a tuple).
                if name == "gpt2" and masked:
                    return self.inner(xs[0], attention_mask=torch.ones_like(xs[0]), return_dict=False)[0]
                return self.inner(*xs, return_dict=False)[0]

        return First()
    import torchvision

    return getattr(torchvision.models, name)(weights=None)


def example(torch, name, batch):
    """(inputs, input names) for an export at `batch`."""
    if name in ("gpt2", "bert"):
        ids = torch.randint(0, 1000, (batch, SEQ), dtype=torch.int64)
        if name == "gpt2":
            return (ids,), ["input_ids"]
        return (ids, torch.ones(batch, SEQ, dtype=torch.int64)), ["input_ids", "attention_mask"]
    return (torch.randn(batch, 3, 224, 224),), ["x"]


def specs(torch, nn, batch=None):
    """torch_stream.py's entries for the real-scale models (empty where torchvision or
    transformers is missing), at `batch` or each model's training batch."""
    F = nn.functional
    out = {}
    for name, default in BATCH.items():
        batch_of = batch or default
        attns = ["eager", "sdpa"] if name in ("gpt2", "bert") else [None]
        for attn in attns:
            key = name if attn in (None, "eager") else f"{name}-sdpa"

            def make_x(dev, name=name, batch=batch_of):
                return tuple(t.to(dev) for t in example(torch, name, batch)[0])[0]

            def make_y(dev, name=name, batch=batch_of):
                return torch.randn(*out_shape(name, batch), device=dev)

            out[key] = (
                (lambda name=name, attn=attn: build(name, attn or "eager")),
                make_x,
                make_y,
                lambda p, y: F.mse_loss(p, y),
                1e-3,
            )
    return out
