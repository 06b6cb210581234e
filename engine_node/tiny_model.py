"""A tiny random-weight Llama + a locally trained tokenizer, built offline.

The torch backend, CI and `launch.py` need a real Hugging Face checkpoint that
loads with `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer`, without
hub access. This module builds one in about a second:

- weights: every parameter re-drawn from a seeded `torch.Generator` (norms = 1):
  std 0.08 for the layers, 1.0 for the token embedding (nn.Embedding's own
  init) and a peakier lm_head (std 0.2). With these, greedy text varies instead
  of repeating one token, and the top-1 token is rarely near-tied (exact-match
  tests against `generate()` rely on that; measured top-2 margins ~1e-3..1e-1);
- tokenizer: a word-level `tokenizers` model trained on a few built-in
  sentences, padded with filler words so that len(tokenizer) == vocab and every
  sampled id decodes;
- fp32 safetensors.

`ensure_tiny_model()` builds into a cache dir once (atomic rename, so two
processes racing to build it both end up with one complete folder).
`make_random_lora()` writes a PEFT-format adapter folder with non-zero A and B.

MoE variant (issue 37, routing replay): `moe_experts=E` (> 0) builds a
Qwen3-MoE instead (`Qwen3MoeForCausalLM`, every layer sparse, E experts of
`inter` width, `moe_top_k` per token, normalised top-k weights), with a
peakier router (std 0.5) so that routes are rarely near-tied.

CLI: `python -m engine_node.tiny_model OUT_DIR [--seed N] [--moe-experts 8]`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

# Bump when the build recipe changes: it is part of the cache-dir hash, so old
# cached builds are never mistaken for new ones.
BUILD_FORMAT = 1

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")

_SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a rollout is a sequence of tokens sampled from a policy",
    "the trainer pauses generation and sends new weights to every engine",
    "each token carries the weight version that produced it",
    "the router spreads requests over engines and keeps sessions sticky",
    "sleep frees memory and wake up restores it",
    "one two three four five six seven eight nine ten",
    "hello world this is a tiny random language model",
]
_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]

_DEFAULTS: dict[str, Any] = dict(
    seed=0,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    inter=128,
    vocab=512,
    max_pos=2048,
    tie_embeddings=False,
    moe_experts=0,
    moe_top_k=2,
)
_MOE_KEYS = ("moe_experts", "moe_top_k")


@contextmanager
def hf_quiet() -> Iterator[None]:
    """Silence transformers' tqdm bars ("Loading weights", "Writing model
    shards") for the duration. The switch is process-global; it is restored on
    exit, so only use it around a load/save on the thread that owns the model."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _params(**kw: Any) -> dict[str, Any]:
    unknown = set(kw) - set(_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown tiny-model parameter(s): {sorted(unknown)}")
    return {**_DEFAULTS, **kw}


def _build_tokenizer(out_dir: str, vocab: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # No progress bar: on a terminal it ends without a newline, and the
    # launcher's table (the first run builds this model) began on its line.
    trainer = trainers.WordLevelTrainer(special_tokens=_SPECIALS, min_frequency=1, show_progress=False)
    tok.train_from_iterator(_SENTENCES, trainer=trainer)
    n = tok.get_vocab_size()
    if n > vocab:
        raise ValueError(f"vocab={vocab} is smaller than the trained tokenizer ({n} words)")
    tok.add_tokens([f"w{i}" for i in range(vocab - n)])  # every id decodes
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.model_max_length = 1 << 20
    fast.save_pretrained(out_dir)
    return fast


def _build_config(p: dict[str, Any], bos: int, eos: int, pad: int) -> Any:
    from transformers import LlamaConfig, Qwen3MoeConfig

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
        pad_token_id=pad,
        tie_word_embeddings=p["tie_embeddings"],
        initializer_range=0.08,
    )
    if p["moe_experts"]:
        return Qwen3MoeConfig(
            **common,
            head_dim=p["hidden"] // p["heads"],
            moe_intermediate_size=p["inter"],
            num_experts=p["moe_experts"],
            num_experts_per_tok=p["moe_top_k"],
            norm_topk_prob=True,
        )
    return LlamaConfig(**common)


def _redraw_weights(model: Any, seed: int, std: float = 0.08, embed_std: float = 1.0, head_std: float = 0.2) -> None:
    """Draw every weight from one seeded generator, in named_parameters order,
    so the result does not depend on transformers' own init order."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "norm" in name:
                prm.fill_(1.0)
            elif name.endswith("mlp.gate.weight") and prm.dim() == 2 and prm.shape[0] < prm.shape[1]:
                prm.copy_(torch.randn(prm.shape, generator=g, dtype=torch.float32) * 0.5)  # a MoE router
            else:
                s = head_std if name.startswith("lm_head") else embed_std if "embed_tokens" in name else std
                prm.copy_(torch.randn(prm.shape, generator=g, dtype=torch.float32) * s)


def build_tiny_model(
    out_dir: str,
    *,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    inter: int = 128,
    vocab: int = 512,
    max_pos: int = 2048,
    tie_embeddings: bool = False,
    moe_experts: int = 0,
    moe_top_k: int = 2,
) -> str:
    """Write config, fp32 safetensors weights, generation config and tokenizer
    into `out_dir` (created if missing). Returns `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    p = _params(
        seed=seed,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        inter=inter,
        vocab=vocab,
        max_pos=max_pos,
        tie_embeddings=tie_embeddings,
        moe_experts=moe_experts,
        moe_top_k=moe_top_k,
    )
    os.makedirs(out_dir, exist_ok=True)
    tok = _build_tokenizer(out_dir, vocab)
    cfg = _build_config(p, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _redraw_weights(model, seed)
    model.generation_config.do_sample = False
    with hf_quiet():
        model.save_pretrained(out_dir)
    n = sum(x.numel() for x in model.parameters())
    with open(os.path.join(out_dir, "tiny_model_info.json"), "w") as f:
        json.dump({**p, "params": n, "format": BUILD_FORMAT}, f)
    return out_dir


def default_model_dir(root: str | None = None, **params: Any) -> str:
    """Where `ensure_tiny_model(**params)` keeps its build:
    `$ROLLOUT_BUS_CACHE` (else ~/.cache/rollout-bus) / tiny-llama-<hash of params>."""
    p = _params(**params)
    if not p["moe_experts"]:  # the dense model's cache dir is what it was before the MoE keys
        p = {k: v for k, v in p.items() if k not in _MOE_KEYS}
    key = json.dumps({**p, "format": BUILD_FORMAT}, sort_keys=True).encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    kind = "qwen3moe" if p.get("moe_experts") else "llama"
    if root is None:
        root = os.environ.get("ROLLOUT_BUS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rollout-bus")
    return os.path.join(root, f"tiny-{kind}-{digest}")


def ensure_tiny_model(root: str | None = None, **params: Any) -> str:
    """Build the tiny model once into its cache dir and return the path.

    Race-safe: each builder writes a private temp dir next to the target and
    renames it into place; rename of a directory onto an existing non-empty one
    fails, so the loser discards its copy and uses the winner's.
    """
    final = default_model_dir(root, **params)
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=parent)
    try:
        build_tiny_model(tmp, **params)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op once renamed
    return final


def _module_shapes(model_dir: str) -> dict[str, tuple[int, int]]:
    """{module name: (in_features, out_features)} of every nn.Linear of the
    model in `model_dir`, built on the meta device (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return {
        name: (m.in_features, m.out_features) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }


def make_random_lora(
    model_dir: str,
    out_dir: str,
    *,
    r: int = 8,
    alpha: int = 16,
    seed: int = 0,
    targets: Sequence[str] = DEFAULT_LORA_TARGETS,
    b_std: float = 0.1,
) -> str:
    """Write a PEFT-format LoRA adapter folder (adapter_config.json +
    adapter_model.safetensors) for the model in `model_dir`.

    Unlike PEFT's init (B = 0, a no-op adapter) both A and B are random and
    non-zero, so the adapter visibly changes the model's output. A ~ N(0, 1/in)
    keeps A·x at unit scale; B ~ N(0, b_std²) sets the size of the change.
    """
    import torch
    from safetensors.torch import save_file

    shapes = _module_shapes(model_dir)
    chosen = {n: s for n, s in shapes.items() if n.rsplit(".", 1)[-1] in set(targets)}
    if not chosen:
        raise ValueError(f"no Linear module of {model_dir} matches targets {list(targets)}")
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(chosen):
        fan_in, fan_out = chosen[name]
        a = torch.randn((r, fan_in), generator=g) / fan_in**0.5
        b = torch.randn((fan_out, r), generator=g) * b_std
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": os.path.abspath(model_dir),
        "r": r,
        "lora_alpha": alpha,
        "target_modules": sorted(set(targets)),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the tiny random-weight Llama used by CI and launch.py.")
    ap.add_argument("out", help="output folder")
    for k, v in _DEFAULTS.items():
        if isinstance(v, bool):
            ap.add_argument(f"--{k.replace('_', '-')}", action="store_true", default=v)
        else:
            ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    a = vars(ap.parse_args(argv))
    out = a.pop("out")
    build_tiny_model(out, **a)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
