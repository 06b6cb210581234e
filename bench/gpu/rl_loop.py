"""The GRPO loop of examples/grpo_learn.py, step by step, against vLLM inside
the trainer (issue 37 §4): steps/s and where each step's time goes.

Arms (each in a process of its own, all alive at once, their steps run in
interleaved rounds, the order rotated every round; medians over every step but
each arm's first):
  rb1      rollout-bus, 1 vLLM engine on the trainer's GPU (GPU 0), colocated:
           generate -> sleep(1) -> train -> wake_up(["weights"]) -> cuda_ipc
           zero-copy push -> wake_up(["kv_cache"])   (the example's own step)
  inproc   vLLM's `LLM` in the trainer's own process (TRL's colocate mode:
           VLLM_ENABLE_V1_MULTIPROCESSING=0): llm.generate -> llm.sleep(1) ->
           train -> llm.wake_up(["weights"]) -> llm.apply_model(m.load_weights)
           -> reset_prefix_cache -> llm.wake_up(["kv_cache"])
  rb_nccl  rollout-bus, the trainer alone on GPU 0, engines on --nccl-gpus
           (default "1"; "1,2" = 2 engines on 2 GPUs), nccl push, no sleep.
           Not "2 engines on 2 GPUs with the trainer on one of them": one update
           takes one transport, and NCCL refuses two ranks (the trainer's and a
           colocated engine's) on one GPU, so an engine beside the trainer
           (cuda_ipc) and one on the other GPU (nccl) cannot share an update.
The trainer is the same everywhere: an fp32 master on cuda:0 (Adam), its bf16
copy pushed (buffers allocated once). Phases per step: generate, sleep, train
(forward + backward + optimizer, logprob recompute and mismatch included),
sync (the weight load itself), wake, idle (the rest: rewards, bookkeeping).
Targets: rb1 step <= 1.1 x inproc step; rb_nccl step < inproc step.

    python -m bench.gpu.rl_loop --model /tmp/q05 --out-dir $OUT       # 1 GPU: rb1, inproc (rb_nccl skips)
    python -m bench.gpu.rl_loop --model /tmp/q05 --arms rb1,inproc,rb_nccl   # 2 GPUs
    python -m bench.gpu.rl_loop --cpu       # dry run: rb1 on torch engines (zmq, colocated sleep/wake)
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.gpu import common as G
from engine_node.tiny_model import ensure_tiny_model

NAME = "gpu_rl_loop"
ARMS = ("rb1", "inproc", "rb_nccl")
PHASES = ("generate_s", "sleep_s", "train_s", "sync_s", "wake_s", "idle_s")
TARGETS = {"rb1_over_inproc": 1.1, "rb_nccl_over_inproc": 1.0}


# ---------------------------------------------------------------- the arms (each in its own process)


def _example_args(spec: dict[str, Any], arm: str, address: str) -> list[str]:
    cpu = spec["cpu"]
    argv = ["--address", address, "--model", spec["model"], "--backend", "torch" if cpu else "vllm"]
    argv += ["--prompts", str(spec["prompts"]), "--group", str(spec["group"]), "--max-tokens", str(spec["max_tokens"])]
    argv += ["--seed", str(spec["seed"])] + (["--lr", str(spec["lr"])] if spec.get("lr") else [])
    if cpu:
        return argv + ["--transport", "zmq", "--colocate"]
    return argv + ["--transport", "cuda_ipc" if arm == "rb1" else "nccl"]


class RbArm:
    """The example's own loop against a launch.py cluster this arm starts."""

    def __init__(self, spec: dict[str, Any], arm: str) -> None:
        import examples.grpo_learn as X  # lazy: the example imports torch and transformers

        self.X = X
        cpu = spec["cpu"]
        gpus = None if cpu else ("0" if arm == "rb1" else spec["nccl_gpus"])
        engines = 1 if arm == "rb1" or gpus is None else len(gpus.split(","))
        eng = {} if cpu else {"gpu_memory_utilization": spec["gpu_memory_utilization"], "max_model_len": 1024}
        self.cluster = G.RbCluster(
            spec["model"],
            "torch" if cpu else "vllm",
            engines=engines,
            gpus=gpus,
            ready_timeout_s=spec["ready_timeout_s"],
            log_dir=Path(spec["log_dir"]),
            **eng,
        ).__enter__()
        self.cluster.wait_ready()
        self.a = X.parse(_example_args(spec, arm, self.cluster.address))
        self.trainer = X.Trainer(self.a.model, self.a.device, getattr(X.torch, self.a.trainer_dtype), self.a.lr, 0.2)
        self.client = X.Client(self.cluster.address, timeout_s=300, control_timeout_s=120)
        self.prompts = X.make_prompts(self.a.prompts, min(self.trainer.model.config.vocab_size, 4096), self.a.seed)
        self.version = X.sync(self.client, self.trainer, self.a, {}, False)
        self.step_no = 0

    def steps(self, k: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(k):
            rec, self.version = self.X.train_step(
                self.client, self.trainer, self.prompts, self.a, self.step_no, self.version
            )
            out.append(rec)
            self.step_no += 1
        return out

    def close(self) -> None:
        self.client.close()
        self.cluster.close()


class InprocArm:
    """vLLM's LLM in this process, loaded in place after every step (TRL colocate)."""

    def __init__(self, spec: dict[str, Any], arm: str) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: apply_model is a call
        from vllm import LLM, SamplingParams  # lazy: GPU only
        from vllm.inputs import TokensPrompt  # lazy: GPU only

        import examples.grpo_learn as X  # lazy: torch, transformers

        self.X, self.SP = X, SamplingParams
        self.a = X.parse(_example_args(spec, "rb1", "unused"))
        self.llm = LLM(
            spec["model"],
            enable_sleep_mode=True,
            gpu_memory_utilization=spec["gpu_memory_utilization"],
            max_model_len=1024,
            seed=spec["seed"],
        )
        self.trainer = X.Trainer(self.a.model, "cuda:0", X.torch.float32, self.a.lr, 0.2)
        self.prompts = X.make_prompts(self.a.prompts, min(self.trainer.model.config.vocab_size, 4096), self.a.seed)
        self.inputs = [TokensPrompt(prompt_token_ids=p) for p in self.prompts]
        self._load()
        self.step_no = 0

    def _load(self) -> None:
        named = self.X.engine_named(self.trainer, self.X.torch.bfloat16)
        self.llm.apply_model(lambda m: m.load_weights(iter(named)))
        self.llm.reset_prefix_cache()

    def _generate(self, step: int) -> list[tuple[list[int], list[float]]]:
        a, n = self.a, len(self.prompts)
        sps = [
            self.SP(
                n=a.group,
                max_tokens=a.max_tokens,
                temperature=1.0,
                logprobs=0,
                ignore_eos=True,
                seed=a.seed * 1_000_003 + (step * n + i) * a.group,
            )
            for i in range(n)
        ]
        res = self.llm.generate(self.inputs, sps, use_tqdm=False)
        return [
            (list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)])
            for r in res
            for o in r.outputs
        ]

    def steps(self, k: int) -> list[dict[str, Any]]:
        X, a, torch = self.X, self.a, self.X.torch
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            samples = self._generate(self.step_no)
            t: dict[str, float] = {"generate_s": time.perf_counter() - t0}
            rewards = torch.tensor([X.reward(s[0]) for s in samples]).view(len(self.prompts), a.group)
            adv = X.group_advantages(rewards).flatten().tolist()
            t1 = time.perf_counter()
            self.llm.sleep(level=1)
            t2 = time.perf_counter()
            logps = self.trainer.logprobs([p for p in self.prompts for _ in range(a.group)], [s[0] for s in samples])
            mm = X.logprob_mismatch([s[1] for s in samples], [lp.detach() for lp in logps])
            loss = self.trainer.step(logps, [s[1] for s in samples], adv)
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            self.llm.wake_up(tags=["weights"])
            t4 = time.perf_counter()
            self._load()
            t5 = time.perf_counter()
            self.llm.wake_up(tags=["kv_cache"])
            t6 = time.perf_counter()
            t.update(sleep_s=t2 - t1, train_s=t3 - t2, sync_s=t5 - t4, wake_s=t6 - t5 + t4 - t3)
            wall = time.perf_counter() - t0
            t["idle_s"] = wall - sum(t.values())
            rec = {"step": self.step_no, "reward": float(rewards.mean()), "loss": loss, "wall_s": wall}
            out.append({**rec, **{k2: round(v, 4) for k2, v in t.items()}, **mm.as_dict()})
            self.step_no += 1
        return out

    def close(self) -> None:
        del self.llm


