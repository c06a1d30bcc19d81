"""tidal.tinker.wire against the Tinker SDK's own converters: what the SDK encodes, tidal decodes; what tidal
encodes, the SDK decodes (its `tinker.proto` request and response conversions, unchanged)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("tinker")  # the optional `tinker` extra
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response  # noqa: E402

from tidal.tinker.wire import (  # noqa: E402
    Sequence,
    WireError,
    decode_fwdbwd,
    encode_fwdbwd_output,
    encode_sample_response,
)


def sdk_body(data, loss_fn="ppo", config=None, forward_only=False) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s:train:0", seq_id=3)
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def test_forward_backward_request_round_trip():
    targets_2d = torch.zeros(5, 4, dtype=torch.int64)
    targets_2d[1, 2], targets_2d[3, 0] = 7, 9  # mostly zero: the SDK sends it sparse (CSR)
    data = [
        types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": [2, 3, 4], "logprobs": [-0.5, -1.0, -2.0],
                                    "advantages": np.array([0.0, 1.5, -1.5], dtype=np.float32)}),
        types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5, 6]),
                                                         types.EncodedTextChunk(tokens=[7, 8, 9])]),
                    loss_fn_inputs={"target_tokens": targets_2d, "weights": torch.ones(5, 4)}),
    ]
    assert data[1].loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    req = decode_fwdbwd(sdk_body(data, config={"clip_low_threshold": 0.9}, forward_only=True))
    assert (req.model_id, req.seq_id, req.loss_fn, req.forward_only) == ("s:train:0", 3, "ppo", True)
    assert req.config == {"clip_low_threshold": pytest.approx(0.9)}
    assert req.data[0].tokens == [1, 2, 3] and req.data[1].tokens == [5, 6, 7, 8, 9]
    np.testing.assert_array_equal(req.data[0].inputs["target_tokens"], [2, 3, 4])
    assert req.data[0].inputs["target_tokens"].dtype == np.int64
    np.testing.assert_allclose(req.data[0].inputs["advantages"], [0.0, 1.5, -1.5])
    np.testing.assert_array_equal(req.data[1].inputs["target_tokens"], targets_2d.numpy())
    np.testing.assert_array_equal(req.data[1].inputs["weights"], np.ones((5, 4)))


def test_text_config_values_are_refused():
    data = [types.Datum(model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": [2]})]
    with pytest.raises(WireError, match="numbers only"):
        decode_fwdbwd(sdk_body(data, config={"mode": "x"}))


def test_a_zstd_body_as_the_sdk_compresses_it_decodes_like_the_plain_one(monkeypatch):
    import zstandard

    import tidal.tinker.wire as wire

    rng = np.random.default_rng(0)
    data = [types.Datum(model_input=types.ModelInput.from_ints(rng.integers(0, 1000, 300).tolist()),
                        loss_fn_inputs={"target_tokens": rng.integers(0, 1000, 300).tolist(),
                                        "logprobs": rng.normal(size=300).astype(np.float32),
                                        "advantages": np.full(300, 0.5, dtype=np.float32)}) for _ in range(4)]
    plain = sdk_body(data)
    packed = zstandard.ZstdCompressor().compress(plain)  # what tinker.resources.training sends
    a, b = decode_fwdbwd(plain), decode_fwdbwd(packed, "zstd")
    assert (a.model_id, a.seq_id, len(a.data)) == (b.model_id, b.seq_id, 4)
    for x, y in zip(a.data, b.data, strict=True):
        assert x.tokens == y.tokens
        for k in x.inputs:
            np.testing.assert_array_equal(x.inputs[k], y.inputs[k])
    monkeypatch.setattr(wire, "MAX_BODY", len(plain) - 1)
    with pytest.raises(WireError, match="decompresses to more than"):
        decode_fwdbwd(packed, "zstd")


def test_compressed_or_garbage_bodies_are_refused():
    with pytest.raises(WireError, match="Content-Encoding 'gzip'"):
        decode_fwdbwd(b"\x1f\x8b", "gzip")
    with pytest.raises(WireError, match="not a zstd frame"):
        decode_fwdbwd(b"\xff\xff\xff\xff\xff\xff", "zstd")
    with pytest.raises(WireError, match="not a ForwardBackwardRequest"):
        decode_fwdbwd(b"\xff\xff\xff")


def test_forward_backward_output_decodes_in_the_sdk():
    outs = [{"logprobs": np.array([-1.0, -2.5], dtype=np.float32)},
            {"logprobs": np.arange(6, dtype=np.float32).reshape(3, 2)}]
    got = deserialize_forward_backward_output(encode_fwdbwd_output(outs, {"loss:sum": 3.25}))
    assert got.metrics == {"loss:sum": 3.25}
    assert len(got.loss_fn_outputs) == 2
    np.testing.assert_array_equal(got.loss_fn_outputs[0]["logprobs"].to_numpy(), outs[0]["logprobs"])
    np.testing.assert_array_equal(got.loss_fn_outputs[1]["logprobs"].to_numpy(), outs[1]["logprobs"])


def test_sample_response_decodes_in_the_sdk():
    ids, lps = np.array([[3, 4], [5, 6]]), np.array([[-0.1, -2.0], [-0.3, -1.0]])
    seqs = [Sequence([3, 5], [-0.1, -0.3], "stop", (ids, lps)), Sequence([7], [-2.0], "length")]
    prompt = np.array([np.nan, -1.5, -0.25], dtype=np.float32)
    got = deserialize_sample_response(encode_sample_response(seqs, prompt, (ids[:1], lps[:1])))
    assert [s.tokens for s in got.sequences] == [[3, 5], [7]]
    assert [s.stop_reason for s in got.sequences] == ["stop", "length"]
    np.testing.assert_allclose(got.sequences[0].logprobs, [-0.1, -0.3], rtol=1e-6)
    assert got.sequences[0].topk_logprobs == [[(3, pytest.approx(-0.1)), (4, pytest.approx(-2.0))],
                                              [(5, pytest.approx(-0.3)), (6, pytest.approx(-1.0))]]
    assert got.prompt_logprobs == [None, -1.5, -0.25]
    assert got.topk_prompt_logprobs is not None and got.topk_prompt_logprobs[0][0][0] == 3


def test_provenance_spans_are_checked_then_ignored():
    """tinker-cookbook's RL loop attaches provenance to every datum (any loss): tidal reads past it, after checking
    that each span list tiles its field, as the SDK's `with_provenance` promises."""
    plain = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
                        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "logprobs": [0.0, 0.0, -1.0, -2.0],
                                        "advantages": [0.0, 0.0, 1.0, 1.0]})
    spanned = plain.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="s0", length=3),
                     types.SampledProvenanceSpan(sequence_id="s0", length=1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="s0", offset=1, length=2),
                        types.SampledProvenanceSpan(sequence_id="s0", length=2)])
    got, want = decode_fwdbwd(sdk_body([spanned], "importance_sampling")), decode_fwdbwd(sdk_body([plain]))
    assert got.data[0].tokens == want.data[0].tokens
    for k in want.data[0].inputs:
        np.testing.assert_array_equal(got.data[0].inputs[k], want.data[0].inputs[k])
    msg = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[spanned], loss_fn="importance_sampling"),
        model_id="s:train:0", seq_id=1))
    msg.data[0].loss_fn_input_spans[1].sampled_tokens.length = 3  # now covers 5 of the 4 targets
    with pytest.raises(WireError, match="loss_fn_inputs provenance spans cover 5 positions, the field has 4"):
        decode_fwdbwd(msg.SerializeToString())
    del msg.data[0].loss_fn_input_spans[:]
    with pytest.raises(WireError, match="as a pair"):
        decode_fwdbwd(msg.SerializeToString())
