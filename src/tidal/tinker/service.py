"""The state of tidal's Tinker server: sessions, training models, sampling sessions, checkpoints and futures.

Every training operation (create_model, forward_backward, forward, optim_step, save_weights,
save_weights_for_sampler, load_weights) is submitted to one worker thread that owns the `TrainerHost`, in each
model's `seq_id` order and exactly once (`submit_seq`, `tidal.tinker.sequence`: a request the SDK resends gets the
future of its first copy; one after a gap waits for the missing ones). The request returns a future id at once; the
SDK polls `retrieve_future`, which waits up to `POLL_S` for the result and otherwise answers `try_again`.
Sampling runs on the event loop against vLLM (`tidal.tinker.sampler`), concurrently, as futures too; each sample of
the SDK also lands in its (sampling session, clone)'s completion queue when it ends, which the SDK's one poller per
sampling client reads with `retrieve_futures` (`tidal.tinker.completions`; `join_sampling_session` hands a new clone
its block of `seq_id`s).

Paths: `tinker://MODEL_ID/weights/NAME` (training state: adapter + optimizer) and
`tinker://MODEL_ID/sampler_weights/NAME` (adapter for sampling) live under `OUTPUT_DIR/checkpoints/` with the same
relative path (`tidal.paths.tinker_ckpt_dir`), each written atomically with a `STABLE` marker, which a load
requires; model ids are `SESSION_ID:train:N` as the SDK derives them. A sampler checkpoint gets a fresh vLLM
adapter name each time it is (re)written, so vLLM never serves stale weights under a reused name.

Errors a caller can fix (unknown model, bad input, refused option) fail the future with category `user` and a
message that says what to change; anything else fails it with category `server`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.paths import STABLE, tinker_ckpt_dir
from tidal.tinker.completions import Completion, Completions, Joins, clone_of
from tidal.tinker.losses import LossError
from tidal.tinker.sampler import SampleParams, Sampler, SamplerError
from tidal.tinker.sequence import GAP_S, Ledger, SeqError
from tidal.tinker.trainer import AdamStep, LoraSpec, TrainerError, TrainerHost
from tidal.tinker.wire import FwdBwdRequest, WireError, encode_fwdbwd_output, encode_sample_response

log = logging.getLogger("tidal.tinker")
POLL_S = 30.0
"""How long `retrieve_future` waits for a result before answering `try_again` (the SDK polls again at once)."""
KEEP_S = 300.0
"""How long a finished future stays retrievable after it was first retrieved."""
USER_ERRORS = (TrainerError, LossError, WireError, SeqError, ValueError)
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class UserError(ValueError):
    """A request the caller can fix."""


Run = Callable[[], "Result"]
"""A training operation, run on the training thread."""


@dataclass
class Result:
    """A finished future's payload: JSON (`data`) or protobuf bytes (`proto`)."""

    data: dict[str, Any] | None = None
    proto: bytes | None = None


@dataclass
class ModelRecord:
    session_id: str
    lora: LoraSpec


@dataclass
class SamplingSession:
    base_model: str
    model_path: str | None
    adapter: tuple[str, Path] | None
    """(vLLM adapter name, adapter directory), None for the base model."""


@dataclass
class Session:
    finished: bool = False
    last_seen: float = field(default_factory=time.time)
    sampling: list[str] = field(default_factory=list)


