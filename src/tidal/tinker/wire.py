"""The Tinker SDK's binary wire formats: a `forward_backward` request in, `ForwardBackwardOutput` and
`SampleResponse` out, as the protobuf messages of the installed SDK (`tinker.proto.tinker_public_pb2`).

The SDK 0.38 always sends `/api/v1/forward_backward` as protobuf (`application/x-protobuf`) and accepts the results
of forward/backward and sampling futures only as protobuf; everything else it speaks is JSON (`tidal.tinker.app`).
This module turns those messages into plain typed records (`FwdBwdRequest`, `Datum` with numpy arrays) and back,
and knows nothing of torch or of the server. Tensors: dense or sparse CSR (the SDK sparsifies 2-D `target_tokens`
and `weights` when that is smaller; unlisted cells are 0), float32 / int64 / int32 / bfloat16. Model inputs: token
chunks only; an image or audio chunk is refused (`WireError`). A body may come zstd-compressed (`Content-Encoding:
zstd`: the SDK compresses when the server's client config sets `proto_compress_fwdbwd`, which tidal's does); it is
decompressed up to `MAX_BODY` bytes. Provenance spans are checked and then not used (only `stable_reinforce`, which
tidal refuses, reads them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class WireError(ValueError):
    """A request this server cannot read (what it holds, and why, in the message)."""


MAX_BODY = 1 << 30
"""The largest decompressed forward_backward body read (1 GiB; the SDK's chunks are ~5 MB before compression)."""


def _pb():  # type: ignore[no-untyped-def]
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass
class Datum:
    """One sequence of a forward/backward request: the model input's token ids and the `loss_fn_inputs`."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class FwdBwdRequest:
    """`/api/v1/forward_backward`: `forward_only` for the SDK's `forward`."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    data: list[Datum]


def _np_dtype(pb, dtype: int) -> np.dtype:  # type: ignore[no-untyped-def]
    table = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if dtype == pb.DTYPE_BFLOAT16:
        return np.dtype(np.uint16)
    if dtype not in table:
        raise WireError(f"tensor dtype {dtype} is not one the SDK sends (float32, int64)")
    return np.dtype(table[dtype])


def _widen(pb, arr: np.ndarray, dtype: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    if dtype == pb.DTYPE_BFLOAT16:  # the upper 16 bits of a float32
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.int64) if dtype == pb.DTYPE_INT32 else arr


def decode_tensor(msg) -> np.ndarray:  # type: ignore[no-untyped-def]
    """A proto `Tensor` -> a dense numpy array (sparse CSR densified with 0)."""
    pb = _pb()
    dt = _np_dtype(pb, msg.dtype)
    shape = [int(s) for s in msg.shape]
    if msg.HasField("sparse_csr"):
        if len(shape) != 2:
            raise WireError(f"a sparse CSR tensor must be 2-D, got shape {shape}")
        values = _widen(pb, np.frombuffer(msg.sparse_csr.values, dtype=dt), msg.dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        if len(crow) != shape[0] + 1 or len(col) != len(values) or (len(crow) and crow[-1] != len(values)):
            raise WireError(f"sparse CSR tensor of shape {shape}: {len(crow)} row pointers, {len(col)} columns, "
                            f"{len(values)} values do not fit together")
        out = np.zeros(shape, dtype=values.dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        out[rows, col] = values
        return out
    arr = _widen(pb, np.frombuffer(msg.dense, dtype=dt), msg.dtype)
    if shape:
        if int(np.prod(shape)) != arr.size:
            raise WireError(f"tensor of shape {shape} holds {arr.size} values")
        arr = arr.reshape(shape)
    return arr.copy()


def _check_provenance(i: int, d, n_tokens: int, inputs: dict[str, np.ndarray]) -> None:  # type: ignore[no-untyped-def]
    """Provenance spans (`Datum.with_provenance`; tinker-cookbook's RL loop attaches them to every datum) say which
    sampled sequence each position came from. Only `stable_reinforce` reads them, and tidal refuses that loss, so
    they are checked (both lists or neither, each tiling its field, as the SDK's `with_provenance` requires) and
    otherwise not used."""
    spans, loss_spans = list(d.model_input_spans), list(d.loss_fn_input_spans)
    if not spans and not loss_spans:
        return
    if not spans or not loss_spans:
        raise WireError(f"datum {i}: provenance comes as a pair (model_input_spans and loss_fn_input_spans)")
    targets = inputs.get("target_tokens")
    for name, field_spans, want in (("model_input", spans, n_tokens),
                                    ("loss_fn_inputs", loss_spans, None if targets is None else len(targets))):
        lengths = [getattr(s, s.WhichOneof("span") or "prompt_tokens").length for s in field_spans]
        if any(n < 0 for n in lengths) or (want is not None and sum(lengths) != want):
            raise WireError(f"datum {i}: {name} provenance spans cover {sum(lengths)} positions, the field has "
                            f"{want}")


def _unzstd(body: bytes) -> bytes:
    """A zstd frame decompressed, refused past `MAX_BODY` bytes (a frame may omit its size)."""
    import io

    import zstandard

    try:
        parts: list[bytes] = []
        size = 0
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
            while size <= MAX_BODY and (part := reader.read(1 << 20)):
                parts.append(part)
                size += len(part)
        out = b"".join(parts)
    except zstandard.ZstdError as exc:
        raise WireError(f"forward_backward body is not a zstd frame (Content-Encoding: zstd): {exc}") from None
    if len(out) > MAX_BODY:
        raise WireError(f"forward_backward body decompresses to more than {MAX_BODY} bytes")
    return bytes(out)


def decode_fwdbwd(body: bytes, content_encoding: str | None = None) -> FwdBwdRequest:
    """The protobuf body of `/api/v1/forward_backward` -> `FwdBwdRequest`."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "zstd":
        body = _unzstd(body)
    elif encoding != "identity":
        raise WireError(f"forward_backward body with Content-Encoding {content_encoding!r}: tidal reads zstd or "
                        "uncompressed bodies")
    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError
        raise WireError(f"forward_backward body is not a ForwardBackwardRequest message: {exc}") from None
    config: dict[str, float] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "text":
            raise WireError(f"loss_fn_config {k!r} = {v.text!r}: the built-in losses take numbers only")
        config[k] = float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(f"datum {i}: model_input chunk of type {kind!r}; tidal's Tinker server takes token "
                                "chunks (EncodedTextChunk) only")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {k: decode_tensor(v) for k, v in d.loss_fn_inputs.items()}
        _check_provenance(i, d, len(tokens), inputs)
        data.append(Datum(tokens, inputs))
    return FwdBwdRequest(msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), data)


def fwdbwd_ident(body: bytes, content_encoding: str | None = None) -> tuple[str, int] | None:
    """(model_id, seq_id) of a forward_backward body `decode_fwdbwd` refused, when its envelope reads (so the
    refusal can take its `seq_id`); None otherwise."""
    try:
        if (content_encoding or "").strip().lower() == "zstd":
            body = _unzstd(body)
        msg = _pb().ForwardBackwardRequest()
        msg.ParseFromString(body)
    except Exception:  # noqa: BLE001 - unreadable: nothing to take
        return None
    return (msg.model_id, int(msg.seq_id)) if msg.seq_id else None


def encode_fwdbwd_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """`ForwardBackwardOutput` protobuf bytes: one `ArrayRecord` per datum (its shapes may differ from the next
    one's), float32 / int64 fields, and the metrics."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    for out in outputs:
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=1)
        for name, arr in out.items():
            is_int = np.issubdtype(arr.dtype, np.integer)
            flat = np.ascontiguousarray(arr, dtype=np.int64 if is_int else np.float32)
            bt = record.fields[name]
            bt.data = flat.tobytes()
            bt.offsets = np.array([0, flat.nbytes], dtype=np.int64).tobytes()
            bt.dtype = pb.DTYPE_INT64 if is_int else pb.DTYPE_FLOAT32
            bt.trailing_shape.extend(list(arr.shape[1:]))
    return bytes(msg.SerializeToString())


@dataclass
class Sequence:
    """One sampled sequence: token ids, their logprobs, why sampling stopped (`stop` or `length`) and, when asked,
    the (T, k) top-k ids and logprobs of each position."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    topk: tuple[np.ndarray, np.ndarray] | None = None


def _topk(msg, topk: tuple[np.ndarray, np.ndarray]) -> None:  # type: ignore[no-untyped-def]
    ids, lps = topk
    msg.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
    msg.logprobs = np.ascontiguousarray(lps, dtype=np.float32).tobytes()
    msg.length, msg.k = (int(ids.shape[0]), int(ids.shape[1])) if ids.ndim == 2 else (0, 0)


def encode_sample_response(sequences: list[Sequence], prompt_logprobs: np.ndarray | None = None,
                           topk_prompt: tuple[np.ndarray, np.ndarray] | None = None) -> bytes:
    """`SampleResponse` protobuf bytes; `prompt_logprobs` (float32, NaN where not computed) only when asked."""
    pb = _pb()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    msg = pb.SampleResponse()
    for s in sequences:
        seq = msg.sequences.add(stop_reason=reasons[s.stop_reason],
                                tokens=np.asarray(s.tokens, dtype=np.int32).tobytes(),
                                logprobs=np.asarray(s.logprobs, dtype=np.float32).tobytes())
        if s.topk is not None:
            _topk(seq.topk_sampled_logprobs, s.topk)
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if topk_prompt is not None:
        _topk(msg.topk_prompt_logprobs, topk_prompt)
    return bytes(msg.SerializeToString())
