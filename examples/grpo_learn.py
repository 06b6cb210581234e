"""GRPO that learns, through rollout-bus: rollouts from a cluster, the trainer here.

The task (verifiable, learnable from random weights in a minute on a CPU):
the reward of a completion is the fraction of its tokens that lie in a target
set, the ids divisible by 8 (1/8 of the vocabulary). Why this one: the reward
is exact and cheap, the untrained policy's value is known (about 1/8 for a
near-uniform random model), and a policy can reach 1.0 by moving probability
mass with any context, so a tiny random-weight model learns it in tens of
steps; a task that needs the model to read its prompt (copying) would need a
bigger model and far more steps for a CI test. The target ids share nothing a
random-weight model could generalise over, so each id is learnt from its own
samples: the vocabulary must be small against the tokens sampled per step. At
the qwen05 preset's 151,936 ids, 2,048 tokens a step sample an id 0.013 times
(nothing learnt in 30 steps on an H200 at lr 1e-4); build it with `--vocab
4096` (the preset's tokenizer size: higher ids decode to nothing anyway) and
train at lr 1e-3 (bench/gpu/grpo_sim.py: 1e-4 stays flat at any vocabulary).

Each step (synchronous, on-policy):
  1. rollouts: P prompts x G samples from the cluster (temperature 1, logprobs,
     max_staleness=0; every token's weight version must be the trainer's);
  2. rewards, and group-normalised advantages (r - mean_group) / (std_group + eps);
  3. the trainer recomputes the sampled tokens' logprobs, logs the rollout ->
     trainer mismatch (trainer_bridge/mismatch.py), and takes one PPO-clip
     step whose behaviour policy is the engine's logprobs (no critic, no KL);
  4. the new weights go to every engine (Client.update_weights: zmq on CPU,
     cuda_ipc on the engines' GPU, nccl to engines on other GPUs).
`--skip-update` leaves out step 4 (not the push of the initial weights before
step 0): the engines keep sampling from the initial weights, the reward does not move and the mismatch grows, which is how the
test proves that learning goes through the pushed weights.

    python examples/grpo_learn.py                      # CPU: launch.py, 2 torch engines, tiny model
    python examples/grpo_learn.py --address tcp://127.0.0.1:5555 --model DIR   # a running cluster
    # one GPU, the engine colocated with the trainer (sleep / wake by tags, cuda_ipc):
    # (/tmp/q05v: make_tiny_model.py /tmp/q05v --preset qwen05 --vocab 4096 --device cuda)
    python examples/grpo_learn.py --backend vllm --model /tmp/q05v --transport cuda_ipc
    # trainer on GPU 0, engines on the other GPUs (nccl):
    python examples/grpo_learn.py --backend vllm --model /tmp/q05v --transport nccl --engine-gpus 1

Every step prints one JSON line (reward, mismatch, versions, seconds per phase:
generate, train, sync, sleep/wake, idle); `--out FILE` writes them all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere
from bus.proctree import terminate_tree
from engine_node.tiny_model import ensure_tiny_model
from trainer_bridge import Client
from trainer_bridge.mismatch import logprob_mismatch, require_sampled_is_raw

# The CPU policy: a 1-layer Llama, hidden 32, vocabulary 128 (about 14k parameters).
TINY: dict[str, Any] = dict(hidden=32, layers=1, heads=2, kv_heads=1, inter=64, vocab=128, seed=0)
TARGET_EVERY = 8  # the target set: token ids divisible by 8


def reward(tokens: list[int]) -> float:
    return sum(t % TARGET_EVERY == 0 for t in tokens) / max(1, len(tokens))


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO: each sample's reward against its group's (same prompt) mean and std."""
    return (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + eps)


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, vocab, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


