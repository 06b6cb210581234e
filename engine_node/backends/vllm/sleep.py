"""Sleep, wake-up, cache and LoRA control of the `vllm` backend: each op sends
its utility calls at once and returns a BackendOp (vllm/ops.VllmOps._op);
`sleep` defers its measurement to the loop thread (its answer may come late)."""

from __future__ import annotations

import shutil
import time
from typing import Any

from engine_node.backend import BackendError, BackendOp
from engine_node.backends.vllm.engine_core import _settle
from engine_node.backends.vllm.lora import write_peft
from engine_node.backends.vllm.ops import VllmOps, backend_error


class VllmSleepAndLora(VllmOps):
    def sleep(self, level: int) -> BackendOp:
        if self._rid_of:
            return BackendOp.failed(
                "sleep",
                BackendError(f"sleep with {len(self._rid_of)} live sequence(s): pause(mode='abort') them first"),
            )
        level = int(level)
        t0 = time.perf_counter()
        op = BackendOp.pending(f"sleep({level})", self.sleep_timeout_s, "sleep_timeout_s")
        rewake: list[Any] = []
        if self._sleeping:
            # Half awake: vLLM's executor ignores a sleep while any tag sleeps
            # (the awake ones would stay resident). Wake the rest, then sleep.
            rewake.append(self._link.utility("wake_up", sorted(self._sleeping)))
            if self._buffers_held:  # the weights are back: so are their buffers
                rewake.append(self._link.utility("collective_rpc", "rollout_bus_restore_sleep_buffers", None, (), None))
                self._buffers_held = False
        # Kept zero-copy IPC maps pin the trainer's memory: a colocated trainer
        # takes the GPU while the engine sleeps, so they go first.
        self._link.utility("collective_rpc", "rollout_bus_drop_maps", None, (), None)
        self._ipc_kept = None  # (vllm/weight_reuse) the workers keep no layout now
        before = self._link.utility("collective_rpc", "rollout_bus_info", None, (), None)
        slept = self._link.utility("sleep", level, "abort")
        self._ops.append((op, self.sleep_timeout_s))

        # The core's sleep may answer late (it waits for its pause to complete),
        # and a call sent behind it could run first: the "after" measurement is
        # sent only once sleep answered, from the loop thread (see _sweep).
        def measure() -> None:
            try:
                for f in rewake:
                    f.result(0)
                free0 = sum(int(r["gpu_free"]) for r in before.result(0))
                slept.result(0)
            except Exception as e:
                _settle(op.future, None, backend_error(op.what, e))
                return
            self._sleep_level = level
            self._sleeping = {"weights", "kv_cache"}
            after = self._link.utility("collective_rpc", "rollout_bus_info", None, (), None)

            def done(f: Any) -> None:
                freed = None if f.exception() else sum(int(r["gpu_free"]) for r in f.result()) - free0
                res = {
                    "backend_seconds": round(time.perf_counter() - t0, 4),
                    "gpu_freed_bytes": freed,
                    # the core's cue: a new weight state (and version) once they wake
                    "weights": "discarded" if level >= 2 else "offloaded",
                }
                _settle(op.future, res, None)

            after.add_done_callback(done)

        def queue_measure(_f: Any) -> None:  # output thread: no sends here
            if before.done() and slept.done() and all(f.done() for f in rewake):
                self._later.append(measure)
                self._link.kick()

        before.add_done_callback(queue_measure)
        slept.add_done_callback(queue_measure)
        for f in rewake:
            f.add_done_callback(queue_measure)
        return op

    def wake_up(self, tags: list[str] | None) -> BackendOp:
        """Wake the named tags (None: all) that are asleep; the rest are a no-op
        (vLLM's executor would skip the WHOLE call for one tag already awake).
        vLLM's core resumes its scheduler once no tag sleeps; a keep-pause of
        ours survives that."""
        t0 = time.perf_counter()
        wanted = {"weights", "kv_cache"} if tags is None else set(tags)
        unknown = wanted - {"weights", "kv_cache"}
        if unknown:
            return BackendOp.failed("wake_up", BackendError(f"unknown wake_up tags {sorted(unknown)}", field="tags"))
        to_wake = wanted & self._sleeping
        if not to_wake:
            return BackendOp.done("wake_up", {"woken": [], "sleeping": sorted(self._sleeping)})
        before = (set(self._sleeping), self._weights_stale, self._sleep_level, self._weights_epoch, self._buffers_held)
        self._sleeping -= to_wake
        full = not self._sleeping
        if self._sleep_level >= 2 and "weights" in to_wake:
            self._weights_stale = True  # mapped again, contents undefined (see VllmBackend._init_loop_state)
            self._weights_epoch += 1  # a new weight state: a new cache salt
        calls: list[tuple[str, tuple]] = []
        if self._sleep_level >= 2 and "weights" in self._sleeping:
            # KV first after level 2: vLLM would restore the saved buffers into
            # the still-sleeping weights pool (vllm/worker_ext holds them).
            calls.append(self._rpc("rollout_bus_hold_sleep_buffers", timeout=self.sleep_timeout_s))
            self._buffers_held = True
        calls.append(("wake_up", (sorted(to_wake),)))
        if self._buffers_held and "weights" in to_wake:
            calls.append(self._rpc("rollout_bus_restore_sleep_buffers", timeout=self.sleep_timeout_s))
            self._buffers_held = False
        reload = full and self._weights_stale
        if reload:
            # About to serve on weights no update has written: the checkpoint's.
            calls.append(self._rpc("rollout_bus_reload_checkpoint", timeout=self.sleep_timeout_s))
            self._weights_stale = False
        if full and self._paused:
            # The core resumes its scheduler once fully awake: keep our freeze.
            calls.append(("pause_scheduler", ("keep", False)))
        if full:
            self._sleep_level = 0
        left = sorted(self._sleeping)

        def after(ok: bool) -> None:  # output thread: flags only
            if not ok:
                (self._sleeping, self._weights_stale, self._sleep_level, self._weights_epoch, self._buffers_held) = (
                    before
                )

        return self._op(
            "wake_up",
            "sleep_timeout_s",
            calls,
            lambda rs: {
                "backend_seconds": round(time.perf_counter() - t0, 4),
                "woken": sorted(to_wake),
                "sleeping": left,
                "reloaded_from_checkpoint": reload,
            },
            after,
        )

    def reset_prefix_cache(self) -> BackendOp:
        return self._op(
            "reset_prefix_cache",
            "rpc_timeout_s",
            [("reset_prefix_cache", (False, False))],
            lambda rs: {"reset": bool(rs[0])},
        )

    def collective_rpc(self, method: str, *args: Any) -> BackendOp:
        """Any worker-extension method on every worker (results: one per worker)."""
        return self._op(
            f"collective_rpc({method})",
            "rpc_timeout_s",
            [self._rpc(method, *args, timeout=self.rpc_timeout_s)],
            lambda rs: {"results": rs[0]},
        )

    def load_lora(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: list[tuple[str, Any]] | None = None,
        config: dict[str, Any] | None = None,
    ) -> BackendOp:
        if not self.enable_lora:
            return BackendOp.failed(
                "load_lora", BackendError("this vllm engine was started without LoRA (backend option enable_lora=True)")
            )
        if (path is None) == (tensors is None):
            return BackendOp.failed("load_lora", BackendError("load_lora needs exactly one of path or tensors"))
        wrote = None
        if tensors is not None:
            # Hazard: a blocking file write on the loop thread; adapters are MBs.
            path = wrote = write_peft(self._tmp, self.model, name, tensors, config)
        lid, inplace = self._loras.next_id(name)
        req = self._api.LoRARequest(lora_name=name, lora_int_id=lid, lora_path=path, load_inplace=inplace)
        table = self._loras

        def result(rs: list[Any]) -> dict[str, Any]:
            if not rs[0] and not inplace:
                raise BackendError(f"vLLM refused LoRA adapter {name!r} from {path}", field="lora")
            table.loaded(name, lid, str(path), wrote)  # output thread: dict updates only
            return {"lora_id": lid, "in_place": inplace}

        def after(ok: bool) -> None:
            if not ok and wrote:
                shutil.rmtree(wrote, ignore_errors=True)

        return self._op(f"load_lora({name})", "lora_timeout_s", [("add_lora", (req,))], result, after)

    def unload_lora(self, name: str) -> BackendOp:
        a = self._loras.adapters.get(name)
        if a is None:
            return BackendOp.failed("unload_lora", BackendError(f"LoRA adapter {name!r} is not loaded", field="lora"))
        self._loras.removed(name)
        return self._op(
            f"unload_lora({name})",
            "lora_timeout_s",
            [("remove_lora", (a.lora_id,))],
            lambda rs: {"removed": bool(rs[0])},
        )

    def loras(self) -> list[str]:
        return self._loras.names()
