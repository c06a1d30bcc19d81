"""The HTTP routes of tidal's Tinker server: the REST protocol the Tinker SDK 0.38 speaks, over `TinkerService`.

Request bodies are validated with the SDK's own request models (`tinker.types`, which forbid unknown keys), so the
wire is the SDK's exactly; responses are its JSON shapes, except the results of forward/backward and sampling
futures, which the SDK reads only as protobuf (`tidal.tinker.wire`). Every `/api/v1` route but `healthz` needs the
`X-API-Key` header the SDK sends (its `api_key`); a wrong or missing key is answered 401.

`/api/v1/client/config` tells the SDK how to talk to this server: API keys (no JWT exchange), plain httpx,
zstd-compressed forward/backward bodies (`tidal.tinker.wire`), one `retrieve_futures` poller per sampling client
(`sample_use_retrieve_futures`: it learns which samples ended, then fetches each with `retrieve_future`; training
futures are polled one by one), server-allocated clone ids for unpickled sampling clients
(`sample_join_sampling_session`; both in `tidal.tinker.completions`), client-side custom losses.
Routes the SDK has but tidal does not implement (billing, projects, checkpoint publishing and listing, external
weights, weight copies) answer 404 with a message saying so.

Training requests are applied exactly once under the SDK's retries (`tidal.tinker.sequence`): a resent request gets
the future its first copy got.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tidal.tinker.losses import STABLE_REINFORCE_FIX
from tidal.tinker.sampler import MAX_LOGPROBS, SampleParams
from tidal.tinker.service import Result, TinkerService, UserError
from tidal.tinker.trainer import AdamStep, LoraSpec
from tidal.tinker.wire import decode_fwdbwd, fwdbwd_ident

log = logging.getLogger("tidal.tinker")
PROTO = "application/x-protobuf"

CLIENT_CONFIG = {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "use_pyqwest_transport": False,
                 "proto_compress_fwdbwd": True, "parallel_fwdbwd_chunks": False, "sample_use_retrieve_futures": True,
                 "custom_loss_server_side": False, "sample_join_sampling_session": True,
                 "sample_max_concurrent_requests": 64, "fwdbwd_max_chunk_len": 4096}
"""What `/api/v1/client/config` answers (see the module doc); `parallel_fwdbwd_chunks` false keeps a large request's
chunks in order on the one training thread."""


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


def _future(request_id: str, **extra: Any) -> dict[str, Any]:
    return {"request_id": request_id, **extra}


async def _body(request: Request, model: Any) -> Any:
    """The request's JSON body validated by `model` (an SDK request type)."""
    return model.model_validate(await request.json())


def build_app(service: TinkerService, api_key: str) -> FastAPI:
    """The FastAPI app serving `service` to clients that send `api_key`."""
    app = FastAPI(title="tidal Tinker-compatible server", docs_url=None, redoc_url=None, openapi_url=None)
    _add_guards(app, api_key)
    _add_service_routes(app, service)
    _add_training_routes(app, service)
    _add_checkpoint_routes(app, service)
    _add_sampling_routes(app, service)
    _add_future_routes(app, service)
    _add_not_implemented(app)
    return app


def _add_guards(app: FastAPI, api_key: str) -> None:
    """The API-key check on every `/api/v1` route but `healthz`, and 400 for a refused request."""

    @app.middleware("http")
    async def check_key(request: Request, call_next: Any) -> Any:
        path = request.url.path
        if path.startswith("/api/v1/") and path != "/api/v1/healthz":
            sent = request.headers.get("x-api-key", "")
            if not hmac.compare_digest(sent.encode(), api_key.encode()):
                return _error(401, "invalid or missing API key (X-API-Key): pass the key `tidal serve-tinker` was "
                                   "started with as api_key / TINKER_API_KEY")
        return await call_next(request)

    @app.exception_handler(ValueError)  # UserError, TrainerError, WireError, LossError, pydantic's ValidationError
    async def refused(request: Request, exc: ValueError) -> JSONResponse:
        return _error(400, str(exc))