class Trainer:
    """The policy's training copy: recomputes logprobs, takes PPO-clip steps."""

    def __init__(self, model_dir: str, device: str, dtype: torch.dtype, lr: float, clip: float) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.device, self.clip = device, clip
        self.shadow: dict[str, torch.Tensor] = {}

    def logprobs(
        self, prompts: list[list[int]], completions: list[list[int]], weights: Any = None
    ) -> list[torch.Tensor]:
        """log p(token) of every completion token, one padded forward for the batch
        (right padding: causal attention never looks at it); `weights`: other
        tensors for the same parameters (the served bf16 copy)."""
        seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=self.device)
        if weights is None:
            logits = self.model(input_ids=ids).logits
        else:
            logits = torch.func.functional_call(self.model, weights, (), {"input_ids": ids}).logits
        logp = torch.log_softmax(logits.float(), -1)
        out = []
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            pos = torch.arange(len(p) - 1, len(p) + len(c) - 1, device=self.device)
            out.append(logp[i, pos, torch.tensor(c, device=self.device)])
        return out

    def step(self, logps: list[torch.Tensor], old: list[list[float]], adv: list[float]) -> float:
        """One PPO-clip step over every token (token mean); `old`: the engine's logprobs."""
        lp = torch.cat(logps)
        ratio = torch.exp(lp - torch.tensor([x for o in old for x in o], device=lp.device))
        a = torch.tensor([x for x, o in zip(adv, old, strict=True) for _ in o], device=lp.device)
        loss = -torch.min(ratio * a, ratio.clamp(1 - self.clip, 1 + self.clip) * a).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss.detach())


# ---------------------------------------------------------------- the cluster


def launch(a: argparse.Namespace) -> tuple[str, subprocess.Popen]:
    """`launch.py` in its own session; returns the frontend it prints once ready."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [sys.executable, os.path.join(root, "launch.py"), "--backend", a.backend, "--model", a.model]
    argv += ["--engines", str(a.engines), "--port", "0", "--ready-timeout-s", str(a.ready_timeout_s)]
    if a.backend == "vllm":
        gpus = a.engine_gpus or ",".join(["0"] * a.engines)
        argv += ["--gpus", gpus, "--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, start_new_session=True)
    found: list[str] = []

    def read() -> None:  # keep draining launch.py's stdout after the address line
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("trainer connects to:") and not found:
                found.append(line.split()[3])

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + a.ready_timeout_s + 30
    while not found:
        if proc.poll() is not None or time.monotonic() > deadline:
            terminate_tree(proc, 5.0)
            raise RuntimeError(f"launch.py did not print its address within ready_timeout_s={a.ready_timeout_s}")
        time.sleep(0.1)
    return found[0], proc


# ---------------------------------------------------------------- the loop


def rollouts(client: Client, prompts: list[list[int]], a: argparse.Namespace, step: int) -> list[Any]:
    params = {"max_tokens": a.max_tokens, "temperature": 1.0, "logprobs": True, "ignore_eos": True}
    require_sampled_is_raw(params)  # the engines' logprobs are of the raw model: temperature 1, no top-k/p
    # a seed per prompt and step: the run repeats exactly on any engine (sample i draws with seed + i)
    reqs = [{**params, "seed": a.seed * 1_000_003 + (step * len(prompts) + i) * a.group} for i in range(len(prompts))]
    with ThreadPoolExecutor(len(prompts)) as pool:  # the requests in flight together (Client is thread-safe)
        batch: list[Any] = list(
            pool.map(lambda p, r: client.generate(p, r, num_samples=a.group, max_staleness=0), prompts, reqs)
        )
    return [s for res in batch for s in res.samples]


def push(client: Client, trainer: Trainer, a: argparse.Namespace, named: Any = None) -> int:
    """The trainer's weights into every engine; returns the new weight version."""
    named = named if named is not None else list(trainer.model.named_parameters())
    opts: dict[str, Any] = {}
    if a.transport in ("cuda_ipc", "nccl"):
        opts["device"] = a.device
    if a.transport == "cuda_ipc":
        opts["zero_copy"] = named[0][1].dtype == torch.bfloat16  # the engines' dtype: no cast needed
    res = client.update_weights(named, transport=a.transport, **opts)
    versions = {r.weight_version for r in res.values()}
    assert len(versions) == 1, f"engines disagree on the version: {versions}"
    return versions.pop()


