"""The one helper every GPU benchmark (bench/gpu/*.py) shares: its command
line (`bench_parser`: the flags they all take, and the shared ones each names
with its own default; `model_of`, `log_dir_of`, `replot`), the request set,
the wall-clock budget, phases run as child processes (one engine on the GPU at
a time, the whole tree killed afterwards), a rollout-bus cluster started
through ``launch.py``, and the environment probe.

A phase is a function ``fn(spec) -> dict`` run in a fresh Python process
(``python -m bench.gpu.common MODULE:FUNC SPEC.json OUT.json``): when it ends,
crashes or overruns its time, its process group and every descendant (vLLM
engine cores, api_server, launch.py's children) are killed, so the next phase
finds the GPU free. A failed phase is a row with its error, never a crash of
the run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import harness as H
from bus.proctree import descendants, terminate_tree
from engine_node.tiny_model import ensure_tiny_model

REPO_ROOT = H.REPO_ROOT


# ---------------------------------------------------------------- the command line

# Flags several GPU benches take: dest -> (type, help). A bench names the ones
# it takes, each with its own default, in bench_parser(..., dest=default).
FLAGS: dict[str, tuple[Callable[[str], Any], str]] = {
    "seed": (int, "seed of the request set"),
    "max_model_len": (int, "the engines' max_model_len"),
    "gpu_memory_utilization": (float, "vLLM's gpu_memory_utilization (one engine on the GPU at a time)"),
    "gpu_fraction": (float, "gpu_memory_utilization of EACH engine (several alive on the GPU at once)"),
    "budget_s": (float, "wall-clock budget of the whole run, engine starts included"),
    "phase_limit_s": (float, "one phase at most (engine start included)"),
    "min_phase_s": (float, "skip a phase when less budget than this is left"),
    "ready_timeout_s": (float, "engine / server start deadline"),
    "request_timeout_s": (float, "one request's deadline"),
    "control_timeout_s": (float, "one control op's deadline (pause, update, resume, sleep)"),
    "first_token_timeout_s": (float, "after a resume: wait this long for a token of the new weight version"),
    "gpu_idle_timeout_s": (float, "after a phase: wait this long for the GPU to be free"),
}


def bench_parser(doc: str, *, cpu_help: str, **defaults: Any) -> argparse.ArgumentParser:
    """The parser a GPU bench starts from: --model, --cpu (--dry-run), --out-dir,
    --log-dir, --plot-from, and each FLAGS entry named in `defaults`, with that
    default. `doc` (the module docstring) gives the description and epilog."""
    ap = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc
    )
    ap.add_argument("--model", default=None, help="HF model dir (e.g. the qwen05 preset); --cpu: the tiny model")
    ap.add_argument("--cpu", "--dry-run", dest="cpu", action="store_true", help=cpu_help)
    ap.add_argument("--out-dir", default=None, help="where the JSON and PNG go (default bench/results)")
    ap.add_argument("--log-dir", default=None, help="phase and server logs (default OUT_DIR/<benchmark>_logs)")
    ap.add_argument(
        "--plot-from", default=None, metavar="JSON", help="only print the tables and write the PNG of an earlier run"
    )
    for dest, default in defaults.items():
        typ, hlp = FLAGS[dest]
        ap.add_argument("--" + dest.replace("_", "-"), type=typ, default=default, help=hlp)
    return ap


def parse_args(
    ap: argparse.ArgumentParser, argv: list[str] | None, cpu_defaults: dict[str, Any] | None = None
) -> argparse.Namespace:
    """`ap.parse_args(argv)`, with `cpu_defaults` as the defaults of a --cpu
    run (a smaller set; flags given still win)."""
    given = sys.argv[1:] if argv is None else argv
    if cpu_defaults and ("--cpu" in given or "--dry-run" in given):
        ap.set_defaults(**cpu_defaults)
    return ap.parse_args(argv)


def model_of(a: argparse.Namespace) -> str:
    """--model, or with --cpu the tiny model (built once into the cache)."""
    if a.model:
        return str(a.model)
    if not a.cpu:
        raise SystemExit("--model is required (except with --cpu)")
    return ensure_tiny_model()


def log_dir_of(a: argparse.Namespace, out: Path, name: str) -> Path:
    return Path(a.log_dir) if a.log_dir else out / f"{name}_logs"


def replot(
    a: argparse.Namespace, report: Callable[[dict[str, Any]], Any], plot: Callable[[dict[str, Any], Path], Any]
) -> bool:
    """--plot-from JSON: the tables and the PNG (next to the JSON) of an earlier
    run, on any machine. True when that was asked (and done)."""
    if not a.plot_from:
        return False
    doc = json.loads(Path(a.plot_from).read_text())
    report(doc)
    plot(doc, Path(a.plot_from).with_suffix(".png"))
    return True


# ---------------------------------------------------------------- requests


def make_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of min_len..max_len random token ids in [10, vocab) from a fixed seed."""
    rng = random.Random(seed)
    hi = max(11, vocab)
    return [[rng.randrange(10, hi) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def model_vocab(model: str) -> int:
    """The smaller of the model's vocab and its tokenizer's, so every id is valid and decodes."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    vocab = int(cfg.get("vocab_size") or 512)
    info = Path(model) / "tiny_model_info.json"
    if info.exists():
        vocab = min(vocab, int(json.loads(info.read_text()).get("tokenizer_vocab") or vocab))
    return vocab


# ---------------------------------------------------------------- budget


class Budget:
    """The run's wall-clock budget (--budget-s): each phase gets what is left,
    capped by its own limit, and is skipped when less than its minimum is left."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.t0 = time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


# ---------------------------------------------------------------- environment


def probe_env() -> dict[str, Any]:
    """What this machine has (asked in a child so this process never touches CUDA)."""
    code = (
        "import json, importlib.util as u\n"
        "d = {'vllm': u.find_spec('vllm') is not None, 'gpus': 0, 'gpu_name': None, 'torch': None}\n"
        "try:\n"
        "    import torch\n"
        "    d['torch'] = torch.__version__\n"
        "    if torch.cuda.is_available():\n"
        "        d['gpus'] = torch.cuda.device_count(); d['gpu_name'] = torch.cuda.get_device_name(0)\n"
        "        d['gpu_mem_gib'] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)\n"
        "except Exception as e:\n"
        "    d['torch_error'] = repr(e)\n"
        "if d['vllm']:\n"
        "    try:\n"
        "        import vllm; d['vllm_version'] = vllm.__version__\n"
        "    except Exception as e:\n"
        "        d['vllm'] = False; d['vllm_error'] = repr(e)[:300]\n"
        "print('PROBE' + json.dumps(d))\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=child_env()
        ).stdout
        line = [x for x in out.splitlines() if x.startswith("PROBE")][-1]
        return json.loads(line[5:])
    except Exception as e:
        return {"vllm": False, "gpus": 0, "probe_error": repr(e)[:300]}


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # vLLM on the device image: no flashinfer, no usage stats, spawn workers; NVLink multicast stays off.
    for k, v in {
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "ROLLOUT_BUS_LOG_LEVEL": "WARNING",
    }.items():
        env.setdefault(k, v)
    env.update(extra or {})
    return env


def wait_gpu_idle(timeout_s: float) -> dict[str, Any]:
    """After a phase: wait (--gpu-idle-timeout-s) until nvidia-smi lists no compute process."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {"checked": False}
    t0 = time.monotonic()
    apps = ""
    while time.monotonic() - t0 < timeout_s:
        with contextlib.suppress(Exception):
            apps = subprocess.run(
                [smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            if not apps:
                return {"checked": True, "idle_after_s": round(time.monotonic() - t0, 2)}
        time.sleep(0.5)
    return {"checked": True, "idle_after_s": None, "still_running": apps[:300]}


# ---------------------------------------------------------------- phases


def run_phase(
    name: str, target: str, spec: dict[str, Any], timeout_s: float, work_dir: Path, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run ``target`` ("module:function") in a child process with ``spec``;
    return its result dict, or {"ok": False, "error": ...} when it failed,
    crashed or ran past ``timeout_s``. The child's whole tree is killed either way."""
    work_dir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log_path = (work_dir / f"{name}.{x}" for x in ("spec.json", "out.json", "log"))
    out_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec))
    t0 = time.monotonic()
    log(f"[{name}] start (limit {timeout_s:.0f}s; log {log_path})")
    with open(log_path, "wb") as lf:
        p = subprocess.Popen(
            [sys.executable, "-m", "bench.gpu.common", target, str(spec_path), str(out_path)],
            stdout=lf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=str(REPO_ROOT),
            env=child_env(),
            start_new_session=True,
        )
        timed_out = False
        seen: dict[int, Any] = {}  # every descendant ever seen: killed at the end even if orphaned by then
        end = time.monotonic() + max(1.0, timeout_s)
        try:
            while p.poll() is None:
                if time.monotonic() > end:
                    timed_out = True
                    break
                for d in descendants(p.pid):
                    seen.setdefault(d.pid, d)
                time.sleep(0.5)
        finally:
            # its process group, and every descendant seen (vLLM children left behind included)
            terminate_tree(p, 5.0, extra=seen.values())
    wall = time.monotonic() - t0
    res: dict[str, Any]
    try:
        res = json.loads(out_path.read_text())
    except Exception:
        res = {"ok": False}
    if timed_out:
        res["ok"] = False  # what it checkpointed (if anything) stays
        res["error"] = f"phase ran past its limit of {timeout_s:.0f}s (--phase-limit-s, or what --budget-s had left)"
    elif not res.get("ok") and "error" not in res:
        res["error"] = f"phase exited with rc={p.returncode} and no result"
    res["phase_wall_s"] = round(wall, 2)
    if not res.get("ok"):
        res["log_tail"] = _tail(log_path, 40)
        log(f"[{name}] FAILED after {wall:.0f}s: {str(res.get('error'))[:300]}")
    else:
        log(f"[{name}] done in {wall:.0f}s")
    return res


