"""Tiny Hugging Face models for the engine's real-model checks (tests and benchmarks).

Each entry builds a randomly initialised model from a config (no download), a fixed batch
and a training step (forward, loss, backward, AdamW, ``loss.item()``). Two sizes: ``issue``
is the configuration the real-models issue measured (hidden 64, 2 layers, batch 2 x 32
tokens), ``m`` one where compute weighs more (hidden 256, batch 4 x 128 tokens), ``tiny`` a
smaller one that keeps the test suite's Inductor compiles short.

Needs ``transformers`` (the ``test`` extra).
"""

from __future__ import annotations

import torch

__all__ = ["MODELS", "DECODERS", "build", "train_step"]

SIZES = {
    "issue": dict(hidden=64, inter=172, layers=2, heads=4, kv=2, batch=2, seq=32, vocab=256),
    "m": dict(hidden=256, inter=688, layers=2, heads=4, kv=2, batch=4, seq=128, vocab=256),
    "tiny": dict(hidden=32, inter=64, layers=1, heads=2, kv=1, batch=2, seq=8, vocab=128),
}

# Dense decoder-only language models: the bar is <= 3 launches per hot step.
DECODERS = ("llama", "mistral", "gpt2")
MODELS = DECODERS + ("bert", "t5", "vit", "qwen2moe")


def _model(name: str, s: dict):
    import transformers as tf

    dec = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
               num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
               num_key_value_heads=s["kv"], max_position_embeddings=2 * s["seq"] + 32)
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**dec))
    if name == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**dec))
    if name == "qwen2moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            # expert widths a multiple of 8: grouped_mm wants 16-byte aligned strides
            **dec, moe_intermediate_size=s["inter"] // 16 * 8,
            shared_expert_intermediate_size=s["inter"] // 16 * 8, num_experts=4,
            num_experts_per_tok=2))
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=s["vocab"], n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"],
            n_positions=dec["max_position_embeddings"]))
    if name == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(
            vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"], intermediate_size=s["inter"],
            max_position_embeddings=dec["max_position_embeddings"]))
    if name == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=s["vocab"], d_model=s["hidden"], d_kv=s["hidden"] // s["heads"],
            d_ff=s["inter"], num_layers=s["layers"], num_heads=s["heads"],
            decoder_start_token_id=0))
    if name == "vit":
        return tf.ViTForImageClassification(tf.ViTConfig(
            image_size=32, patch_size=8, hidden_size=s["hidden"], num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"], intermediate_size=s["inter"], num_labels=10))
    raise ValueError(f"unknown model {name!r}; accepted: {', '.join(MODELS)}")


def sized(hidden: int, layers: int) -> dict:
    """The ``issue`` configuration scaled to ``hidden`` and ``layers`` (the MLP's width and
    the batch stay in proportion: how the engine's lead grows with the work)."""
    return dict(SIZES["issue"], hidden=hidden, inter=hidden * 172 // 64, layers=layers)


def build(name: str, size: str | dict = "tiny", seed: int = 0):
    """(model, batch) for ``name`` at a size of SIZES (or a size dict, ``sized``): the same
    weights and data for the same seed."""
    s = SIZES[size] if isinstance(size, str) else size
    torch.manual_seed(seed)
    model = _model(name, s)
    model.train()
    g = torch.Generator().manual_seed(seed + 1)
    if name == "vit":
        batch = dict(pixel_values=torch.randn(s["batch"], 3, 32, 32, generator=g),
                     labels=torch.randint(0, 10, (s["batch"],), generator=g))
    else:
        ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)
        batch = dict(input_ids=ids, labels=ids)
    return model, batch


def train_step(model, batch):
    """A step function: forward with loss, backward, AdamW, returns ``loss.item()``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> float:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step
