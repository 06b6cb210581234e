"""examples/grpo_learn.py's learning dynamics in one CPU process, no cluster.

Why: the GPU run (vLLM engine, qwen05 preset) is a scarce device call; whether
a learning rate / batch learns the example's task at a 151,936-token vocabulary
is a property of the optimisation, not of the serving, so it is decided here.
The trainer is the example's own Trainer (fp32 master, Adam, PPO-clip token
mean) and its reward / group advantages; the rollouts are sampled on-policy
from the trainer's own weights (temperature 1, ignore EOS, one left-padded
batch), their logprobs are the behaviour policy. What differs from the device
run: the engine's bf16 rounding (~0.005 mean |Δ| there), and the size: a step
of the 24-layer preset is minutes here, so the model is the preset's shape
(Qwen2, tied embeddings, 14 heads / 2 kv, the same init) at 1 layer and hidden
112 (head dim 8, init std 0.0567 so the initial logits have the preset's spread,
0.02 * sqrt(896)); Adam moves every coordinate ~lr a step, so a logit moves
~lr * hidden: lr here / 8 is the preset's lr (896 / 112). One layer moves the
last hidden state less per step than 24 do: conservative for the device.

    python -m bench.gpu.grpo_sim --build /tmp/q05s --vocab 4096   # that model (MLP 608: the preset's 4864 / 896)
    python -m bench.gpu.grpo_sim --model /tmp/q05s --lrs 8e-4,8e-3 --steps 20
prints one line per (lr, step) and a table of the reward after 10 / 20 / 40 steps.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from examples.grpo_learn import Trainer, group_advantages, make_prompts, reward


def build(out: str, vocab: int, hidden: int = 112, layers: int = 1) -> None:
    """The qwen05 preset's shape at `hidden`, drawn like make_tiny_model.py (seeded
    normal weights, norms at 1) with the std that keeps its initial logit spread."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=round(hidden * 4864 / 896),
        vocab_size=vocab,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        use_sliding_window=False,
    )
    std = 0.02 * (896 / hidden) ** 0.5
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            prm.copy_(torch.ones_like(prm) if "norm" in name else torch.randn(prm.shape, generator=g) * std)
    model.save_pretrained(out)


@torch.no_grad()
def sample(model: Any, prompts: list[list[int]], group: int, max_tokens: int, gen: torch.Generator) -> list[list[int]]:
    """`group` completions of every prompt (prompt-major), temperature 1, in one
    left-padded batch with the KV cache (positions count real tokens only)."""
    rows = [p for p in prompts for _ in range(group)]
    width = max(len(p) for p in rows)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    toks: list[torch.Tensor] = []
    for _ in range(max_tokens):
        t = torch.multinomial(torch.softmax(out.logits[:, -1].float(), -1), 1, generator=gen)
        toks.append(t)
        mask = torch.cat([mask, torch.ones_like(t)], 1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=t, attention_mask=mask, position_ids=pos, past_key_values=out.past_key_values)
    return torch.cat(toks, 1).tolist()


def simulate(a: argparse.Namespace, lr: float) -> list[dict[str, Any]]:
    torch.manual_seed(a.seed)
    trainer = Trainer(a.model, "cpu", torch.float32, lr, a.clip)
    vocab = trainer.model.config.vocab_size
    prompts = make_prompts(a.prompts, min(vocab, 4096), a.seed)
    gen = torch.Generator().manual_seed(a.seed)
    hist = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        trainer.model.eval()
        comps = sample(trainer.model, prompts, a.group, a.max_tokens, gen)
        trainer.model.train()
        rewards = torch.tensor([reward(c) for c in comps]).view(len(prompts), a.group)
        adv = group_advantages(rewards).flatten().tolist()
        ps = [p for p in prompts for _ in range(a.group)]
        logps = trainer.logprobs(ps, comps)
        old = [lp.detach().tolist() for lp in logps]  # on-policy: the behaviour policy is this model
        trainer.step(logps, old, adv)
        distinct = len({t for c in comps for t in c})
        rec = {"lr": lr, "step": step, "reward": round(float(rewards.mean()), 4), "distinct_tokens": distinct}
        rec["s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(rec), flush=True)
        hist.append(rec)
    return hist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="the policy's dir (from --build)")
    ap.add_argument("--build", help="write the simulation's model here and exit")
    ap.add_argument("--vocab", type=int, default=4096, help="--build: the vocabulary (the preset's: 151936)")
    ap.add_argument("--lrs", default="1e-4,3e-4,1e-3,3e-3")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write every record here (JSON)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.build:
        return build(a.build, a.vocab)
    if not a.model:
        raise SystemExit("--model: required (build one with --build DIR)")
    runs = {lr: simulate(a, float(lr)) for lr in a.lrs.split(",")}
    marks = [m for m in (10, 20, 40) if m <= a.steps] or [a.steps]
    print("| lr | step 0 | " + " | ".join(f"step {m}" for m in marks) + " | mean last 5 |")
    print("|---" * (len(marks) + 3) + "|")
    for lr, h in runs.items():
        cells = [f"{h[m - 1]['reward']:.3f}" for m in marks]
        last5 = sum(r["reward"] for r in h[-5:]) / len(h[-5:])
        print(f"| {lr} | {h[0]['reward']:.3f} | " + " | ".join(cells) + f" | {last5:.3f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"config": vars(a), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