def _tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _write_json(path: str, doc: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    Path(tmp).write_text(json.dumps(H.jsonable(doc)))
    os.replace(tmp, path)


def checkpoint(spec: dict[str, Any]) -> None:
    """Inside a phase: write what spec["_partial"] holds now, so a phase killed
    at its limit still reports the reps it finished (run_phase reads it)."""
    path = spec.get("_out_path")
    if path:
        _write_json(path, {"ok": False, "error": "the phase did not finish", **spec.get("_partial", {})})


def _phase_main(argv: list[str]) -> int:
    """Child side of run_phase: call the function, write {"ok": True, **result}
    or {"ok": False, "error", "traceback"} (partial results a phase saved in
    spec["_partial"] are kept)."""
    H.setup_logging()
    target, spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    partial: dict[str, Any] = {}
    spec["_partial"] = partial
    spec["_out_path"] = out_path  # checkpoint(spec): partial results survive a kill at the limit
    mod, fn = target.split(":")

    def write(doc: dict[str, Any]) -> None:
        _write_json(out_path, doc)

    try:
        res = getattr(importlib.import_module(mod), fn)(spec)
        write({"ok": True, **partial, **res})
        rc = 0
    except BaseException as e:
        write(
            {
                "ok": False,
                **partial,
                "error": f"{type(e).__name__}: {e}"[:2000],
                "traceback": traceback.format_exc()[-4000:],
            }
        )
        rc = 1
    sys.stdout.flush()
    os._exit(rc)  # vLLM leaves non-daemon threads behind; the parent kills the tree anyway


# ---------------------------------------------------------------- rollout-bus


class RbCluster:
    """``launch.py`` (head + engine nodes, --backend vllm or torch) as a
    subprocess in its own process group; killed with its whole tree on exit."""

    def __init__(
        self,
        model: str,
        backend: str,
        *,
        engines: int = 1,
        gpus: str | None = None,
        gpu_memory_utilization: float | None = None,
        max_model_len: int | None = None,
        backend_options: dict[str, Any] | None = None,
        ready_timeout_s: float = 240.0,
        log_dir: Path | None = None,
        log_level: str = "WARNING",
        extra_args: list[str] | None = None,
    ) -> None:
        argv = [
            sys.executable,
            "launch.py",
            "--backend",
            backend,
            "--model",
            model,
            "--engines",
            str(engines),
            "--port",
            "0",
            "--log-level",
            log_level,
            "--ready-timeout-s",
            str(ready_timeout_s),
            "--backend-options",
            json.dumps(backend_options or {}),
        ]
        # launch.py --port P binds P, P+1, P+2: ask for three consecutive free ones
        self.port = _consecutive_ports(3)
        self.address = f"tcp://{H.LOOPBACK}:{self.port}"
        argv[argv.index("--port") + 1] = str(self.port)
        if gpus is not None:
            argv += ["--gpus", gpus]
        if gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
        if max_model_len:
            argv += ["--max-model-len", str(max_model_len)]
        argv += extra_args or []  # e.g. ["--policy", "prefix"]
        self.argv = argv
        self.ready_timeout_s = ready_timeout_s
        self.log_path = (log_dir or Path(tempfile.mkdtemp(prefix="rb-bench-"))) / f"launch-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.engines = engines
        self.log_level = log_level

    def __enter__(self) -> RbCluster:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as lf:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=lf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=str(REPO_ROOT),
                env=child_env({"ROLLOUT_BUS_LOG_LEVEL": self.log_level}),  # the nodes' level too
                start_new_session=True,
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.proc is not None:
            terminate_tree(self.proc, 15.0)  # launch.py's own SIGTERM path first (grace), then SIGKILL
            self.proc = None

    def wait_ready(self) -> tuple[float, list[dict[str, Any]]]:
        """Block until `engines` engines are healthy (--ready-timeout-s); returns (seconds, engines())."""
        from bus.errors import AuthRefused
        from trainer_bridge import Client

        t0 = time.monotonic()
        # The client is made once launch.py has published the join token (a Client finds it
        # when it is made: one made before would be refused at every handshake).
        c: Client | None = None
        try:
            while True:
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(
                        f"launch.py exited (rc={self.proc and self.proc.returncode}) before ready:\n"
                        + _tail(self.log_path, 30)
                    )
                try:
                    if c is None:
                        c = Client(self.address, timeout_s=60, control_timeout_s=30)
                    h = c.health(timeout_s=3)
                    if sum(1 for e in h["engines"].values() if e.get("healthy")) >= self.engines:
                        return time.monotonic() - t0, c.engines()
                except AuthRefused:
                    c.close() if c is not None else None
                    c = None  # made before the token was published: made again
                except Exception:
                    pass
                if time.monotonic() - t0 > self.ready_timeout_s:
                    raise TimeoutError(
                        f"rollout-bus not ready after ready_timeout_s={self.ready_timeout_s:.0f}s:\n"
                        + _tail(self.log_path, 30)
                    )
                time.sleep(0.25)
        finally:
            if c is not None:
                c.close()


def _consecutive_ports(n: int) -> int:
    import socket

    for _ in range(50):
        base = H.free_port()
        socks = []
        try:
            for i in range(n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind((H.LOOPBACK, base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports on {H.LOOPBACK}")


# ---------------------------------------------------------------- where the CPU goes


def _role(p: Any, me: int) -> str:
    if p.pid == me:
        return "client (bench)"
    try:
        cmd = " ".join(p.cmdline())
        name = p.name()
    except Exception:
        return "?"
    for key, role in (
        ("router_node", "head"),
        ("engine_node", "engine node"),
        ("launch.py", "launch.py"),
        ("EngineCore", "vLLM engine core"),
        ("Worker", "vLLM worker"),
        ("api_server", "api server"),
    ):
        if key in cmd or key in name:
            return role
    return name or "?"


class CpuProbe:
    """CPU seconds by role (client, head, engine node, vLLM engine core, ...)
    across this process's tree, between two snapshots: `with probe.measure() as m:
    ...` then m["cpu"] = {role: busy fraction of one core}."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self.me = os.getpid()

    def snap(self) -> dict[int, tuple[str, float]]:
        ps = self._psutil
        root = ps.Process(self.me)
        out: dict[int, tuple[str, float]] = {}
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                out[p.pid] = (_role(p, self.me), t.user + t.system)
            except Exception:
                continue
        return out

    def _colocation(self, stop: Any, out: dict[str, Any]) -> None:
        """Every 10 ms: is a runnable thread of another process of the tree on the
        physical core (SMT siblings) where the vLLM engine core's main thread runs?"""
        from engine_node.cpu_placement import read_siblings

        ps = self._psutil
        samples = shared = 0
        sib_cache: dict[int, frozenset[int]] = {}
        while not stop.wait(0.01):
            try:
                procs = [ps.Process(self.me), *ps.Process(self.me).children(recursive=True)]
            except Exception:
                continue
            core_pid = next((p.pid for p in procs if _role(p, self.me) == "vLLM engine core"), None)
            if core_pid is None:
                continue
            threads: list[tuple[int, int, str, int]] = []  # pid, tid, state, cpu
            for p in procs:
                try:
                    for tid in os.listdir(f"/proc/{p.pid}/task"):
                        with open(f"/proc/{p.pid}/task/{tid}/stat") as f:
                            rest = f.read().rsplit(")", 1)[1].split()
                        threads.append((p.pid, int(tid), rest[0], int(rest[36])))
                except Exception:
                    continue
            main = next((t for t in threads if t[1] == core_pid), None)
            if main is None or main[2] != "R":
                continue
            sib = sib_cache.setdefault(main[3], read_siblings(main[3]))
            samples += 1
            if any(t[0] != core_pid and t[2] == "R" and t[3] in sib for t in threads):
                shared += 1
        out["core_running_samples"] = samples
        out["core_core_shared"] = round(shared / samples, 3) if samples else None

    @contextlib.contextmanager
    def measure(self) -> Any:
        import threading

        res: dict[str, Any] = {}
        coloc: dict[str, Any] = {}
        stop = threading.Event()
        sampler = threading.Thread(target=self._colocation, args=(stop, coloc), daemon=True)
        sampler.start()
        a, t0 = self.snap(), time.perf_counter()
        try:
            yield res
        finally:
            b, wall = self.snap(), time.perf_counter() - t0
            stop.set()
            sampler.join(2)
            res["colocation"] = coloc
            by: dict[str, float] = {}
            for pid, (role, cpu) in b.items():
                by[role] = by.get(role, 0.0) + cpu - a.get(pid, (role, 0.0))[1]
            res["cpu"] = {
                r: round(v / wall, 3) for r, v in sorted(by.items(), key=lambda kv: -kv[1]) if v > 0.01 * wall
            }
            res["cpu_wall_s"] = round(wall, 3)


# ---------------------------------------------------------------- output


def out_dir(arg: str | None) -> Path:
    d = Path(arg) if arg else H.RESULTS_DIR
    d.mkdir(parents=True, exist_ok=True)
    return d


def result_doc(name: str, a: argparse.Namespace, env: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The head every GPU bench's JSON starts with: what ran, where, when, how."""
    return {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "gpu": env.get("gpu_name") or "CPU",
        "env": env,
        "machine": H.machine_info(),
        "config": vars(a),
        **extra,
    }


def write_doc(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(H.jsonable(doc), indent=2) + "\n")
    os.replace(tmp, path)


def fmt_ms(v: Any) -> str:
    return "-" if v is None else f"{v:.1f}"


if __name__ == "__main__":
    _phase_main(sys.argv[1:])
