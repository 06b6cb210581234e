#!/usr/bin/env python3
"""Build a random-weight causal LM + a locally trained tokenizer into a folder.

(A copy of ../shared/tools/make_tiny_model.py: ../shared does not travel to the
device machine; tests/gpu/run_bench_on_device.sh builds the qwen05 preset with it.)

No hub access needed: the config is built with transformers, the weights are
random (seeded), and the tokenizer is a word-level tokenizer trained with the
`tokenizers` library on a few built-in sentences, padded with filler tokens so
that len(tokenizer) == vocab_size (every sampled id detokenizes).

Presets:
  tiny    Llama, hidden 256, 4 layers, 4 heads (2 kv), vocab 4096   (~3.5M params)
  small   Llama, hidden 512, 4 layers, 8 heads (4 kv), vocab 8192   (~21M params)
  qwen05  Qwen2-0.5B-like: hidden 896, 24 layers, 14 heads (2 kv), inter 4864,
          vocab 151936, tied embeddings (~494M params). Its tokenizer only has
          --tok-vocab entries (default 4096): use it with token-id prompts and
          skip_tokenizer_init=True, or pass --full-tokenizer to pad it to 151936.

Usage:
  python3 make_tiny_model.py OUT_DIR [--preset tiny] [--seed 0] [--dtype bfloat16]
                             [--device cpu|cuda] [--layers N] [--hidden N] [--vocab N]
Works on CPU (tiny/small take seconds; qwen05 about a minute on 2 cores).
"""

import argparse
import json
import os
import sys
import time

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a small model is a good model for a quick test",
    "we train a word level tokenizer on a few sentences",
    "the engine adds a request and steps until it is finished",
    "weights are loaded in place and the output changes",
    "sleep and wake up move the weights between host and device",
    "one two three four five six seven eight nine ten",
    "hello world this is a tiny random language model",
]

PRESETS = {
    "tiny": dict(arch="llama", hidden=256, layers=4, heads=4, kv_heads=2, inter=688, vocab=4096, max_pos=4096),
    "small": dict(arch="llama", hidden=512, layers=4, heads=8, kv_heads=4, inter=1376, vocab=8192, max_pos=4096),
    "qwen05": dict(
        arch="qwen2", hidden=896, layers=24, heads=14, kv_heads=2, inter=4864, vocab=151936, max_pos=32768, tie=True
    ),
}


def build_tokenizer(out_dir, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=specials, min_frequency=1)
    tok.train_from_iterator(SENTENCES, trainer=trainer)
    n = tok.get_vocab_size()
    if n < vocab_size:  # pad with filler words so every id decodes
        tok.add_tokens([f"w{i}" for i in range(vocab_size - n)])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.model_max_length = 1 << 20
    fast.save_pretrained(out_dir)
    return fast


def build_config(p, bos, eos):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        hidden_size=p["hidden"],
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"],
        intermediate_size=p["inter"],
        vocab_size=p["vocab"],
        max_position_embeddings=p["max_pos"],
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=3,
        tie_word_embeddings=p.get("tie", False),
    )
    if p["arch"] == "qwen2":
        cfg = Qwen2Config(**common, use_sliding_window=False)
    else:
        cfg = LlamaConfig(**common)
    return cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--tok-vocab", type=int, default=4096)
    ap.add_argument("--full-tokenizer", action="store_true")
    ap.add_argument(
        "--std",
        type=float,
        default=None,
        help="init std of the random weights (default 0.08 for tiny/small: varied greedy text; 0.02 for qwen05)",
    )
    ap.add_argument(
        "--head-std",
        type=float,
        default=0.2,
        help="std of an untied lm_head (larger: peakier logits, stabler greedy argmax)",
    )
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    p = dict(PRESETS[a.preset])
    for k in ("layers", "hidden", "vocab"):
        if getattr(a, k):
            p[k] = getattr(a, k)
    os.makedirs(a.out, exist_ok=True)
    tok_vocab = p["vocab"] if (a.full_tokenizer or p["vocab"] <= a.tok_vocab) else a.tok_vocab
    tok = build_tokenizer(a.out, tok_vocab)
    cfg = build_config(p, tok.bos_token_id, tok.eos_token_id)
    if a.std is None:
        a.std = 0.02 if a.preset == "qwen05" else 0.08
    cfg.initializer_range = a.std
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(a.seed)
    with torch.device(a.device):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except TypeError:  # transformers < 4.56
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    # Re-draw every weight from the seed so the result does not depend on the
    # transformers version's init order; norms stay at 1.
    g = torch.Generator(device=a.device).manual_seed(a.seed)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "norm" in name:
                prm.fill_(1.0)
            else:
                std = a.head_std if name.startswith("lm_head") else a.std
                prm.copy_(torch.randn(prm.shape, generator=g, device=a.device, dtype=torch.float32).to(dtype) * std)
    model.generation_config.do_sample = False
    model.save_pretrained(a.out, safe_serialization=True)
    n = sum(x.numel() for x in model.parameters())
    info = dict(
        preset=a.preset,
        seed=a.seed,
        params=n,
        dtype=a.dtype,
        tokenizer_vocab=len(tok),
        vocab=p["vocab"],
        seconds=round(time.time() - t0, 1),
    )
    with open(os.path.join(a.out, "tiny_model_info.json"), "w") as f:
        json.dump(info, f)
    print(json.dumps(info))


if __name__ == "__main__":
    sys.exit(main())