def arm_child(arm: str, spec_path: str) -> int:
    """The child side: build the arm, say READY, then run `RUN k` lines until STOP."""
    H.setup_logging()
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.monotonic()
    try:
        obj: Any = InprocArm(spec, arm) if arm == "inproc" else RbArm(spec, arm)
    except BaseException as e:
        print("ERROR " + json.dumps({"error": f"{type(e).__name__}: {e}"[:1500]}), flush=True)
        os._exit(1)
    print("READY " + json.dumps({"start_s": round(time.monotonic() - t0, 2)}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "STOP":
            break
        try:
            print("STEPS " + json.dumps(obj.steps(int(cmd[1]))), flush=True)
        except BaseException as e:
            print("ERROR " + json.dumps({"error": f"{type(e).__name__}: {e}"[:1500]}), flush=True)
    obj.close()
    sys.stdout.flush()
    os._exit(0)  # vLLM leaves non-daemon threads behind


class ArmProc:
    """The parent's handle on one arm process: lines in, lines out, deadlines."""

    def __init__(self, arm: str, spec_path: Path, log_dir: Path) -> None:
        self.arm = arm
        self.log = open(log_dir / f"arm-{arm}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.gpu.rl_loop", "--arm-child", arm, str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=str(G.REPO_ROOT),
            env=G.child_env(),
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(("READY ", "STEPS ", "ERROR ")):
                self.lines.put(line)
        self.lines.put("ERROR " + json.dumps({"error": f"arm process exited (rc={self.proc.wait()})"}))

    def expect(self, timeout_s: float, knob: str) -> tuple[str, Any]:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            return "ERROR", {"error": f"no answer from arm {self.arm} within {knob}={timeout_s:.0f}s"}
        kind, body = line.split(" ", 1)
        return kind, json.loads(body)

    def run(self, k: int, timeout_s: float) -> tuple[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"RUN {k}\n")
        self.proc.stdin.flush()
        return self.expect(timeout_s, "step_timeout_s")

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("STOP\n")
            self.proc.stdin.flush()
            self.proc.wait(30)
        except Exception:
            pass
        from bus.proctree import terminate_tree  # lazy: only the parent ends trees

        terminate_tree(self.proc, 10.0)
        self.log.close()


# ---------------------------------------------------------------- the run


def skipped_arms(arms: list[str], a: argparse.Namespace, env: dict[str, Any]) -> dict[str, str]:
    why: dict[str, str] = {}
    for arm in arms:
        if a.cpu and arm != "rb1":
            why[arm] = "--cpu dry run: needs vLLM and a GPU"
        elif not a.cpu and not env.get("vllm"):
            why[arm] = "vLLM not importable"
        elif arm == "rb_nccl" and not a.cpu and env.get("gpus", 0) < 1 + len(a.nccl_gpus.split(",")):
            why[arm] = (
                f"needs {1 + len(a.nccl_gpus.split(','))} GPUs (trainer GPU 0 + --nccl-gpus), {env.get('gpus')} visible"
            )
    return why


def run_arms(spec: dict[str, Any], arms: list[str], log_dir: Path, budget: G.Budget) -> dict[str, Any]:
    spec_path = log_dir / "rl_loop.spec.json"
    spec_path.write_text(json.dumps(spec))
    res: dict[str, Any] = {arm: {"steps": [], "errors": []} for arm in arms}
    procs: dict[str, ArmProc] = {}
    try:
        for arm in arms:  # one at a time: vLLM's start-up memory profiling must not see another start
            procs[arm] = ArmProc(arm, spec_path, log_dir)
            wait = spec["ready_timeout_s"] + 60
            # the budget can bind before the arm's own deadline: the error names whichever did
            knob = "ready_timeout_s" if wait <= budget.left() else "budget_s"
            kind, body = procs[arm].expect(min(wait, budget.left()), knob)
            res[arm]["start"] = body
            if kind != "READY":
                res[arm]["errors"].append(body.get("error"))
                procs.pop(arm).close()
            print(f"[{arm}] {kind} {json.dumps(body)[:300]}", flush=True)
        live = list(procs)
        for r in range(spec["rounds"]):
            if budget.left() < spec["min_round_s"]:
                res["stopped"] = f"budget: {budget.left():.0f}s left before round {r}"
                break
            turn = r % len(live) if live else 0
            for arm in live[turn:] + live[:turn]:  # each arm first once every len(live) rounds
                if res[arm]["errors"]:
                    continue
                kind, body = procs[arm].run(spec["steps_per_round"], spec["step_timeout_s"] * spec["steps_per_round"])
                if kind == "STEPS":
                    res[arm]["steps"] += [{**s, "round": r} for s in body]
                else:
                    res[arm]["errors"].append(body.get("error"))
                print(f"[{arm}] round {r}: {kind} {_brief(body)}", flush=True)
    finally:
        for p in procs.values():
            p.close()
    return res


def _brief(body: Any) -> str:
    if isinstance(body, list):
        return " ".join(f"r={s['reward']:.2f}/{s['wall_s'] * 1e3:.0f}ms" for s in body)
    return json.dumps(body)[:300]


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    for arm in ARMS:
        steps = (res.get(arm) or {}).get("steps") or []
        if not steps:
            continue
        body = steps[1:] or steps  # an arm's first step (first graph captures, first maps) apart
        row = {k: H.median([x[k] for x in body if k in x]) if any(k in x for x in body) else None for k in PHASES}
        row["step_s"] = H.median([x["wall_s"] for x in body])
        row["steps_per_s"] = 1.0 / row["step_s"] if row["step_s"] else None
        row["first_step_s"] = steps[0]["wall_s"]
        row["steps"] = len(steps)
        row["reward_first"], row["reward_last"] = steps[0]["reward"], steps[-1]["reward"]
        row["mismatch_mean_abs"] = H.median([x["mismatch_mean_abs"] for x in body])
        row["errors"] = len(res[arm]["errors"])
        s[arm] = row
    base = (s.get("inproc") or {}).get("step_s")
    for arm in ("rb1", "rb_nccl"):
        if arm in s and base:
            s[arm]["x_inproc"] = s[arm]["step_s"] / base
    return s


def report(doc: dict[str, Any]) -> None:
    s = doc["summary"]
    print(f"\n## {NAME}: {doc['config'].get('model')} ({doc['gpu']})\n")
    cols = ("step_s", "x_inproc", *PHASES, "reward_first", "reward_last", "mismatch_mean_abs")
    print("| arm | steps | " + " | ".join(c.removesuffix("_s") for c in cols) + " | errors |")
    print("|---|---|" + "---|" * (len(cols) + 1))
    for arm, r in s.items():
        vals = []
        for c in cols:
            v = r.get(c)
            vals.append("-" if v is None else f"{v * 1e3:.1f} ms" if c.endswith("_s") else f"{v:.3g}")
        print(f"| {arm} | {r['steps']} | " + " | ".join(vals) + f" | {r['errors']} |")
    for arm, why in (doc.get("skipped") or {}).items():
        print(f"| {arm} | skipped: {why} |")


def plot(doc: dict[str, Any], png: Path) -> None:
    from bench.plots import _plt

    plt = _plt()
    s, res = doc["summary"], doc["result"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    arms = list(s)
    bottom = [0.0] * len(arms)
    for k in PHASES:
        vals = [(s[a].get(k) or 0.0) * 1e3 for a in arms]
        ax1.bar(arms, vals, bottom=bottom, label=k.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax1.set_ylabel("ms per step (median)")
    ax1.set_title("where a step goes")
    ax1.legend(fontsize=7)
    for a in arms:
        steps = res[a]["steps"]
        ax2.plot([x["step"] for x in steps], [x["reward"] for x in steps], marker=".", label=a)
    ax2.set_xlabel("step")
    ax2.set_ylabel("mean reward")
    ax2.set_title("reward (fraction of tokens in the target set)")
    ax2.legend(fontsize=7)
    fig.suptitle(f"{NAME}: {Path(str(doc['config'].get('model'))).name}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def plot_run(steps: list[dict[str, Any]], png: Path, title: str) -> None:
    """One run of the example (its per-step records): the reward curve, and
    each step's time by phase, stacked (tests/gpu/test_grpo_gpu.py)."""
    from bench.plots import _plt

    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    xs = [s["step"] for s in steps]
    ax1.plot(xs, [s["reward"] for s in steps], marker=".")
    ax1.set_xlabel("step")
    ax1.set_ylabel("mean reward")
    ax1.set_title("reward (fraction of tokens in the target set)")
    bottom = [0.0] * len(steps)
    for k in PHASES:
        vals = [(s.get(k) or 0.0) * 1e3 for s in steps]
        ax2.bar(xs, vals, bottom=bottom, label=k.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax2.set_xlabel("step")
    ax2.set_ylabel("ms")
    ax2.set_title("step time by phase")
    ax2.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = G.bench_parser(
        __doc__,
        cpu_help="dry run: rb1 on torch engines with the example's tiny policy (zmq, colocated sleep/wake)",
        **dict(seed=0, gpu_memory_utilization=0.3, budget_s=420.0, ready_timeout_s=240.0),
    )
    ap.add_argument("--arms", default="rb1,inproc,rb_nccl", help="comma-separated, of " + ", ".join(ARMS))
    ap.add_argument("--nccl-gpus", default="1", help="rb_nccl: the engines' GPUs (one engine each)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps-per-round", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=None, help="the example's default when unset")
    ap.add_argument("--step-timeout-s", type=float, default=60.0, help="one step's deadline")
    ap.add_argument("--min-round-s", type=float, default=20.0, help="skip the next round with less budget left")
    ap.add_argument("--arm-child", nargs=2, default=None, help=argparse.SUPPRESS)
    return G.parse_args(ap, argv, {"rounds": 2, "steps_per_round": 2, "prompts": 2, "group": 4, "max_tokens": 4})


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.arm_child:
        return arm_child(*a.arm_child)
    H.setup_logging()
    if G.replot(a, report, plot):
        return 0
    budget = G.Budget(a.budget_s)
    od = G.out_dir(a.out_dir)
    log_dir = G.log_dir_of(a, od, NAME)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = G.probe_env()
    if a.cpu and not a.model:
        from examples.grpo_learn import TINY  # lazy: the example imports torch

        a.model = ensure_tiny_model(**TINY)
    a.model = G.model_of(a)
    arms = [x for x in a.arms.split(",") if x]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; known: {list(ARMS)}")
    skipped = skipped_arms(arms, a, env)
    spec = {k: v for k, v in vars(a).items() if k not in ("plot_from", "out_dir", "arm_child")}
    spec["log_dir"] = str(log_dir)
    doc = G.result_doc(NAME, a, env, targets=TARGETS, skipped=skipped)
    path = od / f"{NAME}.json"
    print(f"{NAME}: model {a.model}, arms {arms} (skipped {skipped}), budget {a.budget_s:.0f}s", flush=True)
    with H.Procs():
        doc["result"] = run_arms(spec, [x for x in arms if x not in skipped], log_dir, budget)
    doc["summary"] = summarize(doc["result"])
    doc["elapsed_s"] = budget.elapsed()
    G.write_doc(path, doc)
    print(f"wrote {path}", flush=True)
    report(doc)
    try:
        plot(doc, od / f"{NAME}.png")
    except Exception as e:
        print(f"PNG failed: {e!r}", flush=True)
    ran = [x for x in arms if x not in skipped]
    return 0 if ran and all(doc["summary"].get(x, {}).get("errors") == 0 for x in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