class TinkerService:
    """What the routes of `tidal.tinker.app` call."""

    def __init__(self, served_name: str, model_dir: str, architecture: str, max_context: int,
                 trainer: TrainerHost, sampler: Sampler, output_dir: Path, max_lora_rank: int,
                 aliases: set[str], vllm_model: str, policy_check: bool = True) -> None:
        self.served_name = served_name
        self.policy_check = policy_check
        """Check what vLLM serves after each adapter load (`tidal.orchestrator.identity`; `--no-policy-check`)."""
        self.vllm_model = vllm_model
        """The base model's name in vLLM."""
        self.model_dir = model_dir
        self.architecture = architecture
        self.max_context = max_context
        self.trainer = trainer
        self.sampler = sampler
        self.output_dir = output_dir
        self.max_lora_rank = max_lora_rank
        self.names = {served_name, model_dir} | aliases
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, ModelRecord] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.adapter_names: dict[str, str] = {}  # tinker sampler path -> vLLM adapter name
        self.futures: dict[str, concurrent.futures.Future[Result]] = {}
        self.ledger = Ledger()
        """Training requests' ids by (model id, seq_id): a retried request gets its first future."""
        self.held: dict[str, dict[int, tuple[concurrent.futures.Future[Result], Run | Exception]]] = {}
        """Training requests after a gap in their model's seq_ids, waiting for the missing ones."""
        self.created: dict[str, str] = {}
        """The request id of each model's creation (create_model, create-via-load_weights), for their retries."""
        self.sample_ids = Ledger()
        """Sampling requests' ids by (sampling session id, seq_id)."""
        self.sampling_by_seq: dict[tuple[str, int], str] = {}
        """Sampling session ids by (session id, sampling_session_seq_id)."""
        self.completions = Completions()
        """Finished samples per (sampling session, clone), for `retrieve_futures`."""
        self.joins = Joins()
        """The clone ids `join_sampling_session` gave out, per sampling session (never reused)."""
        self.worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-train")
        self._counter = itertools.count()

    # --- futures -------------------------------------------------------------------------------------------------

    def _new_future(self) -> tuple[str, concurrent.futures.Future[Result]]:
        rid = f"req-{uuid.uuid4().hex}"
        fut: concurrent.futures.Future[Result] = concurrent.futures.Future()
        self.futures[rid] = fut
        return rid, fut

    def submit_training(self, fn: Any, *args: Any) -> str:
        """Queue `fn(*args)` (returning a `Result`) on the training thread; the future's id."""
        rid = f"req-{uuid.uuid4().hex}"
        self.futures[rid] = self.worker.submit(self._guarded, fn, *args)
        return rid

    @staticmethod
    def _guarded(fn: Any, *args: Any) -> Result:
        try:
            result: Result = fn(*args)
            return result
        except USER_ERRORS:
            raise
        except Exception:
            log.exception("training operation %s failed", getattr(fn, "__name__", fn))
            raise

    def submit_seq(self, model_id: str, seq: int | None, prepare: Callable[[], Run]) -> str:
        """Queue training request `seq` of `model_id` exactly once (`tidal.tinker.sequence`); the future's id.

        `prepare()` checks the request and returns what to run; a request it refuses (`USER_ERRORS`) still takes
        its `seq_id` (a failed future: its retries get the same refusal, and the next request is no gap), and the
        refusal is raised. Without a `seq_id` (not the SDK) the request is simply queued."""
        if seq is None:
            return self.submit_training(prepare())
        verdict = self.ledger.check(model_id, seq)
        if verdict.rid is not None:
            log.info("model %s: seq_id %d again (a retry): answered with its first future %s", model_id, seq,
                     verdict.rid)
            return verdict.rid
        rid, fut = self._new_future()
        job: Run | Exception
        try:
            job = prepare()
        except USER_ERRORS as exc:
            job = exc
        self.ledger.remember(model_id, seq, rid, in_order=False)
        self.held.setdefault(model_id, {})[seq] = (fut, job)
        if verdict.hold:
            log.warning("model %s: seq_id %d arrived before %d; held until the missing ones arrive", model_id, seq,
                        self.ledger.last(model_id) + 1)
            asyncio.get_running_loop().call_later(GAP_S, self._expire, model_id, seq)
        self._drain(model_id)
        if isinstance(job, Exception):
            raise job
        return rid

    def refuse(self, model_id: str | None, seq: int | None, exc: Exception) -> None:
        """A numbered request refused before it could be queued (an unreadable body, a route tidal lacks) still
        takes its `seq_id`, so the SDK's next request is no gap (the SDK goes on after a refusal)."""
        if model_id is None or seq is None or model_id not in self.models:
            return

        def prepare() -> Run:
            raise exc

        with contextlib.suppress(*USER_ERRORS):
            self.submit_seq(model_id, seq, prepare)

    def _drain(self, model_id: str) -> None:
        """Start the held requests of `model_id` that are next in order."""
        held = self.held.get(model_id, {})
        while (nxt := self.ledger.last(model_id) + 1) in held:
            fut, job = held.pop(nxt)
            self.ledger.remember(model_id, nxt, self.ledger.seen(model_id, nxt) or "", in_order=True)
            if isinstance(job, Exception):
                fut.set_exception(job)
            else:
                self._start(fut, job)

    def _start(self, fut: concurrent.futures.Future[Result], job: Run) -> None:
        work = self.worker.submit(self._guarded, job)

        def copy(done: concurrent.futures.Future[Result]) -> None:
            if fut.done():
                return
            exc = None if done.cancelled() else done.exception()
            if done.cancelled():
                fut.cancel()
            elif exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(done.result())

        work.add_done_callback(copy)
        fut.add_done_callback(lambda f: work.cancel() if f.cancelled() else None)

    def _expire(self, model_id: str, seq: int) -> None:
        """A held request whose predecessors did not come within `GAP_S` fails, and the gap closes: each missing
        `seq_id` before it takes a refusal (a late one is answered with it, never run out of order), the requests
        held before it fail too, and the model goes on from `seq` + 1 (before, it waited for the gap forever)."""
        held = self.held.get(model_id, {})
        entry = held.pop(seq, None)
        if entry is None or seq <= self.ledger.last(model_id):
            return  # its predecessors came: it ran (or was answered) in order
        missing = self.ledger.last(model_id) + 1
        error = SeqError(f"seq_id {seq} for {model_id} waited {GAP_S:.0f} s for seq_id {missing}, which never "
                         "arrived; the SDK sends a training client's requests in order, one client per model")
        for lost in range(missing, seq):
            earlier = held.pop(lost, None)
            if earlier is not None:
                if not earlier[0].done():
                    earlier[0].set_exception(error)
            elif self.ledger.seen(model_id, lost) is None:
                rid, fut = self._new_future()
                fut.set_exception(SeqError(f"seq_id {lost} for {model_id} did not arrive within {GAP_S:.0f} s of "
                                           f"seq_id {seq}, so the model went on without it; it is not run late"))
                self.ledger.remember(model_id, lost, rid, in_order=False)
        if not entry[0].done():
            entry[0].set_exception(error)
        self.ledger.remember(model_id, seq, self.ledger.seen(model_id, seq) or "", in_order=True)
        self._drain(model_id)

    def submit_async(self, coro: Any) -> str:
        """Run coroutine `coro` (returning a `Result`) on the event loop; the future's id."""
        rid, fut = self._new_future()

        async def run() -> None:
            try:
                fut.set_result(await coro)
            except Exception as exc:  # noqa: BLE001 - the future carries it to the client
                if not isinstance(exc, USER_ERRORS + (SamplerError,)):
                    log.exception("sampling failed")
                fut.set_exception(exc)

        asyncio.get_running_loop().create_task(run())
        return rid

    async def retrieve(self, request_id: str) -> dict[str, Any] | Result:
        """The future's `Result`, a `RequestFailedResponse` dict, or a `TryAgainResponse` dict after `POLL_S`. A
        finished future stays retrievable for `KEEP_S` (for a client that retries after a lost connection)."""
        fut = self.futures.get(request_id)
        if fut is None:
            return {"error": f"unknown request_id {request_id!r} (finished futures are kept {KEEP_S:.0f} s after "
                             "their first retrieval)", "category": "user"}
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), POLL_S)
        except (TimeoutError, asyncio.TimeoutError):
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        except USER_ERRORS + (SamplerError,) as exc:
            category = "server" if isinstance(exc, SamplerError) else "user"
            return self._done(request_id, {"error": str(exc), "category": category})
        except Exception as exc:  # noqa: BLE001
            return self._done(request_id, {"error": f"{type(exc).__name__}: {exc}", "category": "server"})
        return self._done(request_id, result)

    def _done(self, request_id: str, out: Any) -> Any:
        asyncio.get_running_loop().call_later(KEEP_S, self.futures.pop, request_id, None)
        return out

    def cancel(self, request_id: str) -> None:
        fut = self.futures.get(request_id)
        if fut is not None:
            fut.cancel()

    # --- sessions ------------------------------------------------------------------------------------------------

    def create_session(self) -> str:
        sid = f"tidal-{uuid.uuid4().hex[:16]}"
        self.sessions[sid] = Session()
        return sid

    def session(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise UserError(f"unknown session {session_id!r}")
        if s.finished:
            raise UserError(f"session {session_id} has finished")
        s.last_seen = time.time()
        return s

    def finish_session(self, session_id: str) -> None:
        """Mark the session finished and free its training models' adapters (after their queued requests); its
        checkpoints stay on disk and its sampling sessions keep working."""
        s = self.sessions.get(session_id)
        if s is None or s.finished:
            return
        s.finished = True
        for model_id in [m for m, rec in self.models.items() if rec.session_id == session_id]:
            del self.models[model_id]
            self.ledger.drop(model_id)
            self.held.pop(model_id, None)
            self.created.pop(model_id, None)
            self.worker.submit(self.trainer.remove, model_id)
        for sid in s.sampling:
            self.sample_ids.drop(sid)
            self.completions.drop_idle(sid)

    # --- models --------------------------------------------------------------------------------------------------

    def check_base(self, base_model: str | None) -> None:
        if base_model is not None and base_model not in self.names:
            raise UserError(f"base_model {base_model!r} is not served here; this server serves "
                            f"{self.served_name!r} (one model per server: start another `tidal serve-tinker "
                            "--model ...` for another model)")

    def check_lora(self, lora: LoraSpec) -> None:
        if not 1 <= lora.rank <= self.max_lora_rank:
            raise UserError(f"LoRA rank {lora.rank}: this server takes ranks 1..{self.max_lora_rank} (start it with "
                            f"--max-lora-rank {max(lora.rank, 1)} for more)")

    def create_model(self, session_id: str, seq: int, base_model: str, lora: LoraSpec) -> str:
        """Queue the creation of a LoRA training model; the future's id (its result names the model)."""
        self.session(session_id)
        self.check_base(base_model)
        self.check_lora(lora)
        model_id = f"{session_id}:train:{seq}"
        if model_id in self.created:  # a retry: the SDK derives the id from (session, model_seq_id)
            return self.created[model_id]

        def run() -> Result:
            self.trainer.create(model_id, lora)
            self.models[model_id] = ModelRecord(session_id, lora)
            return Result({"model_id": model_id, "type": "create_model"})

        self.created[model_id] = rid = self.submit_training(run)
        return rid

    def model(self, model_id: str) -> ModelRecord:
        rec = self.models.get(model_id)
        if rec is None:
            raise UserError(f"unknown model_id {model_id!r}")
        return rec

    def info(self, model_id: str) -> dict[str, Any]:
        rec = self.model(model_id)
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": rec.lora.rank,
                "model_name": self.served_name,
                "model_data": {"arch": self.architecture, "model_name": self.served_name,
                               "tokenizer_id": self.model_dir}}

    def forward_backward(self, req: FwdBwdRequest) -> str:
        self.model(req.model_id)

        def run() -> Result:
            outputs, metrics = self.trainer.forward_backward(req)
            return Result(proto=encode_fwdbwd_output(outputs, metrics))

        return self.submit_seq(req.model_id, req.seq_id or None, lambda: run)

    def optim_step(self, model_id: str, step: AdamStep | Exception, seq: int | None) -> str:
        """An AdamW step; `step` an exception: the request was refused (it still takes its `seq_id`)."""
        self.model(model_id)

        def prepare() -> Run:
            if isinstance(step, Exception):
                raise step
            return lambda: Result({"metrics": self.trainer.optim_step(model_id, step)})

        return self.submit_seq(model_id, seq, prepare)

    # --- checkpoints ---------------------------------------------------------------------------------------------

    def tinker_path(self, model_id: str, kind: str, name: str) -> str:
        if not NAME.match(name):
            raise UserError(f"checkpoint name {name!r}: use letters, digits, '.', '_' and '-' (no '/')")
        return f"tinker://{model_id}/{kind}/{name}"

    def local(self, path: str, kinds: tuple[str, ...] = ("weights", "sampler_weights")) -> Path:
        """The directory of a `tinker://` path of this server; `UserError` for another form or a missing one."""
        parts = path[len("tinker://"):].split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in kinds or not NAME.match(parts[2]) or ".." in parts[0]:
            raise UserError(f"{path!r} is not a tinker://MODEL_ID/{'|'.join(kinds)}/NAME path")
        local = tinker_ckpt_dir(self.output_dir, parts[0], parts[1], parts[2])
        if not (local / STABLE).is_file():
            raise UserError(f"no (complete) checkpoint at {path} (looked for {local / STABLE})")
        return local

    def save_state(self, model_id: str, name: str | None, overwrite: bool, seq: int | None) -> str:
        self.model(model_id)

        def prepare() -> Run:  # a retry never gets here: "exists" is no refusal of its own first save
            nonlocal name
            name = name or f"state-{next(self._counter)}"
            path = self.tinker_path(model_id, "weights", name)
            local = tinker_ckpt_dir(self.output_dir, model_id, "weights", name)
            if local.exists() and not overwrite:
                raise UserError(f"checkpoint {path} exists; pass overwrite=True or another name")

            def run() -> Result:
                self.trainer.save_state(model_id, local, self.served_name)
                return Result({"path": path, "type": "save_weights"})

            return run

        return self.submit_seq(model_id, seq, prepare)

    def save_for_sampler(self, model_id: str, name: str | None, session_id: str | None, seq: int | None) -> str:
        """Save the adapter for sampling: under `name` (result: its path), or, without a name, as an ephemeral
        checkpoint with a new sampling session (result: the session's id)."""
        rec = self.model(model_id)

        def prepare() -> Run:
            ephemeral = name is None
            label = name or f"ephemeral-{next(self._counter)}"
            path = self.tinker_path(model_id, "sampler_weights", label)
            local = tinker_ckpt_dir(self.output_dir, model_id, "sampler_weights", label)

            def run() -> Result:
                self.trainer.save_sampler(model_id, local)
                self.adapter_names[path] = f"lora-{next(self._counter)}"
                if not ephemeral:
                    return Result({"path": path, "type": "save_weights_for_sampler"})
                sid = self._new_sampling_session(session_id or rec.session_id, path)
                return Result({"path": None, "sampling_session_id": sid, "type": "save_weights_for_sampler"})

            return run

        return self.submit_seq(model_id, seq, prepare)

    def load_state(self, model_id: str, path: str, optimizer: bool, seq: int | None) -> str:
        self.model(model_id)

        def prepare() -> Run:
            local = self.local(path, ("weights",))
            return lambda: self._load(model_id, local, path, optimizer)

        return self.submit_seq(model_id, seq, prepare)

    def create_from_state(self, session_id: str, seq: int, path: str, optimizer: bool,
                          base_model: str | None) -> str:
        """`create_training_client_from_state[_with_optimizer]`: a new model from a training checkpoint (a new
        model id, whose requests the SDK numbers from 1 again)."""
        model_id = f"{session_id}:train:{seq}"
        if model_id in self.created:  # a retry
            return self.created[model_id]
        self.session(session_id)
        self.check_base(base_model)
        local = self.local(path, ("weights",))
        record = TrainerHost.read_record(local)
        lora = LoraSpec(**record["lora"])
        self.check_lora(lora)

        def run() -> Result:
            self.trainer.create(model_id, lora)
            self.models[model_id] = ModelRecord(session_id, lora)
            return self._load(model_id, local, path, optimizer)

        self.created[model_id] = rid = self.submit_training(run)
        return rid

    def _load(self, model_id: str, local: Path, path: str, optimizer: bool) -> Result:
        self.trainer.load_state(model_id, local, optimizer)
        return Result({"path": path, "model_id": model_id, "type": "load_weights"})

    # --- sampling ------------------------------------------------------------------------------------------------

    def _new_sampling_session(self, session_id: str, model_path: str | None) -> str:
        adapter = None
        if model_path is not None:
            local = self.local(model_path)
            name = self.adapter_names.setdefault(model_path, f"lora-{next(self._counter)}")
            adapter = (name, local)
        sid = f"{session_id}:sample:{len(self.samplers)}"
        self.samplers[sid] = SamplingSession(self.served_name, model_path, adapter)
        if session_id in self.sessions:
            self.sessions[session_id].sampling.append(sid)
        return sid

    def create_sampling_session(self, session_id: str, model_path: str | None, base_model: str | None,
                                seq: int | None = None) -> str:
        """A sampling session; a retry (the same `sampling_session_seq_id` of the session) gets the same one."""
        if seq is not None and (session_id, seq) in self.sampling_by_seq:
            return self.sampling_by_seq[(session_id, seq)]
        self.session(session_id)
        self.check_base(base_model)
        sid = self._new_sampling_session(session_id, model_path)
        if seq is not None:
            self.sampling_by_seq[(session_id, seq)] = sid
        return sid

    def sampler_info(self, sampler_id: str) -> dict[str, Any]:
        s = self.samplers.get(sampler_id)
        if s is None:
            raise UserError(f"unknown sampler {sampler_id!r}")
        return {"sampler_id": sampler_id, "base_model": s.base_model, "model_path": s.model_path}

    def sample(self, sampler_id: str | None, model_path: str | None, base_model: str | None, prompt: list[int],
               n: int, params: SampleParams, seq: int | None = None) -> tuple[str, list[str]]:
        """Start sampling; (the future's id, one sequence id per sample). A retry (the same `seq_id` in the same
        sampling session) gets the first request's future and sequence ids."""
        if sampler_id is not None and seq is not None:
            rid = self.sample_ids.seen(sampler_id, seq)
            if rid is not None:
                return rid, [f"seq-{rid}-{i}" for i in range(n)]
        if sampler_id is not None:
            if sampler_id not in self.samplers:
                raise UserError(f"unknown sampling_session_id {sampler_id!r}")
            session = self.samplers[sampler_id]
        else:
            self.check_base(base_model)
            sid = self._new_sampling_session("anonymous", model_path)
            session = self.samplers[sid]
        if not prompt:
            raise UserError("sample: empty prompt")
        if n < 1:
            raise UserError(f"sample: num_samples must be >= 1, got {n}")

        async def run() -> Result:
            model = self.vllm_model if session.adapter is None else session.adapter[0]
            if session.adapter is not None and await self.sampler.ensure_adapter(*session.adapter):
                await self.sampler.check_served(*session.adapter, enabled=self.policy_check)
            seqs, prompt_lps, topk = await self.sampler.sample(model, prompt, n, params)
            return Result(proto=encode_sample_response(seqs, prompt_lps, topk))

        rid = self.submit_async(run())
        if sampler_id is not None and seq is not None:
            self.sample_ids.remember(sampler_id, seq, rid, in_order=False)
            self._report(sampler_id, clone_of(seq), rid)
        return rid, [f"seq-{rid}-{i}" for i in range(n)]

    def _report(self, sampler_id: str, clone: int, rid: str) -> None:
        """Put sample `rid` in its target's completion queue once it ends (finished with its payload's size, or
        failed: cancelled or raised)."""
        queue = self.completions.queue(sampler_id, clone)
        queue.expect(rid)
        loop = asyncio.get_running_loop()

        def ended(fut: concurrent.futures.Future[Result]) -> None:
            failed = fut.cancelled() or fut.exception() is not None
            proto = None if failed else fut.result().proto
            loop.call_soon_threadsafe(queue.push, rid, failed, None if proto is None else len(proto))

        self.futures[rid].add_done_callback(ended)

    async def retrieve_futures(self, sampler_id: str, clone: int, prev_cursor: int, timeout: float | None,
                               retrieved: list[str]) -> tuple[list[Completion], int]:
        """`/api/v1/retrieve_futures`: the target's completions after `prev_cursor` (waiting up to `timeout` for
        one) and the cursor to send next; the futures in `retrieved` (the SDK has their payloads) are freed."""
        if sampler_id not in self.samplers:
            raise UserError(f"retrieve_futures: unknown sampling_session_id {sampler_id!r}")
        if clone < 0 or prev_cursor < 0:
            raise UserError(f"retrieve_futures: cloned_sampler_id ({clone}) and prev_cursor ({prev_cursor}) are "
                            "counts from 0")
        queue = self.completions.queue(sampler_id, clone)
        for rid in retrieved:
            if rid in queue.owned:  # only this target's own requests
                del queue.owned[rid]
                self.futures.pop(rid, None)
        return await queue.poll(prev_cursor, timeout)

    def join_sampling_session(self, sampler_id: str) -> int:
        """`/api/v1/join_sampling_session`: a clone id unique in the sampling session (1, 2, ...; 0 is its creator),
        so that a new client's `seq_id`s never collide with another's."""
        if sampler_id not in self.samplers:
            raise UserError(f"join_sampling_session: unknown sampling_session_id {sampler_id!r}")
        return self.joins.join(sampler_id)

    def capabilities(self) -> dict[str, Any]:
        return {"supported_models": [{"model_name": self.served_name, "max_context_length": self.max_context,
                                      "trainable": True, "sampleable": True}]}