def _add_service_routes(app: FastAPI, service: TinkerService) -> None:
    """Health, client configuration, telemetry, capabilities and sessions (create, heartbeat, finish)."""
    from tinker import types

    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config(request: Request) -> dict[str, Any]:
        await _body(request, types.ClientConfigRequest)
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {"refresh_interval_sec": 3600, "sample_cancel_enabled": False}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        return service.capabilities()

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        await _body(request, types.CreateSessionRequest)
        return {"type": "create_session", "session_id": service.create_session(),
                "info_message": f"tidal serve-tinker: {service.served_name}"}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> Any:
        req = await _body(request, types.SessionHeartbeatRequest)
        s = service.sessions.get(req.session_id)
        if s is None or s.finished:
            return _error(410, f"session {req.session_id} has finished or is unknown")
        service.session(req.session_id)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str) -> Any:
        service.finish_session(session_id)
        return None


def _add_training_routes(app: FastAPI, service: TinkerService) -> None:
    """Training models: create one (LoRA, AdamW), its info, forward/backward and optimizer steps."""
    from tinker import types

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        req = await _body(request, types.CreateModelRequest)
        if req.optimizer_config.type != "adamw":
            raise UserError(f"optimizer {req.optimizer_config.type!r}: tidal trains with AdamW only")
        if req.lora_config is None:
            raise UserError("create_model without a lora_config: tidal's Tinker server trains LoRA adapters only")
        lc = req.lora_config
        lora = LoraSpec(lc.rank, lc.seed, lc.train_mlp, lc.train_attn, lc.train_unembed)
        return _future(service.create_model(req.session_id, req.model_seq_id, req.base_model, lora))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        req = await _body(request, types.GetInfoRequest)
        return service.info(req.model_id)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        body, encoding = await request.body(), request.headers.get("content-encoding")
        try:
            if PROTO not in request.headers.get("content-type", ""):
                raise UserError(f"forward_backward takes a protobuf body ({PROTO}), as the Tinker SDK sends it")
            req = decode_fwdbwd(body, encoding)
        except ValueError as exc:  # the refusal takes the request's seq_id when its envelope reads
            ident = fwdbwd_ident(body, encoding)
            if ident is not None:
                service.refuse(ident[0], ident[1], exc)
            raise
        return _future(service.forward_backward(req), model_id=req.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        req = await _body(request, types.OptimStepRequest)
        p = req.optim_params
        step: AdamStep | UserError
        if isinstance(p, types.AdamParams):
            step = AdamStep(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm)
        else:
            step = UserError(f"optim_step with {getattr(p, 'type', type(p).__name__)} parameters: tidal trains "
                             "with AdamW only (types.AdamParams)")
        return _future(service.optim_step(req.model_id, step, req.seq_id), model_id=req.model_id)


def _add_checkpoint_routes(app: FastAPI, service: TinkerService) -> None:
    """Saving and loading a training model's state, and its weights for sampling."""
    from tinker import types

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        req = await _body(request, types.SaveWeightsRequest)
        return _future(service.save_state(req.model_id, req.path, req.overwrite, req.seq_id), model_id=req.model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict[str, Any]:
        req = await _body(request, types.SaveWeightsForSamplerRequest)
        session = service.models[req.model_id].session_id if req.model_id in service.models else None
        return _future(service.save_for_sampler(req.model_id, req.path, session, req.seq_id), model_id=req.model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        req = await _body(request, types.LoadWeightsRequest)
        if req.optimizer_config is not None and req.optimizer_config.type != "adamw":
            raise UserError(f"optimizer {req.optimizer_config.type!r}: tidal trains with AdamW only")
        if req.session_id is not None:  # create-via-load
            rid = service.create_from_state(req.session_id, int(req.model_seq_id or 0), req.path, req.optimizer,
                                            req.base_model)
            return _future(rid, model_id=f"{req.session_id}:train:{int(req.model_seq_id or 0)}")
        if req.model_id is None:
            raise UserError("load_weights needs a model_id or a session_id")
        return _future(service.load_state(req.model_id, req.path, req.optimizer, req.seq_id), model_id=req.model_id)

    @app.post("/api/v1/save_weights_external")
    async def save_external(request: Request) -> JSONResponse:
        message = ("save_weights_external is not implemented by tidal's Tinker server; the sampler checkpoints "
                   "under OUTPUT_DIR/checkpoints are PEFT adapter directories already")
        with contextlib.suppress(ValueError):  # the refusal takes its seq_id: the SDK's next request is no gap
            req = await _body(request, types.SaveWeightsExternalRequest)
            service.refuse(req.model_id, req.seq_id, UserError(message))
        return _error(404, message)


def _add_sampling_routes(app: FastAPI, service: TinkerService) -> None:
    """Sampling sessions (create, join), sampler info and `asample`."""
    from tinker import types

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        req = await _body(request, types.CreateSamplingSessionRequest)
        sid = service.create_sampling_session(req.session_id, req.model_path, req.base_model,
                                              req.sampling_session_seq_id)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @app.post("/api/v1/join_sampling_session")
    async def join_sampling_session(request: Request) -> dict[str, Any]:
        req = await _body(request, types.JoinSamplingSessionRequest)
        counter = service.join_sampling_session(req.sampling_session_id)
        return types.JoinSamplingSessionResponse(client_counter=counter).model_dump(mode="json")

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        return service.sampler_info(sampler_id)

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        req = await _body(request, types.SampleRequest)
        if req.record_stability_info:
            raise UserError(f"sample with record_stability_info: {STABLE_REINFORCE_FIX}")
        refused = [what for what, on in (("target_prompt_logprobs", req.target_prompt_logprobs is not None),
                                         ("prompt_alt_tokens_k", req.prompt_alt_tokens_k > 0)) if on]
        if refused:
            raise UserError(f"sample: {', '.join(refused)} is not supported by tidal's Tinker server")
        if max(req.topk_prompt_logprobs, req.topk_sample_logprobs) > MAX_LOGPROBS:
            raise UserError(f"sample: top-k logprobs up to {MAX_LOGPROBS} per position")
        sp = req.sampling_params
        stop = sp.stop if sp.stop is None or isinstance(sp.stop, str) else list(sp.stop)
        params = SampleParams(sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed, stop,
                              bool(req.prompt_logprobs), req.topk_prompt_logprobs, req.topk_sample_logprobs,
                              req.prompt_logprobs_last_n)
        try:
            prompt = req.prompt.to_ints()
        except ValueError as exc:
            raise UserError(f"sample: {exc}; tidal's Tinker server takes token prompts only") from None
        rid, seq_ids = service.sample(req.sampling_session_id, req.model_path, req.base_model, prompt,
                                      req.num_samples, params, req.seq_id)
        return _future(rid, sample_sequence_ids=seq_ids)


def _add_future_routes(app: FastAPI, service: TinkerService) -> None:
    """Retrieving futures (one, or a sampling client's completions) and cancelling them."""
    from tinker import types

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Any:
        req = await _body(request, types.FutureRetrieveRequest)
        out = await service.retrieve(req.request_id)
        if isinstance(out, Result):
            if out.proto is not None:
                return Response(out.proto, media_type=PROTO)
            return out.data
        return out

    @app.post("/api/v1/retrieve_futures")
    async def retrieve_futures(request: Request) -> dict[str, Any]:
        req = await _body(request, types.FuturesRetrieveRequest)
        target = req.target
        ended, cursor = await service.retrieve_futures(target.sampling_session_id, target.cloned_sampler_id,
                                                       req.prev_cursor, req.timeout, req.retrieved_request_ids)
        completions: list[types.FutureFinished | types.FutureFailed] = [
            types.FutureFailed(request_id=c.request_id) if c.failed
            else types.FutureFinished(request_id=c.request_id, response_payload_uncompressed_size=c.size)
            for c in ended]
        return types.FuturesRetrieveResponse(completions=completions, cursor=cursor).model_dump(mode="json")

    @app.post("/api/v1/cancel_future")
    async def cancel_future(request: Request) -> None:
        service.cancel((await request.json()).get("request_id", ""))


def _add_not_implemented(app: FastAPI) -> None:
    """404 with a message for every other `/api/v1` route (registered last: it matches every path)."""

    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def not_implemented(rest: str) -> JSONResponse:
        return _error(404, f"/api/v1/{rest} is not implemented by tidal's Tinker server (see docs/tinker.md)")
