"""The async gate and policy loading: which policy vLLM serves for batch n, and getting it there.

Gate (seed step semantics): batch n may be sampled by a policy at most `max_async_level` (k) updates older
than the one it trains, i.e. from policy m >= n - 1 - k (`required_policy`); policy 0 is the base model (or,
when the trainer publishes `broadcasts/step_0`, its dequantized QLoRA base: reloaded in place before anything
else, and again after a server restart; `await_base` waits for it), policy m is `broadcasts/step_m`
(`tidal.transport.weights`). Before each batch `PolicyTracker.ensure` waits
until such a policy is published, then makes every server (`client.base_url`, e.g. infer `dp` of them) serve the
newest one, per `weight_broadcast`, before any request samples with it (a load that fails on one server fails
the step's attempt, which is retried with the policy loaded again everywhere):
- `reload: lora`: load it as the runtime LoRA adapter `{lora_adapter}-step-{m}` (and unload the previous one);
- `reload: merged`: reload the merged full weights in place;
- `reload: factors`: have each server's worker merge the adapter's factors into its weights in place
  (`tidal.inference.backends.vllm.lora_merge`; like `merged`, the change reaches running requests);
- `type: nccl`: the trainer pushed the weights already; check every server's weight version and, when one is
  behind (it restarted), ask the trainer to push again.
A publication is identified by its step and stamp, so a policy that a resumed trainer published again is
loaded again; a restarted server (its start time changed, or `invalidate` after a failed request) gets the
current policy again.

In-flight mode (`async_mode: in_flight`, `stream`) loads each policy while requests are running: requests lease
the model they use (`lease` / `release`), and a LoRA adapter that leased requests still use is unloaded only
when the last of them returns; `version_high` is the newest policy whose load has begun (a merged reload or nccl
push may reach a running request between two of its decoding steps).

After each load of a policy n > 0 the identity check (`tidal.orchestrator.identity`, orch
`weight_broadcast.policy_check`) scores the probe the trainer published with it on every server and stops the run
(`PolicyMismatch`) when a server serves another policy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path

from tidal.inference.protocol import InferenceClient
from tidal.orchestrator.identity import IdentityCheck, PolicyMismatch
from tidal.paths import broadcast_dir, broadcasts_dir
from tidal.transport import weights

log = logging.getLogger("tidal.orch")


def required_policy(step: int, max_async_level: int) -> int:
    """The oldest policy that may sample batch `step`: n - 1 - k (never below the base model, 0)."""
    return max(0, step - 1 - max_async_level)


class PolicyTracker:
    """Which policy vLLM serves, and loading newer ones as the trainer publishes them."""

    def __init__(self, client: InferenceClient, base_model: str, run_dir: Path, prefix: str,
                 merged: bool = False, pushed_timeout_s: float | None = None,
                 expect: tuple[int | None, float | None] = (None, None), await_base: bool = False,
                 identity: IdentityCheck | None = None, factors: bool = False) -> None:
        self.identity = identity or IdentityCheck(enabled=False)  # orch weight_broadcast.policy_check
        self.await_base = await_base  # orch weight_broadcast.policy_zero: published
        self.base_stamp = 0  # the published policy 0 every server serves as its base (0: none loaded)
        self.client, self.base_model, self.run_dir, self.prefix = client, base_model, run_dir, prefix
        self.expect = expect  # orch model.lora_rank / lora_alpha: a published adapter must match them
        self.factors = factors  # orch weight_broadcast.reload: factors (merged in place inside vLLM's workers)
        self.merged = merged or factors  # the weights change in place: running requests may see the new policy
        self.pushed_timeout_s = pushed_timeout_s  # set: the trainer pushes weights (weight_broadcast nccl)
        self.step = 0
        self.model = base_model
        self.loaded: tuple[int, int] = (0, 0)
        self.epochs: dict[str, float | None] | None = None
        self.version_high = 0  # the newest policy whose load has begun (in-flight requests may see it)
        self.users: Counter[str] = Counter()  # leased requests per served model name
        self.retired: set[str] = set()  # adapters replaced while requests still used them: unload at release
        self._unloads: set[asyncio.Task[None]] = set()

    def lease(self) -> tuple[str, int]:
        """The model name and policy version a new request uses; `release` the name when it returns."""
        self.users[self.model] += 1
        return self.model, self.step

    def release(self, model: str) -> None:
        """A request on `model` returned: unload a retired adapter once no request uses it."""
        self.users[model] -= 1
        if self.users[model] <= 0:
            del self.users[model]
            if model in self.retired:
                self.retired.discard(model)
                task = asyncio.get_running_loop().create_task(self.client.unload_adapter(model))
                self._unloads.add(task)
                task.add_done_callback(self._unloads.discard)

    async def drain_unloads(self) -> None:
        """Wait for the adapter unloads `release` started."""
        if self._unloads:
            await asyncio.gather(*self._unloads, return_exceptions=True)

    def end_version(self, start: int) -> int:
        """The newest policy a request that started under `start` may have been served by when it returns:
        `start` with LoRA (one adapter serves it wholly), else the newest policy whose load has begun."""
        if not self.merged and self.pushed_timeout_s is None:
            return start
        return max(start, self.version_high, self.step)

    def invalidate(self) -> None:
        """The server may have lost what was loaded (restart): load the policy again before the next request."""
        self.loaded, self.epochs, self.base_stamp = (-1, 0), None, 0

    async def _check_restart(self) -> None:
        epochs = await self.client.server_epochs()
        if self.epochs is not None and epochs != self.epochs:
            log.warning("the inference server restarted (%s); policy %d goes onto it again", ", ".join(
                u for u in epochs if epochs[u] != self.epochs.get(u)), self.step)
            self.loaded, self.base_stamp = (-1, 0), 0
            self.model = self.base_model
        self.epochs = epochs

    async def _wait_published(self, required: int, timeout_s: float) -> int:
        """The newest published policy, once it is >= `required`."""
        start = noted = time.monotonic()
        while ((newest := weights.newest_policy(self.run_dir)) < required
               or (self.await_base and not weights.policy_stamp(self.run_dir, 0))):
            now = time.monotonic()
            if now - start > timeout_s:
                if self.await_base and newest >= required:
                    raise TimeoutError(f"policy 0 was not published to {broadcasts_dir(self.run_dir)} within "
                                       f"{timeout_s:.0f} s: weight_broadcast.policy_zero is 'published' but the "
                                       f"trainer has not written it; is it running with qlora_bnb / qlora_fp8?")
                raise TimeoutError(f"policy {required} was not broadcast to {broadcasts_dir(self.run_dir)} "
                                   f"within {timeout_s:.0f} s; is the trainer running? (weights_timeout_s; "
                                   f"restart the trainer with --resume, then this orchestrator with --resume)")
            if now - noted > 30:
                log.info("waiting for policy %d from the trainer for %.0f s", required, now - start)
                noted = now
            await asyncio.sleep(0.05)
        return newest

    async def ensure(self, required: int, timeout_s: float) -> float:
        """Serve the newest policy, waiting until it is >= `required`; returns seconds waited."""
        start = time.monotonic()
        newest = await self._wait_published(required, timeout_s)
        await self._check_restart()
        ident = (newest, weights.policy_stamp(self.run_dir, newest))
        if ident != self.loaded:
            self.version_high = max(self.version_high, newest)
            await self._load(newest)  # on every server (or an error, and the step is retried): none serves stale
            if newest:
                await self._identify(newest)
            self.loaded = ident
            if newest:
                log.info("policy %d served by %d inference server(s)", self.step, len(self.client.urls))
        return time.monotonic() - start

    async def _identify(self, newest: int) -> None:
        """The identity check of policy `newest` on every server (`tidal.orchestrator.identity`). With pushed weights
        a server may already hold a newer policy whose probe is not published yet, or be in the middle of its push:
        the check runs only while every server reports version `newest` before and after it, and a failed one is
        repeated once a second later before it stops the run."""
        path = broadcast_dir(self.run_dir, newest)
        if self.pushed_timeout_s is None:
            await self.identity.after_load(self.client, self.model, path, newest)
            return
        for attempt in (0, 1):
            if set((await self.client.weight_versions()).values()) != {newest}:
                return  # a newer push is under way: its own load checks it
            try:
                await self.identity.after_load(self.client, self.model, path, newest)
                return
            except PolicyMismatch:
                if attempt:
                    raise
            await asyncio.sleep(1.0)

    async def _load_base(self) -> None:
        """Reload the trainer's policy 0 (a dequantized QLoRA base) on every server unless they serve it already;
        merged reloads of later policies replace every weight and need no base."""
        stamp = weights.policy_stamp(self.run_dir, 0)
        if stamp and stamp != self.base_stamp:
            await self.client.reload_weights(str(weights.merged_dir(self.run_dir, 0)))
            await self.identity.after_load(self.client, self.base_model, broadcast_dir(self.run_dir, 0), 0)
            self.base_stamp = stamp
            log.info("policy 0 (the trainer's dequantized base) served by %d inference server(s)",
                     len(self.client.urls))

    async def _load(self, newest: int) -> None:
        if newest == 0 or not self.merged or self.pushed_timeout_s is not None:
            await self._load_base()
        if newest == 0:  # the base model (as the server loaded it, or the trainer's policy 0)
            self.model, self.step = self.base_model, 0
        elif self.pushed_timeout_s is not None:
            self.step = await self._await_push(newest)
        elif self.factors:
            path = broadcast_dir(self.run_dir, newest)
            if not (path / "adapter_config.json").is_file():
                raise ValueError(f"{path} holds no LoRA adapter (the trainer trains full weights, train lora: false): "
                                 f"weight_broadcast.reload: factors needs LoRA; set it to merged")
            weights.check_adapter(path, *self.expect)
            await self.client.merge_lora(str(path))
            self.step = newest
        elif self.merged:
            path = weights.merged_dir(self.run_dir, newest)
            if not path.is_dir():
                raise FileNotFoundError(f"{path} is missing: weight_broadcast.reload is 'merged' but the trainer "
                                        f"does not write merged weights (set train broadcast_merged: true)")
            await self.client.reload_weights(str(path))
            self.step = newest
        else:
            name = f"{self.prefix}-step-{newest}"
            if not (broadcast_dir(self.run_dir, newest) / "adapter_config.json").is_file():
                raise ValueError(f"{broadcast_dir(self.run_dir, newest)} holds no LoRA adapter (the trainer trains "
                                 f"full weights, train lora: false): set orch weight_broadcast.reload: merged (and "
                                 f"infer weight_reload: true) or weight_broadcast.type: nccl")
            weights.check_adapter(broadcast_dir(self.run_dir, newest), *self.expect)
            await self.client.load_adapter(name, str(broadcast_dir(self.run_dir, newest)))
            old, self.model, self.step = self.model, name, newest
            if old not in (self.base_model, name):
                if self.users[old] > 0:  # in-flight requests still sample with it: unload when they return
                    self.retired.add(old)
                else:
                    await self.client.unload_adapter(old)

    async def _await_push(self, newest: int) -> int:
        """nccl: the trainer pushed policy `newest` before publishing it; check every server has it (a restarted
        one does not: ask the trainer to push again and wait). Returns the oldest version served."""
        start, asked = time.monotonic(), False
        while True:
            versions = await self.client.weight_versions()
            behind = {u: v for u, v in versions.items() if v < newest}
            if not behind:
                return min(versions.values())
            if not asked:
                log.warning("inference server(s) %s serve weight version(s) %s, not policy %d (restarted?); asking "
                            "the trainer to push it again", ", ".join(behind), sorted(set(behind.values())), newest)
                weights.request_push(self.run_dir, newest, f"behind: {behind}")
                asked = True
            assert self.pushed_timeout_s is not None
            if time.monotonic() - start > self.pushed_timeout_s:
                raise TimeoutError(f"inference server(s) {', '.join(behind)} still serve weight version(s) "
                                   f"{sorted(set(behind.values()))} instead of policy {newest} after "
                                   f"{self.pushed_timeout_s:.0f} s (weight_broadcast.timeout); is the trainer running "
                                   f"with weight_broadcast.type nccl and these servers in its base_url?")
            await asyncio.sleep(0.2)