def engine_named(trainer: Trainer, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The weights in the engines' dtype (an fp32 master trained, bf16 served), in
    buffers allocated once: the same memory every step, which keeps cuda_ipc's
    zero-copy path on one op per update."""
    if not trainer.shadow:
        trainer.shadow = {n: torch.empty_like(p, dtype=dtype) for n, p in trainer.model.named_parameters()}
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            trainer.shadow[n].copy_(p)
    return list(trainer.shadow.items())


def sync(client: Client, trainer: Trainer, a: argparse.Namespace, t: dict[str, float], asleep: bool) -> int:
    """Push the new weights; colocated (`asleep`): the engine slept while the
    trainer worked, so its weights wake first, then (after the push) its KV cache."""
    t0 = time.perf_counter()
    cast = None if a.trainer_dtype == a.engine_dtype else engine_named(trainer, getattr(torch, a.engine_dtype))
    if asleep:
        client.wake_up(tags=["weights"])
    t1 = time.perf_counter()
    version = push(client, trainer, a, cast)
    t2 = time.perf_counter()
    if asleep:
        client.wake_up(tags=["kv_cache"])
    t["sync_s"] = t2 - t1
    t["wake_s"] = time.perf_counter() - t2 + t1 - t0
    return version


def train_step(
    client: Client, trainer: Trainer, prompts: list[list[int]], a: argparse.Namespace, step: int, version: int
) -> tuple[dict[str, Any], int]:
    t0 = time.perf_counter()
    samples = rollouts(client, prompts, a, step)
    t: dict[str, float] = {"generate_s": time.perf_counter() - t0}
    stale = sum(v != version for s in samples for v in s.token_versions)
    if stale:
        raise RuntimeError(f"step {step}: {stale} tokens not of weight version {version} (max_staleness=0)")
    rewards = torch.tensor([reward(s.token_ids) for s in samples]).view(len(prompts), a.group)
    adv = group_advantages(rewards).flatten().tolist()
    if a.colocate:
        ts = time.perf_counter()
        client.sleep(1)  # the engine's weights go to host memory and its KV cache is freed
        t["sleep_s"] = time.perf_counter() - ts
    t1 = time.perf_counter()
    ps = [p for p in prompts for _ in range(a.group)]
    logps = trainer.logprobs(ps, [s.token_ids for s in samples])
    mm = logprob_mismatch(
        [s.logprobs for s in samples],
        [lp.detach() for lp in logps],
        versions=[s.token_versions for s in samples],
        trainer_version=version,
    )
    served: dict[str, Any] = {}
    if trainer.shadow:  # an fp32 master serving a bf16 copy: the mismatch a bf16 trainer would see, too
        with torch.no_grad():
            lp16 = trainer.logprobs(ps, [s.token_ids for s in samples], weights=trainer.shadow)
        served = logprob_mismatch([s.logprobs for s in samples], lp16).as_dict("mismatch_served_")
    loss = trainer.step(logps, [s.logprobs or [] for s in samples], adv)
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()
    t["train_s"] = time.perf_counter() - t1
    if not a.skip_update:
        version = sync(client, trainer, a, t, asleep=a.colocate)
    elif a.colocate:
        client.wake_up()
    wall = time.perf_counter() - t0
    t["idle_s"] = wall - sum(t.values())  # rewards, advantages, bookkeeping
    rec = {"step": step, "reward": float(rewards.mean()), "loss": loss, "version": version, "wall_s": wall}
    return {**rec, **{k: round(v, 4) for k, v in t.items()}, **mm.as_dict(), **served}, version


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument("--address", default=None, help="a running cluster's frontend (default: start one with launch.py)")
    ap.add_argument("--model", default=None, help="model dir the engines serve (default: the tiny CPU policy, built)")
    ap.add_argument("--backend", default="torch", help="engines' backend when this script starts them: torch | vllm")
    ap.add_argument("--engines", type=int, default=None, help="engines this script starts (default: 2 torch, 1 vllm)")
    ap.add_argument("--engine-gpus", default=None, help="vllm: the engines' GPUs, e.g. '1' (default: all on GPU 0)")
    ap.add_argument("--transport", default=None, help="zmq | cuda_ipc | nccl (default: zmq on CPU, cuda_ipc on GPU)")
    ap.add_argument(
        "--colocate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sleep the engines while the trainer works, wake them by tags around the push (default: with cuda_ipc)",
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--trainer-dtype", default=None, help="float32 (default) | bfloat16")
    ap.add_argument(
        "--engine-dtype", default=None, help="the engines' weight dtype (default: float32 torch, bfloat16 vllm)"
    )
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (P)")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=None, help="Adam's (default 3e-2 CPU tiny, 1e-3 GPU)")
    ap.add_argument("--clip", type=float, default=0.2, help="PPO clip range")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-at", type=float, default=None, help="stop once the mean reward of a step reaches this")
    ap.add_argument(
        "--skip-update", action="store_true", help="push no step's weights (the control: nothing is learnt)"
    )
    ap.add_argument("--ready-timeout-s", type=float, default=240.0)
    ap.add_argument("--out", default=None, help="write every step's record here (JSON)")
    a = ap.parse_args(argv)
    gpu = a.backend == "vllm"
    a.model = a.model or ensure_tiny_model(**TINY)
    a.engines = a.engines or (1 if gpu else 2)
    a.transport = a.transport or ("cuda_ipc" if gpu else "zmq")
    a.trainer_dtype = a.trainer_dtype or "float32"  # bf16 weights would round Adam's small steps away
    a.engine_dtype = a.engine_dtype or ("bfloat16" if gpu else "float32")
    # GPU 1e-3: at 1e-4 the qwen05 shape learns nothing in 40 steps (bench/gpu/grpo_sim.py's sweep)
    a.lr = a.lr if a.lr is not None else (1e-3 if gpu else 3e-2)
    a.device = "cuda:0" if gpu or a.transport != "zmq" else "cpu"
    a.colocate = a.transport == "cuda_ipc" if a.colocate is None else a.colocate
    return a


def run(a: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(a.seed)
    if a.device == "cpu":
        torch.set_num_threads(1)  # a tiny model: leave the cores to the engines
    trainer = Trainer(a.model, a.device, getattr(torch, a.trainer_dtype), a.lr, a.clip)
    address, proc = (a.address, None) if a.address else launch(a)
    client = Client(address, timeout_s=300, control_timeout_s=120)
    history: list[dict[str, Any]] = []
    try:
        client.wait_ready(num_engines=1, timeout_s=a.ready_timeout_s)
        vocab = trainer.model.config.vocab_size
        prompts = make_prompts(a.prompts, min(vocab, 4096), a.seed)
        # the engines may serve other weights than our checkpoint (a used cluster): start from ours
        # (--skip-update too: it skips the pushes of the steps, not this one)
        version = sync(client, trainer, a, {}, False)
        for step in range(a.steps):
            rec, version = train_step(client, trainer, prompts, a, step, version)
            print(json.dumps(rec), flush=True)
            history.append(rec)
            if a.stop_at is not None and rec["reward"] >= a.stop_at:
                break
    finally:
        client.close()
        if proc is not None:
            terminate_tree(proc, 15.0)
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"config": {k: v for k, v in vars(a).items()}, "steps": history}, f, indent=1)
    return history


if __name__ == "__main__":
    run(parse())
