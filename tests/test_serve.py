"""The HTTP translation server (export/serve.py): answers, batching, limits, hostile input, shutdown.

Loopback only. Most tests share one in-process server on a tiny exported
model; the limits that need a slow search use a gated stand-in engine; the
shutdown tests run `python -m export.serve`'s `main` in a process where
importing a training framework fails.
"""

import concurrent.futures
import itertools
import json
import logging
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import keras
import pytest

from conftest import TINY_CORPUS

pytestmark = [
    pytest.mark.tensorflow_only,
    pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="the ONNX export runs on the TensorFlow backend"),
]

pytest.importorskip("onnxruntime")
pytest.importorskip("tf2onnx")
pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from export import serve  # noqa: E402
from export.runtime import OnnxTranslator  # noqa: E402

REPO = pathlib.Path(serve.__file__).resolve().parents[2]  # export/serve/__init__.py
MAX_EXTRA_LENGTH = 5  # short outputs keep every search fast
CORPUS = TINY_CORPUS


# --------------------------------------------------------------------------- #
# The exported model (once per machine and code version) and servers
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="session")
def preset_dir(tiny_preset_dir):
    return tiny_preset_dir


@pytest.fixture(scope="session")
def exported(tiny_onnx_export):
    """The suite's tiny random model exported by `export.onnx` (conftest.py: built once per machine and code)."""
    return tiny_onnx_export


@pytest.fixture(scope="module")
def reference(exported):
    """What the server must answer: `OnnxTranslator.translate` with the server's search settings."""
    translator = OnnxTranslator(exported, providers=["CPUExecutionProvider"])

    def translate(texts, beam_size=4):
        return translator.translate(texts, beam_size=beam_size, max_extra_length=MAX_EXTRA_LENGTH)

    return translate


class InProcessServer:
    """`create_app` run by uvicorn in a thread, on a free loopback port."""

    def __init__(self, engine, wrap=None, **settings):
        self.sock = serve.bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.app = serve.create_app(engine, serve.ServerSettings(**settings))
        self.service = self.app.state.service
        # `wrap`: None, or ASGI middleware put around the app (a test's stand-in for a client's behaviour).
        config = uvicorn.Config(wrap(self.app) if wrap else self.app, lifespan="on", log_config=None, access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_ready(self.url)

    def metric(self, name, **labels):
        return metric(httpx.get(self.url + "/metrics").text, name, **labels)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


def wait_ready(url, timeout=60, process=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{url} was not ready within {timeout} s")


def metric(text, name, **labels):
    """A sample's value in Prometheus text (0 when absent)."""
    wanted = "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""
    for line in text.splitlines():
        if line.startswith(name + wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def server(exported):
    running = InProcessServer(
        serve.load_engine(exported), max_extra_length=MAX_EXTRA_LENGTH, max_delay_ms=20, request_timeout=3,
    )
    yield running
    running.close()


def post(url, payload=None, content=None, timeout=30, **kwargs):
    if content is None:
        content = json.dumps(payload)
    return httpx.post(url + "/v1/translate", content=content, timeout=timeout, **kwargs)


def sentences():
    from keras_transformer.datasets import load_bundled

    english, _ = load_bundled("test")
    return [text for text in english if len(text) < 40][:24]


# --------------------------------------------------------------------------- #
# Answers and batching
# --------------------------------------------------------------------------- #
def test_answers_equal_the_onnx_translator(server, reference):
    texts = ["the cat sees a dog.", "", "my bird eats the big fish.", "  ", "a red ball."]
    for beam_size in (1, 3):
        response = post(server.url, {"text": texts, "beam_size": beam_size})
        assert response.status_code == 200, response.text
        assert response.json() == {"translations": reference(texts, beam_size=beam_size)}
    # The default beam size (4), a single string, no texts.
    assert post(server.url, {"text": texts}).json()["translations"] == reference(texts)
    assert post(server.url, {"text": "a dog."}).json()["translations"] == reference(["a dog."])
    assert post(server.url, {"text": []}).json() == {"translations": []}


def test_hypotheses_prefixes_and_samples_equal_the_onnx_translator(server, exported):
    """The translation API's options over HTTP: the answers of `OnnxTranslator` with the same options."""
    translator = OnnxTranslator(exported, providers=["CPUExecutionProvider"])
    search = dict(max_extra_length=MAX_EXTRA_LENGTH)
    texts = ["the cat sees a dog.", "", "my bird eats the big fish.", "a red ball."]
    said = [t for t in texts if t]

    def as_json(found):
        return [{"text": h.text, "score": pytest.approx(h.score, abs=1e-5), "log_prob": pytest.approx(h.log_prob, abs=1e-5)}
                for h in found]

    answer = post(server.url, {"text": texts, "num_hypotheses": 3}).json()
    expected = translator.translate_hypotheses(said, beam_size=4, num_hypotheses=3, **search)
    assert answer["hypotheses"] == [as_json(expected[0]), [], as_json(expected[1]), as_json(expected[2])]
    assert answer["translations"] == translator.translate(texts, beam_size=4, **search)

    prefixes = ["a dog", None, None, "the"]
    answer = post(server.url, {"text": texts, "target_prefix": prefixes, "beam_size": 2}).json()
    assert answer == {"translations": translator.translate(texts, beam_size=2, target_prefix=prefixes, **search)}

    sampled = dict(sampling_topk=0, sampling_temperature=0.8, seed=7)
    answer = post(server.url, {"text": texts, "num_hypotheses": 2, **sampled}).json()
    expected = translator.translate_hypotheses(said, beam_size=1, num_hypotheses=2, **sampled, **search)
    assert answer["hypotheses"] == [as_json(expected[0]), [], as_json(expected[1]), as_json(expected[2])]
    answer = post(server.url, {"text": texts[0], **sampled}).json()  # beam_size 1 by default when sampling
    assert answer == {"translations": translator.translate([texts[0]], beam_size=1, **sampled, **search)}


def _alignment_pairs(hypothesis):
    """What the server answers for a hypothesis' `word_alignment`: one source-span/target-span pair per link."""
    return [{"source": list(source), "target": list(word.target)}
            for word in hypothesis.word_alignment for source in word.source]


def test_alignments_equal_the_onnx_translators_and_bad_combinations_are_one_line_400s(server, exported, monkeypatch):
    """`"return_alignment": true`: each translation's (and each hypothesis') word alignment is
    `OnnxTranslator.translate_hypotheses(return_alignment=True)`'s, as character spans; greedy, beams, n-best and
    samples. With stream or split_sentences, as a non-bool, or where the engine cannot align: a one-line 400."""
    translator = OnnxTranslator(exported, providers=["CPUExecutionProvider"])
    search = dict(max_extra_length=MAX_EXTRA_LENGTH, return_alignment=True)
    texts = ["the cat sees a dog.", "", "my bird eats the big fish.", "a red ball."]
    said = [t for t in texts if t]

    for asked, keywords in (({}, dict(beam_size=4)), ({"beam_size": 1}, dict(beam_size=1)),
                            ({"sampling_topk": 0, "seed": 3}, dict(beam_size=1, sampling_topk=0, seed=3))):
        answer = post(server.url, {"text": texts, "return_alignment": True, **asked}).json()
        best = [found[0] for found in translator.translate_hypotheses(said, **keywords, **search)]
        assert answer == {"translations": [best[0].text, "", best[1].text, best[2].text],
                          "alignments": [_alignment_pairs(best[0]), [], *map(_alignment_pairs, best[1:])]}, asked
        assert any(answer["alignments"])
        for text, translation, links in zip(texts, answer["translations"], answer["alignments"]):
            for link in links:  # spans of the text and of its translation
                assert 0 <= link["source"][0] <= link["source"][1] <= len(text)
                assert 0 <= link["target"][0] <= link["target"][1] <= len(translation)
    answer = post(server.url, {"text": texts, "return_alignment": True}).json()
    assert answer["translations"] == translator.translate(texts, beam_size=4, max_extra_length=MAX_EXTRA_LENGTH)

    answer = post(server.url, {"text": texts, "return_alignment": True, "num_hypotheses": 2, "beam_size": 2}).json()
    expected = translator.translate_hypotheses(said, beam_size=2, num_hypotheses=2, **search)
    alignments = [[_alignment_pairs(h) for h in found] for found in expected]
    assert [[h["alignment"] for h in found] for found in answer["hypotheses"]] == [alignments[0], [], *alignments[1:]]
    assert answer["alignments"] == [alignments[0][0], [], *(found[0] for found in alignments[1:])]

    for payload, message in (
        ({"stream": True}, "return_alignment cannot be used with stream"),
        ({"split_sentences": True}, "return_alignment cannot be used with split_sentences"),
        ({"format": "html"}, 'return_alignment cannot be used with "format": "html"'),
    ):
        response = post(server.url, {"text": texts, "return_alignment": True, **payload})
        assert response.status_code == 400 and response.json() == {"error": message}
    response = post(server.url, {"text": texts, "return_alignment": "yes"})
    assert response.status_code == 400
    assert response.json() == {"error": "return_alignment must be true or false, received 'yes'"}

    def refuse():
        raise ValueError("return_alignment on ONNX Runtime builds the step's attention output with the onnx package: "
                         "pip install onnx")

    monkeypatch.setattr(server.service.engine, "check_alignment", refuse)
    response = post(server.url, {"text": texts, "return_alignment": True})
    assert response.status_code == 400 and "pip install onnx" in response.json()["error"]
    assert "\n" not in response.json()["error"]

def test_requests_with_and_without_prefixes_or_samples_batch_and_get_their_own_answers(server, exported, monkeypatch):
    """While a search runs, prefixed and plain requests of one beam size wait and share a batch; sampled texts get
    the samples of their seed whatever they are batched with."""
    translator = OnnxTranslator(exported, providers=["CPUExecutionProvider"])
    texts = sentences()
    requests = [{"text": texts[i: i + 2], "beam_size": 2} for i in range(0, 8, 2)]
    requests[1]["target_prefix"] = ["Der", None]
    requests[3]["target_prefix"] = [None, "ein"]
    requests += [{"text": texts[i: i + 3], "sampling_topk": 4, "seed": 11} for i in (8, 9)]  # overlapping texts
    recording = Recording(server.service.batcher.engine)
    monkeypatch.setattr(server.service.batcher, "engine", recording)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        first = pool.submit(post, server.url, {"text": [texts[20]], "beam_size": 1})
        while not recording.batches:
            time.sleep(0.01)
        others = [pool.submit(post, server.url, payload) for payload in requests]
        queued = sum(len(payload["text"]) for payload in requests)
        deadline = time.monotonic() + 30
        while server.service.batcher.queued < queued and time.monotonic() < deadline:
            time.sleep(0.01)
        recording.release.set()
        assert first.result().status_code == 200
        responses = [future.result() for future in others]
    for payload, response in zip(requests, responses):
        assert response.status_code == 200, response.text
        options = {key: value for key, value in payload.items() if key != "text"}
        options.setdefault("beam_size", 1)
        expected = translator.translate(payload["text"], max_extra_length=MAX_EXTRA_LENGTH, **options)
        assert response.json() == {"translations": expected}, payload
    # The searches after the first: the sentences of each kind, and one that joins prefixed and plain rows, one
    # that joins the two sampled requests (batches form by length too: `max_padding`).
    prefixed = {text for payload in requests[:4] if "target_prefix" in payload for text in payload["text"]}
    beam_batches = [batch for beam, batch in recording.batches[1:] if beam == 2]
    assert sorted(t for batch in beam_batches for t in batch) == sorted(texts[:8]), recording.batches
    assert any(prefixed & set(batch) and set(batch) - prefixed for batch in beam_batches), recording.batches
    sampled_batches = [batch for beam, batch in recording.batches[1:] if beam == 1]
    assert sorted(t for batch in sampled_batches for t in batch) == sorted(texts[8:11] + texts[9:12])
    assert max(len(batch) for batch in sampled_batches) > 3, recording.batches


class Recording:
    """An engine that records each batch and holds the first one until `release` is set."""

    def __init__(self, engine):
        self.engine, self.batches, self.release = engine, [], threading.Event()

    def count_tokens(self, texts):
        return self.engine.count_tokens(texts)

    def translate(self, texts, options, **prefix):
        self.batches.append((options.beam_size, list(texts)))
        if len(self.batches) == 1:
            assert self.release.wait(30)
        return self.engine.translate(texts, options, **prefix)


def test_concurrent_requests_with_mixed_options_are_batched_by_options(server, reference, monkeypatch):
    """16 requests, 4 beam sizes: while the first search runs, the rest wait and form one batch per beam size."""
    texts = sentences()
    requests = [{"text": texts[i % 8: i % 8 + 1 + i % 3], "beam_size": 1 + i % 4} for i in range(16)]
    recording = Recording(server.service.batcher.engine)
    monkeypatch.setattr(server.service.batcher, "engine", recording)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        first = pool.submit(post, server.url, requests[0])
        while not recording.batches:
            time.sleep(0.01)
        others = [pool.submit(post, server.url, payload) for payload in requests[1:]]
        queued = sum(len(payload["text"]) for payload in requests[1:])
        deadline = time.monotonic() + 30
        while server.service.batcher.queued < queued and time.monotonic() < deadline:
            time.sleep(0.01)
        recording.release.set()
        responses = [first.result()] + [future.result() for future in others]
    for payload, response in zip(requests, responses):
        assert response.status_code == 200, response.text
        assert response.json()["translations"] == reference(payload["text"], beam_size=payload["beam_size"])
    # After the first: batches of one beam size each, together the sentences of that beam size, and
    # batches that join requests (each has at most 3 sentences).
    for beam_size in (1, 2, 3, 4):
        batched = [t for beam, batch in recording.batches[1:] if beam == beam_size for t in batch]
        assert sorted(batched) == sorted(t for p in requests[1:] if p["beam_size"] == beam_size for t in p["text"])
    assert max(len(batch) for _, batch in recording.batches[1:]) > 3


def test_a_server_with_a_patience_searches_with_it(exported, monkeypatch):
    """`--patience`: every search of the server (warm-up included) stops rows as `translate(options=...)`'s
    `patience`: the engine hands the request's `SearchOptions` to the translator as it is."""
    engine = serve.load_engine(exported)
    calls, translate = [], engine.translator.translate
    monkeypatch.setattr(engine.translator, "translate", lambda texts, **search: calls.append(search) or translate(
        texts, **search))
    server = InProcessServer(engine, patience=0.5, max_extra_length=MAX_EXTRA_LENGTH)
    try:
        response = post(server.url, {"text": sentences()[:3]})
    finally:
        server.close()
    assert response.status_code == 200, response.text
    assert calls and all(search["options"].patience == 0.5 for search in calls)
    translator = OnnxTranslator(exported, providers=["CPUExecutionProvider"])
    assert response.json()["translations"] == translator.translate(
        sentences()[:3], max_extra_length=MAX_EXTRA_LENGTH, patience=0.5
    )


def test_a_batch_holds_at_most_max_batch_tokens(exported, reference):
    engine = serve.load_engine(exported)
    running = InProcessServer(engine, max_extra_length=MAX_EXTRA_LENGTH, max_batch_tokens=40, max_delay_ms=50)
    try:
        texts = CORPUS[:12]
        recording = Recording(engine)
        recording.release.set()
        running.service.batcher.engine = recording
        response = post(running.url, {"text": texts, "beam_size": 2})
        assert response.json()["translations"] == reference(texts, beam_size=2)
        tokens = engine.count_tokens(texts)
        length = {text: n for text, n in zip(texts, tokens)}
        assert len(recording.batches) > 1
        for _, batch in recording.batches:
            assert len(batch) * max(length[t] for t in batch) <= 40
        assert sorted(t for _, batch in recording.batches for t in batch) == sorted(texts)
        for _, batch in recording.batches:  # each in arrival order
            assert batch == sorted(batch, key=texts.index)
        # A sentence longer than the limit is searched alone.
        long = "the old fish likes the big fish. " * 6
        assert post(running.url, {"text": [long], "beam_size": 2}).json()["translations"] == reference([long], 2)
        assert engine.count_tokens([long])[0] > 40 and recording.batches[-1] == (2, [long])
    finally:
        running.close()


def test_health_ready_and_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "alive"}
    assert httpx.get(server.url + "/ready").json() == {"ready": True, "engine": "onnxruntime"}
    before = httpx.get(server.url + "/metrics")
    assert before.headers["content-type"].startswith("text/plain; version=0.0.4")
    sentences_before = metric(before.text, "kt_serve_sentences_total")
    ok_before = metric(before.text, "kt_serve_requests_total", code=200, path="/v1/translate")
    assert post(server.url, {"text": ["a dog.", "the cat."]}).status_code == 200
    assert post(server.url, {"text": ["a dog."], "beam_size": 0}).status_code == 400
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "kt_serve_sentences_total") == sentences_before + 2
    assert metric(text, "kt_serve_requests_total", code=200, path="/v1/translate") == ok_before + 1
    assert metric(text, "kt_serve_errors_total", reason="bad_request") >= 1
    for name in ("kt_serve_queue_sentences", "kt_serve_requests_in_flight", "kt_serve_ready",
                 "kt_serve_batch_sentences_count", "kt_serve_request_duration_seconds_count",
                 'kt_serve_batch_sentences_bucket{le="+Inf"}', "kt_serve_search_duration_seconds_sum"):
        assert re.search(rf"^{re.escape(name)} \d", text, re.M), name
    assert metric(text, "kt_serve_ready") == 1
    # Every sample line parses as `name{labels} number`, and every metric has HELP and TYPE.
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all(re.fullmatch(r'[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [0-9.e+-]+', s) for s in samples)
    assert text.count("# TYPE") == text.count("# HELP") == 14


# --------------------------------------------------------------------------- #
# Hostile input
# --------------------------------------------------------------------------- #
TEN_MEGABYTES = b'{"text": ["' + b"a" * (10 << 20) + b'"]}'
HOSTILE = {
    "invalid JSON": (b'{"text": ["a dog.",', 400, r"the body is not valid JSON"),
    "not an object": (b'["a dog."]', 400, r"must be a JSON object .* received an array"),
    "missing text": (b'{"beam_size": 2}', 400, r"missing field 'text'"),
    "unknown field": (b'{"text": ["a"], "beamsize": 2}', 400, r"unknown field 'beamsize'; this server takes text, beam_size"),
    "text of a wrong type": (b'{"text": {"a": 1}}', 400, r"text must be a string or an array of strings, received an object"),
    "an item of a wrong type": (b'{"text": ["a", 3]}', 400, r"text\[1\] must be a string, received a number"),
    "beam_size a string": (b'{"text": ["a"], "beam_size": "4"}', 400, r"beam_size must be an integer in \[1, 8\].*received a string"),
    "beam_size a float": (b'{"text": ["a"], "beam_size": 2.5}', 400, r"beam_size must be .* received 2.5"),
    "beam_size a boolean": (b'{"text": ["a"], "beam_size": true}', 400, r"beam_size must be .* received a boolean"),
    "negative beam_size": (b'{"text": ["a"], "beam_size": -1}', 400, r"beam_size must be an integer in \[1, 8\] \(--max-beam-size; 1 is greedy\), received -1"),
    "huge beam_size": (b'{"text": ["a"], "beam_size": 1000000}', 400, r"beam_size must be .* received 1000000"),
    "beam_size with 5000 digits": (b'{"text": ["a"], "beam_size": 1' + b"0" * 5000 + b"}", 400, r"not valid JSON"),
    "NaN": (b'{"text": ["a"], "beam_size": NaN}', 400, r"not valid JSON: NaN is not JSON"),
    "deep nesting": (b"[" * 100_000, 400, r"not valid JSON"),
    "more hypotheses than beams": (b'{"text": ["a"], "beam_size": 2, "num_hypotheses": 3}', 400,
                                   r"num_hypotheses=3 must be <= beam_size=2"),
    "more samples than the limit": (b'{"text": ["a"], "sampling_topk": 0, "num_hypotheses": 9}', 400,
                                    r"num_hypotheses must be at most 8 \(--max-beam-size\), received 9"),
    "num_hypotheses a boolean": (b'{"text": ["a"], "num_hypotheses": true}', 400, r"num_hypotheses=True must be an integer"),
    "sampling with beams": (b'{"text": ["a"], "sampling_topk": 3, "beam_size": 2}', 400, r"needs beam_size=1, received beam_size=2"),
    "negative sampling_topk": (b'{"text": ["a"], "sampling_topk": -2}', 400, r"sampling_topk=-2 must be an integer >= 0"),
    "sampling_topp out of range": (b'{"text": ["a"], "sampling_topk": 0, "sampling_topp": 1.5}', 400, r"sampling_topp=1.5 must be a number in \(0, 1\]"),
    "a float seed": (b'{"text": ["a"], "sampling_topk": 0, "seed": 1.5}', 400, r"seed=1.5 must be an integer in \[0, 2147483646\]"),
    "target_prefix a string for a list": (b'{"text": ["a"], "target_prefix": "Ein"}', 400,
                                          r"target_prefix must be an array of one string or null per text \(1\), received a string"),
    "target_prefix of another length": (b'{"text": ["a", "b"], "target_prefix": ["Ein"]}', 400, r"per text \(2\), received 1 items"),
    "a target_prefix item of a wrong type": (b'{"text": ["a"], "target_prefix": [3]}', 400, r"target_prefix\[0\] must be a string, received a number"),
    "a target_prefix for an empty text": (b'{"text": [" ", "b"], "target_prefix": ["Ein", null]}', 400,
                                          r"text\[0\] is empty but target_prefix\[0\] is not"),
    "a target_prefix too long for the model": (json.dumps({"text": ["a"], "target_prefix": ["a " * 100]}).encode(), 400,
                                               r"target_prefix\[0\] has \d+ tokens; at most 62 are allowed"),
    "non-UTF-8 bytes": (b'{"text": ["a \xff\xfe dog"]}', 400, r"the body is not UTF-8: .* byte 0xff in position 13"),
    "a lone surrogate": (b'{"text": ["a \\ud800 dog"]}', 400, r"text\[0\] is not valid Unicode \(a lone surrogate\)"),
    "10,000 texts": (json.dumps({"text": ["a dog."] * 10_000}).encode(), 400, r"text has 10000 items; the limit is 64 \(--max-texts\)"),
    "a 100,000-character text": (
        json.dumps({"text": ["ok", "a" * 100_000]}).encode(), 400,
        r"text\[1\] has 100000 characters; the limit is 2000 \(--max-text-chars\)",
    ),
    "stream a string": (b'{"text": ["a"], "stream": "true"}', 400, r"^stream must be true or false, received 'true'$"),
    "stream a number": (b'{"text": ["a"], "stream": 1}', 400, r"^stream must be true or false, received a number$"),
    "a 10 MB body": (TEN_MEGABYTES, 413, r"the body has 10485774 bytes; the limit is 1048576 \(--max-body-bytes\)"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_input_gets_its_status_and_message(server, case):
    content, status, message = HOSTILE[case]
    response = post(server.url, content=content)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert re.search(message, response.json()["error"]), response.json()
    assert post(server.url, {"text": ["a dog."], "beam_size": 1}).status_code == 200


def test_a_chunked_body_over_the_limit_and_unknown_routes(server):
    def chunks():
        for start in range(0, len(TEN_MEGABYTES), 1 << 16):
            yield TEN_MEGABYTES[start: start + (1 << 16)]

    response = post(server.url, content=chunks())
    assert response.status_code == 413
    assert response.json() == {"error": "the body is longer than the limit of 1048576 bytes (--max-body-bytes)"}
    assert httpx.get(server.url + "/v1/translate").json() == {"error": "Method Not Allowed: GET /v1/translate"}
    response = httpx.get(server.url + "/nowhere")
    assert response.status_code == 404 and response.json() == {"error": "Not Found: GET /nowhere"}
    with connect(server.url) as sock:
        sock.sendall(raw_request(server.url, b'{"text": ["a"]}', declared="15x"))
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 400 "), reply


def raw_request(url, body, declared=None):
    """Request bytes for a raw socket: headers (Content-Length `declared` or the body's) and body."""
    host = url.split("//")[1]
    length = len(body) if declared is None else declared
    return (f"POST /v1/translate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode() + body


def connect(url):
    host, port = url.split("//")[1].split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_clients_that_disconnect_or_dribble_do_not_disturb_the_others(server, reference):
    """A client that leaves mid-body, one that leaves while its sentences wait, one that sends slowly."""
    texts = sentences()[:6]
    disconnected = server.metric("kt_serve_errors_total", reason="disconnected")
    # Leaves halfway through its body.
    with connect(server.url) as sock:
        sock.sendall(raw_request(server.url, b'{"text": ["a dog.", "the', declared=200))
    # Leaves right after sending a whole request with many sentences.
    body = json.dumps({"text": texts * 4, "beam_size": 4}).encode()
    with connect(server.url) as sock:
        sock.sendall(raw_request(server.url, body))
    # Sends half its body and then nothing: 408 after the request timeout (3 s), JSON, naming it.
    slow = connect(server.url)
    slow.sendall(raw_request(server.url, b'{"text": ["a', declared=30))
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: post(server.url, {"text": texts[i:i + 2], "beam_size": 2}), range(4)))
    assert time.monotonic() - started < 3
    for i, response in enumerate(answers):
        assert response.json()["translations"] == reference(texts[i:i + 2], beam_size=2)
    reply = b""
    while b"}" not in reply:
        chunk = slow.recv(4096)
        assert chunk, reply
        reply += chunk
    slow.close()
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert b'{"error":"the body did not arrive within 3 s (--request-timeout)"}' in reply
    deadline = time.monotonic() + 10
    while server.metric("kt_serve_errors_total", reason="disconnected") < disconnected + 2:
        assert time.monotonic() < deadline, "the disconnections were not counted"
        time.sleep(0.05)
    assert server.metric("kt_serve_queue_sentences") == 0
    assert post(server.url, {"text": texts[:1]}).json()["translations"] == reference(texts[:1])


# --------------------------------------------------------------------------- #
# Backpressure and timeouts (a stand-in engine whose searches wait for the test)
# --------------------------------------------------------------------------- #
class GatedEngine:
    """Translates to upper case; each search waits until the test opens the gate (open at first)."""

    name = "gated"

    def __init__(self):
        self.gate, self.started, self.batches = threading.Event(), threading.Semaphore(0), []
        self.gate.set()

    def count_tokens(self, texts):
        return [len(text.split()) + 1 for text in texts]

    def translate(self, texts, options):
        self.batches.append(list(texts))
        self.started.release()
        assert self.gate.wait(30)
        return [text.upper() for text in texts]


@pytest.fixture
def gated():
    """`start(**settings)` -> (a gated engine, its server with a queue of 4 sentences)."""
    started = []

    def start(**settings):
        engine = GatedEngine()
        running = InProcessServer(engine, **{"max_queue": 4, "max_texts": 3, "max_delay_ms": 0, **settings})
        started.append((engine, running))
        engine.gate.clear()
        while engine.started.acquire(blocking=False):  # the warm-up's searches
            pass
        return engine, running

    yield start
    for engine, running in started:
        engine.gate.set()
        running.close()


def test_a_full_queue_answers_503_with_retry_after(gated):
    engine, running = gated(request_timeout=30)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        searching = pool.submit(post, running.url, {"text": ["one"]})
        assert engine.started.acquire(timeout=10)  # in the search, out of the queue
        waiting = [pool.submit(post, running.url, {"text": ["two", "three"]}) for _ in range(2)]
        while running.service.batcher.queued < 4:
            time.sleep(0.01)
        full = post(running.url, {"text": ["four"]})
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert full.json() == {"error": "the queue holds 4 of at most 4 sentences (--max-queue); this request has 1"}
        engine.gate.set()
        assert searching.result().json() == {"translations": ["ONE"]}
        assert [w.result().json() for w in waiting] == [{"translations": ["TWO", "THREE"]}] * 2
    assert running.metric("kt_serve_errors_total", reason="queue_full") == 1
    assert post(running.url, {"text": ["five"]}).json() == {"translations": ["FIVE"]}


def test_a_request_without_an_answer_in_time_gets_504_and_leaves_the_queue(gated):
    engine, running = gated(request_timeout=1)
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        searching = pool.submit(post, running.url, {"text": ["one"]})
        assert engine.started.acquire(timeout=10)
        waiting = pool.submit(post, running.url, {"text": ["two", "three"]})
        for response in (searching.result(), waiting.result()):
            assert response.status_code == 504
            assert response.json() == {"error": "no translation within 1 s (--request-timeout)"}
    assert time.monotonic() - started < 5
    assert running.service.batcher.queued == 0  # "two" and "three" were never searched
    engine.gate.set()
    assert post(running.url, {"text": ["four"]}).json() == {"translations": ["FOUR"]}
    assert engine.batches[-2:] == [["one"], ["four"]]


def test_a_batch_grows_from_the_oldest_towards_the_nearest_lengths_within_its_limits():
    """`Batcher._take` on waiting sentences of given token counts (negative: other search options; `pairs`: each
    sentence's language pair)."""
    from export.serve.batching import Batcher, _Item

    def batches(lengths, pairs=None, **settings):
        batcher = Batcher(None, serve.ServerSettings(**settings), None, None)
        for i, n in enumerate(lengths):
            options = serve.SearchOptions(1 if n < 0 else 4, 0.6, 0)
            job = types.SimpleNamespace(options=options, group=(options, None if pairs is None else pairs[i]))
            batcher.pending.append(_Item(job, i, abs(n)))
        taken = []
        while batcher.pending:
            batch, padded = batcher._take(batcher.pending[0].job.group)
            assert padded == len(batch) * max(item.tokens for item in batch)
            taken.append([item.index for item in batch])
        return taken

    # 10 and 12 share a search (2 x 12 steps <= 1.25 x 22), 30 would pad too much.
    assert batches([10, 30, 12]) == [[0, 2], [1]]
    assert batches([10, 30, 12], max_padding=10) == [[0, 1, 2]]
    # Arrival order would give [3, 30, 4] (3 x 30 <= 100, a 4th row no longer fits).
    assert batches([3, 30, 4, 31, 4, 31], max_batch_tokens=100, max_padding=10) == [[0, 2, 4], [1, 3, 5]]
    # Other options never join; a sentence over the budget goes alone.
    assert batches([5, -5, 5, -5]) == [[0, 2], [1, 3]]
    assert batches([300, 5], max_batch_tokens=100, max_padding=10) == [[0], [1]]
    # Nor do other language pairs (a multilingual model's sources and forced target code differ).
    pairs = [("eng_Latn", "deu_Latn"), ("eng_Latn", "fra_Latn"), ("eng_Latn", "deu_Latn"), ("deu_Latn", "fra_Latn")]
    assert batches([5, 5, 5, 5], pairs) == [[0, 2], [1], [3]]


def test_a_model_that_fails_its_warm_up_is_never_ready():
    """The warm-up's error is said by /ready and to every request; `serve` stops with status 1 (on_fatal)."""
    from starlette.testclient import TestClient

    class Broken(GatedEngine):
        def translate(self, texts, options):
            raise RuntimeError("no session")

    fatal = threading.Event()
    failure = "the model failed to translate a warm-up sentence: RuntimeError: no session"
    with TestClient(serve.create_app(Broken(), on_fatal=fatal.set)) as client:
        assert fatal.wait(10)
        response = client.get("/ready")
        assert response.status_code == 503 and response.json() == {"error": failure}
        response = client.post("/v1/translate", json={"text": ["a"]})
        assert response.status_code == 503 and response.json() == {"error": failure + "; retry"}
        assert client.get("/health").status_code == 200


def test_a_multilingual_model_warms_up_with_a_target_language_code():
    """A multilingual Marian tokenizer refuses a text without its `>>xx<<` code: the warm-up sentence has one."""
    from starlette.testclient import TestClient

    class Multilingual(GatedEngine):
        tokenizer = types.SimpleNamespace(language_codes=[">>deu<<", ">>fra<<"])

        def count_tokens(self, texts):
            for i, text in enumerate(texts):
                if not text.startswith(">>"):
                    raise ValueError(f"texts[{i}] does not start with a target-language token")
            return super().count_tokens(texts)

        def translate(self, texts, options):
            self.count_tokens(texts)
            return super().translate(texts, options)

    engine, fatal = Multilingual(), threading.Event()
    with TestClient(serve.create_app(engine, on_fatal=fatal.set)) as client:
        while client.get("/ready").status_code != 200:
            assert not fatal.wait(0.05), client.get("/ready").json()
        assert engine.batches[0] == [">>deu<< " + serve.app.WARM_UP_TEXT]
        assert client.post("/v1/translate", json={"text": [">>fra<< a"]}).json() == {"translations": [">>FRA<< A"]}
        # A text without a code is this request's error (400, the tokenizer's line), not an internal one.
        response = client.post("/v1/translate", json={"text": [">>fra<< a", "b"]})
        assert response.status_code == 400
        assert response.json() == {"error": "texts[1] does not start with a target-language token"}


def test_settings_are_checked_with_their_values():
    with pytest.raises(ValueError, match=r"max_batch_tokens=0 must be an integer >= 1"):
        serve.ServerSettings(max_batch_tokens=0)
    with pytest.raises(ValueError, match=r"max_delay_ms=-1 must be a finite number >= 0"):
        serve.ServerSettings(max_delay_ms=-1)
    with pytest.raises(ValueError, match=r"beam_size=9 must be an integer in \[1, max_beam_size=8\]"):
        serve.ServerSettings(beam_size=9)
    with pytest.raises(ValueError, match=r"max_texts=65 must be at most max_queue=64"):
        serve.ServerSettings(max_texts=65, max_queue=64)
    with pytest.raises(ValueError, match=r"patience=0 must be None \(stop when no live beam can win"):
        serve.ServerSettings(patience=0)
    with pytest.raises(ValueError, match=r"length_penalty=-1 must be a finite number >= 0"):
        serve.ServerSettings(length_penalty=-1)
    with pytest.raises(ValueError, match=r"max_extra_length=True must be an integer >= 0"):
        serve.ServerSettings(max_extra_length=True)
    assert [getattr(serve.ServerSettings(), name) for name in ("beam_size", "length_penalty", "max_extra_length")] \
        == [serve.SearchOptions().beam_size, serve.SearchOptions().length_penalty, serve.SearchOptions().max_extra_length]
    with pytest.raises(ValueError, match=r"engine='marian' must be one of"):
        serve.load_engine("anywhere", "marian")


# --------------------------------------------------------------------------- #
# The command, in a process without any training framework: SIGTERM, kill -9
# --------------------------------------------------------------------------- #
LEAN_SERVER = """
import sys

FRAMEWORKS = {"tensorflow", "keras", "jax", "torch", "keras_hub", "tensorflow_text", "tf2onnx"}

class NoFramework:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FRAMEWORKS:
            print("BLOCKED IMPORT " + name, file=sys.stderr, flush=True)
            raise ImportError(name + " must not be imported by the server")

sys.meta_path.insert(0, NoFramework())
from export import serve

status = serve.main(sys.argv[1:])
print("EXIT " + str(status), file=sys.stderr, flush=True)
sys.exit(status)
"""


class ServerProcess:
    """`export.serve.main` in a subprocess that cannot import a training framework."""

    def __init__(self, tmp_path, exported, *options, port=0):
        script = tmp_path / "lean_server.py"
        script.write_text(LEAN_SERVER)
        self.log_path = tmp_path / f"server-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, str(script), "--model", str(exported), "--port", str(port),
             "--max-extra-length", str(MAX_EXTRA_LENGTH), *options],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=str(tmp_path),
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            deadline = time.monotonic() + 60
            while not (found := re.search(r"on http://127\.0\.0\.1:(\d+) ", self.log_path.read_text())):
                assert self.process.poll() is None and time.monotonic() < deadline, self.text()
                time.sleep(0.05)
            self.port = int(found.group(1))
            self.url = f"http://127.0.0.1:{self.port}"
            wait_ready(self.url, process=self.process)
        except BaseException:
            self.kill()
            raise

    def text(self):
        return self.log_path.read_text()

    def wait(self, timeout):
        try:
            return self.process.wait(timeout)
        finally:
            self.log.close()

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
        self.wait(30)


def test_sigterm_answers_every_accepted_request_and_exits_0_without_any_training_framework(
    tmp_path, exported, reference
):
    """12 requests wait in the queue (a batch may wait 20 s to fill); SIGTERM flushes it and drains."""
    texts = sentences()
    requests = [{"text": texts[i: i + 4], "beam_size": 4} for i in range(0, 24, 2)]
    total = sum(len(payload["text"]) for payload in requests)
    server = ServerProcess(
        tmp_path, exported, "--max-delay-ms", "20000", "--max-batch-tokens", "4096", "--drain-seconds", "30"
    )
    try:
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(post, server.url, payload, timeout=60) for payload in requests]
            deadline = time.monotonic() + 15
            while metric(httpx.get(server.url + "/metrics").text, "kt_serve_queue_sentences") < total:
                assert time.monotonic() < deadline and not any(f.done() for f in futures), "not all queued"
                time.sleep(0.05)
            server.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            time.sleep(0.3)
            with pytest.raises(httpx.ConnectError):  # no new connections while draining
                httpx.get(server.url + "/health", timeout=5)
            responses = [future.result() for future in futures]
        status = server.wait(30)
        drained = time.monotonic() - signalled
    finally:
        server.kill()
    log = server.text()
    assert status == 0, log[-3000:]
    assert drained < 10, f"the drain took {drained:.1f} s: the queue was not flushed at once"
    for payload, response in zip(requests, responses):
        assert response.status_code == 200, response.text
        assert response.json()["translations"] == reference(payload["text"], beam_size=4)
    assert "BLOCKED IMPORT" not in log, log
    assert "Draining" in log and "EXIT 0" in log
    assert len(re.findall(r"method=POST path=/v1/translate status=200 sentences=[24] ms=", log)) == len(requests)


def test_after_kill_9_a_restart_is_ready_and_no_answer_was_partial(tmp_path, exported, reference):
    texts = sentences()
    pool_of_requests = [{"text": texts[i: i + 3], "beam_size": 1 + i % 3} for i in range(6)]
    expected = [reference(p["text"], beam_size=p["beam_size"]) for p in pool_of_requests]
    cache = tmp_path / "optimized"
    server = ServerProcess(tmp_path, exported, "--optimized-cache", str(cache))
    # The warm-up made the sessions, so their optimised graphs are in the cache.
    optimized = {path.name: path.stat().st_mtime_ns for path in cache.glob("*.onnx")}
    assert any(name.startswith("fused_decoder_step-") for name in optimized), sorted(optimized)
    outcomes, stop = [], threading.Event()

    def client(seed):
        with httpx.Client(timeout=30) as session:
            for i in itertools.count(seed):
                if stop.is_set():
                    return
                which = i % len(pool_of_requests)
                try:
                    response = session.post(server.url + "/v1/translate", json=pool_of_requests[which])
                except httpx.TransportError as error:
                    outcomes.append((which, type(error).__name__))
                    if isinstance(error, httpx.ConnectError):
                        return
                else:
                    outcomes.append((which, response))

    try:
        threads = [threading.Thread(target=client, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        server.process.send_signal(signal.SIGKILL)
        assert server.wait(30) == -signal.SIGKILL
        stop.set()
        for thread in threads:
            thread.join(30)
        answered = [(which, o) for which, o in outcomes if not isinstance(o, str)]
        assert answered and len(answered) < len(outcomes)
        for which, response in answered:
            assert response.status_code == 200, response.text
            assert response.json()["translations"] == expected[which]
        assert {o for _, o in outcomes if isinstance(o, str)} <= {"ConnectError", "ReadError", "WriteError", "RemoteProtocolError"}
        restarted = ServerProcess(tmp_path, exported, "--optimized-cache", str(cache), port=server.port)
        try:
            assert post(restarted.url, pool_of_requests[0]).json()["translations"] == expected[0]
            restarted.process.send_signal(signal.SIGTERM)
            assert restarted.wait(30) == 0
        finally:
            restarted.kill()
        # The restart loaded the cached graphs (none optimised and written again).
        assert {path.name: path.stat().st_mtime_ns for path in cache.glob("*.onnx")} == optimized
        assert "BLOCKED IMPORT" not in restarted.text()
    finally:
        stop.set()
        server.kill()


def test_the_command_refuses_a_directory_that_is_not_an_export(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "export.serve", "--model", str(tmp_path / "nothing")],
        capture_output=True, text=True, timeout=120, cwd=str(REPO),
    )
    assert result.returncode == 2
    assert "error: No ONNX model directory at" in result.stderr and "Traceback" not in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "export.serve", "--model", str(tmp_path), "--max-texts", "300"],
        capture_output=True, text=True, timeout=120, cwd=str(REPO),
    )
    assert result.returncode == 2 and "max-texts=300 must be at most max-queue=256" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "export.serve", "--model", str(tmp_path), "--port", "70000"],
        capture_output=True, text=True, timeout=120, cwd=str(REPO),
    )
    assert result.returncode == 2 and "--port: must be a TCP port, 0-65535" in result.stderr
    with pytest.raises(ValueError, match="port must be 0-65535 .0: any free port., got 70000"):
        serve.server.bind(port=70000)  # (socket's OverflowError names no argument)


# --------------------------------------------------------------------------- #
# CTranslate2
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="session")
def exported_ct2(tmp_path_factory, preset_dir):
    pytest.importorskip("ctranslate2")
    from export.ctranslate2 import export_ctranslate2

    return export_ctranslate2(preset_dir, tmp_path_factory.mktemp("ct2") / "model")  # a few seconds


def test_an_engine_given_another_kind_of_directory_says_what_it_is_and_what_to_do(preset_dir, exported, exported_ct2):
    """A preset, an ONNX export, a CTranslate2 model: each engine names the directory's kind and the command."""
    with pytest.raises(ValueError, match="is a Keras preset directory, not an ONNX export; export it first: "
                       f"python -m export.onnx --preset {re.escape(str(preset_dir))} --output ONNX_DIR"):
        serve.load_engine(preset_dir, "onnxruntime")
    with pytest.raises(ValueError, match="is a CTranslate2 model .python -m export.ctranslate2., not an ONNX export; "
                       "serve it with python -m export.serve --engine ctranslate2"):
        serve.load_engine(exported_ct2, "onnxruntime")
    with pytest.raises(FileNotFoundError, match="it is an ONNX export .python -m export.onnx.: serve it with the "
                       "onnxruntime engine"):
        serve.load_engine(exported, "ctranslate2")
    with pytest.raises(FileNotFoundError, match="it is a Keras preset directory: export it first: "
                       f"python -m export.ctranslate2 --preset {re.escape(str(preset_dir))} --output CT2_DIR"):
        serve.load_engine(preset_dir, "ctranslate2")


def test_the_ctranslate2_engine_gives_the_greedy_translations_of_onnx_runtime(exported_ct2, exported, reference):
    """Greedy search, one sentence per request and with prefixes: CTranslate2 gives our tokens (checked at its export
    too); it refuses the fields it does not serve."""
    running = InProcessServer(serve.load_engine(exported_ct2, "ctranslate2"), max_extra_length=MAX_EXTRA_LENGTH)
    try:
        assert httpx.get(running.url + "/ready").json() == {"ready": True, "engine": "ctranslate2"}
        for text in CORPUS[:4] + [""]:
            response = post(running.url, {"text": [text], "beam_size": 1})
            assert response.json()["translations"] == reference([text], beam_size=1)
        # Target prefixes are CTranslate2's own; hypotheses and samples are the ONNX engine's.
        texts, prefixes = CORPUS[:3], ["a dog", None, "the"]
        # One text per request: CTranslate2 takes one maximum length per batch, the longest source's (engines.py).
        translator = OnnxTranslator(exported, providers=["CPUExecutionProvider"])
        for text, prefix in zip(texts, prefixes):
            response = post(running.url, {"text": [text], "target_prefix": [prefix], "beam_size": 1})
            assert response.status_code == 200, response.text
            assert response.json()["translations"] == translator.translate(
                [text], beam_size=1, target_prefix=[prefix], max_extra_length=MAX_EXTRA_LENGTH
            )
        # Word alignments: CTranslate2's return_attention, the export's layer and heads, as the ONNX translator's.
        for text in CORPUS[:3]:
            response = post(running.url, {"text": [text], "beam_size": 1, "return_alignment": True})
            [best] = translator.translate_hypotheses([text], beam_size=1, max_extra_length=MAX_EXTRA_LENGTH,
                                                     return_alignment=True)[0]
            assert response.json() == {"translations": [best.text], "alignments": [_alignment_pairs(best)]}
        for field in ({"num_hypotheses": 1}, {"sampling_topk": 0}):
            response = post(running.url, {"text": ["a dog."], **field})
            assert response.status_code == 400
            assert re.search(rf"{next(iter(field))} is not served by the ctranslate2 engine; the onnxruntime engine "
                             "serves it", response.json()["error"]), response.text
        # Streamed: the batch's sentences when it ends (CTranslate2 does not report rows), the same answer.
        payload = {"text": ["The cat sees a dog. A dog likes my bird!", "", "a red ball."], "beam_size": 1,
                   "split_sentences": True}
        response, events = stream(running.url, payload)
        assert events[-1] == "[DONE]" and rebuilt(events[:-1], 3) == post(running.url, payload).json()
    finally:
        running.close()


# --------------------------------------------------------------------------- #
# The load benchmark's arithmetic (benchmarks/serve_http.py)
# --------------------------------------------------------------------------- #
def test_the_load_benchmark_reads_percentiles_and_batch_sizes():
    import numpy as np

    serve_http = pytest.importorskip("benchmarks.serve_http")
    values = [0.3, 0.1, 0.4, 0.2, 5.0]
    for q in (50, 95, 99):
        assert serve_http.percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert serve_http.percentile([], 50) is None
    metrics = serve.Metrics(queue_depth=lambda: 0, in_flight=lambda: 0, ready=lambda: 1)
    for size in (1, 1, 3):
        metrics.batch_sentences.observe(size)
    before = metrics.render()
    for size in (1, 5, 5, 600):
        metrics.batch_sentences.observe(size)
    after = metrics.render()
    assert serve_http.batch_sizes(before, after) == [
        {"sentences": "1", "batches": 1}, {"sentences": "5-8", "batches": 2}, {"sentences": "513+", "batches": 1},
    ]
    assert serve_http.mean_batch(before, after) == pytest.approx((1 + 5 + 5 + 600) / 4)
    assert serve_http.mean_batch(after, after) is None
    # --paragraphs: consecutive sentences joined, and the sentences the server's splitting makes of each.
    assert serve_http.paragraphs_of(["Open it. Close it!", " Done.", "Next.", "Last."], 2) == (
        ["Open it. Close it! Done.", "Next. Last."], [["Open it.", "Close it!", "Done."], ["Next.", "Last."]]
    )


# --------------------------------------------------------------------------- #
# Documents: "split_sentences"
# --------------------------------------------------------------------------- #
def test_split_sentences_answers_as_the_translator_splits(server, exported):
    documents = ["The cat sees a dog. A dog likes my bird!\n\nThe old fish eats.", "  my bird sees the cat.  ", ""]
    translator = OnnxTranslator(exported, providers=["CPUExecutionProvider"])
    expected = translator.translate(documents, beam_size=4, max_extra_length=MAX_EXTRA_LENGTH, split_sentences=True)
    answer = post(server.url, {"text": documents, "split_sentences": True})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"translations": expected}
    # The texts are rebuilt around the sentences' translations, spacing kept.
    assert expected[0].count("\n\n") == 1 and expected[1].startswith("  ") and expected[2] == ""


def test_split_sentences_sends_the_sentences_to_the_engine_and_joins_them(gated):
    engine, running = gated()
    engine.gate.set()
    answer = post(running.url, {"text": ["Open it. Then close it!", " Done. "], "split_sentences": "en"})
    assert answer.json() == {"translations": ["OPEN IT. THEN CLOSE IT!", " DONE. "]}
    assert engine.batches[-1] == ["Open it.", "Then close it!", "Done."]


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"split_sentences": 1}, "split_sentences must be true, false or a language code such as \"de\", received a number"),
        ({"split_sentences": " "}, "split_sentences must be true, false or a language code such as \"de\", received ' '"),
        ({"split_sentences": True, "target_prefix": ["the"]}, "split_sentences cannot be used with target_prefix"),
        ({"split_sentences": True, "num_hypotheses": 2}, "split_sentences cannot be used with num_hypotheses"),
    ],
)
def test_split_sentences_refusals_are_one_line_400s(server, extra, message):
    answer = post(server.url, {"text": ["The cat sees a dog. A dog eats."], **extra})
    assert answer.status_code == 400 and answer.json() == {"error": message}


# --------------------------------------------------------------------------- #
# As production servers: abandoned rows leave the search, per-request max_extra_length and timeout_ms,
# X-Request-Id, the queue-wait histogram and in-flight gauges
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "search",
    [dict(beam_size=1), dict(beam_size=3, num_hypotheses=2), dict(beam_size=1, sampling_topk=0, seed=3, num_hypotheses=2)],
    ids=["greedy", "beam", "samples"],
)
def test_the_step_driver_takes_cancelled_rows_out_and_keeps_the_other_rows_tokens(exported, search, monkeypatch):
    """`cancelled=`: the texts it marks leave the search before the next step, without hypotheses; the others get
    the tokens and scores of the search without it; a search of only cancelled texts stops."""
    from export import steps

    translator = OnnxTranslator(exported, providers=["CPUExecutionProvider"])
    rows, step = [], steps.FusedDecoder.step
    monkeypatch.setattr(steps.FusedDecoder, "step", lambda decoder, ids, index: rows.append(len(ids)) or step(
        decoder, ids, index))
    texts = ["the cat sees a dog.", "my bird eats the big fish.", "a red ball.", "the old fish likes the big fish."]
    expected = translator.translate_hypotheses(texts, max_extra_length=20, **search)
    everyone = rows[0]
    polls = []

    def cancelled():  # texts 1 and 3 leave after the third step
        polls.append(len(rows))
        return None if len(polls) < 3 else [False, True, False, True]

    rows.clear()
    found = translator.translate_hypotheses(texts, max_extra_length=20, cancelled=cancelled, **search)
    assert found[1] == found[3] == []
    for i in (0, 2):
        assert [h.text for h in found[i]] == [h.text for h in expected[i]]
        assert [h.score for h in found[i]] == pytest.approx([h.score for h in expected[i]], abs=1e-5)
    assert rows[:3] == [everyone] * 3 and len(rows) > 3 and max(rows[3:]) <= everyone // 2, rows
    assert polls[:3] == [1, 2, 3]  # asked after each step
    # One translation per text: a cancelled text's is ""; a search of only cancelled texts stops after one step.
    if search.get("num_hypotheses", 1) == 1:
        plain = translator.translate(texts, max_extra_length=20, **search)
        polls.clear()
        assert translator.translate(texts, max_extra_length=20, cancelled=cancelled, **search) == [
            plain[0], "", plain[2], ""
        ]
    rows.clear()
    assert translator.translate_hypotheses(texts, max_extra_length=20, cancelled=lambda: [True] * 4, **search) == [
        [], [], [], []
    ]
    assert rows == [everyone]
    with pytest.raises(ValueError, match="cancelled cannot be used with split_sentences"):
        translator.translate(texts, split_sentences=True, cancelled=lambda: None)


@pytest.mark.parametrize(
    "search",
    [dict(beam_size=1), dict(beam_size=3), dict(beam_size=3, patience=1), dict(beam_size=3, num_hypotheses=2),
     dict(beam_size=1, sampling_topk=0, seed=3, num_hypotheses=2)],
    ids=["greedy", "beam", "patience", "hypotheses", "samples"],
)
def test_the_step_driver_tells_each_text_as_its_rows_leave(exported, search, monkeypatch):
    """`finished=`: each text once, with its final result, while longer texts are still searched."""
    from export import steps

    translator = OnnxTranslator(exported, providers=["CPUExecutionProvider"])
    rows, step = [], steps.FusedDecoder.step
    monkeypatch.setattr(steps.FusedDecoder, "step", lambda decoder, ids, index: rows.append(len(ids)) or step(
        decoder, ids, index))
    texts = ["a dog.", "", "my bird eats the big fish and the old cat sees a red ball.", "the cat sees a dog."]
    hypotheses = "num_hypotheses" in search
    translate = translator.translate_hypotheses if hypotheses else translator.translate
    if hypotheses:
        texts = [text for text in texts if text]
    told = []
    found = translate(texts, max_extra_length=20, finished=lambda i, result: told.append((i, result, len(rows))),
                      **search)
    assert sorted(i for i, _, _ in told) == list(range(len(texts)))
    assert all(result is found[i] or result == found[i] for i, result, _ in told)
    assert found == translate(texts, max_extra_length=20, **search)
    # The shortest source's row (every row runs to its length limit: a random model) left first, steps before the end.
    first = next(i for i, _, _ in told if texts[i])
    assert texts[first] == "a dog." and told[-1][2] > [steps for i, _, steps in told if i == first][0]


def test_a_searched_row_with_a_score_of_minus_infinity_keeps_its_tokens(exported, monkeypatch):
    """Only rows the driver never wrote are the cancelled ones: a row whose score is -inf (a random int8 model's
    greedy search) keeps its tokens, with or without `cancelled`."""
    import numpy as np

    from export.runtime import OnnxSeq2Seq

    model = OnnxSeq2Seq(exported, providers=["CPUExecutionProvider"])
    ids = np.array([[5, 6, 7, model.end_id], [8, 9, model.end_id, 0]], "int32")
    searched = model.generate(ids, beam_size=1, max_extra_length=5)
    step_search = model._step_search

    def minus_infinity(*args, **kwargs):
        sequences, scores, log_probs = step_search(*args, **kwargs)
        return sequences, np.full_like(scores, -np.inf), log_probs

    monkeypatch.setattr(model, "_step_search", minus_infinity)
    for cancelled in (None, lambda: None):
        np.testing.assert_array_equal(model.generate(ids, beam_size=1, max_extra_length=5, cancelled=cancelled),
                                      searched)


class HeldEngine:
    """The ONNX Runtime engine; while `hold` is set, a search stops after its first step until `release` is set.

    While `hold_row` is set instead, a streamed search stops right after its
    first text left it (`told`: the texts told to `finished`, in order).
    `polls`: what the search's `cancelled` callable answered after each step
    (of the last held search); `rows`: the decoder's rows at each step.
    """

    def __init__(self, engine):
        self.engine, self.hold, self.stepping, self.release = engine, threading.Event(), threading.Event(), threading.Event()
        self.hold_row = threading.Event()
        self.polls, self.rows, self.told = [], [], []

    def __getattr__(self, name):  # name, features, drops_rows, tokenizer, count_tokens, ...
        return getattr(self.engine, name)

    def translate(self, texts, options, target_prefix=None, cancelled=None, finished=None):
        if finished is not None and self.hold_row.is_set():
            self.polls, self.rows, self.told = [], [], []

            def row_held(index, result):
                self.told.append(index)
                finished(index, result)
                if len(self.told) == 1:
                    self.rows.append("held")
                    self.stepping.set()
                    assert self.release.wait(30)

            def polled():
                flags = cancelled()
                self.polls.append(None if flags is None else list(flags))
                return flags

            return self.engine.translate(texts, options, target_prefix, polled, row_held)
        if not self.hold.is_set():
            return self.engine.translate(texts, options, target_prefix, cancelled, finished)
        self.polls, self.rows = [], []

        def held():
            if not self.polls and not self.stepping.is_set():
                self.stepping.set()
                assert self.release.wait(30)
            flags = cancelled()
            self.polls.append(None if flags is None else list(flags))
            return flags

        return self.engine.translate(texts, options, target_prefix, held, finished)


def held_engine(exported, monkeypatch):
    """A `HeldEngine` on the suite's model that counts the decoder's rows of a held search."""
    from export import steps

    engine = HeldEngine(serve.load_engine(exported))
    step = steps.FusedDecoder.step

    def counted(decoder, token_ids, index):
        if engine.hold.is_set() or engine.hold_row.is_set():
            engine.rows.append(len(token_ids))
        return step(decoder, token_ids, index)

    monkeypatch.setattr(steps.FusedDecoder, "step", counted)
    return engine


@pytest.fixture
def held(exported, monkeypatch):
    """`(engine, server)`: a `HeldEngine` served with long outputs; one search holds the decoder's row counts."""
    engine = held_engine(exported, monkeypatch)
    text = "the cat sees a dog."
    tokens = engine.count_tokens([text])[0]
    # A search starts once two such sentences wait (max_batch_tokens), never after a delay.
    running = InProcessServer(
        engine, max_extra_length=40, max_delay_ms=60_000, max_batch_tokens=2 * tokens, request_timeout=30,
    )
    engine.text = text
    yield engine, running
    engine.release.set()
    running.close()


def test_a_client_that_disconnects_mid_search_takes_its_rows_out_of_the_search(held, exported):
    engine, running = held
    text = engine.text
    translator = OnnxTranslator(exported, providers=["CPUExecutionProvider"])
    expected = translator.translate([text], beam_size=1, max_extra_length=40)
    engine.hold.set()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        leaving = connect(running.url)
        leaving.sendall(raw_request(running.url, json.dumps({"text": [text], "beam_size": 1}).encode()))
        staying = pool.submit(post, running.url, {"text": [text], "beam_size": 1})
        assert engine.stepping.wait(30)  # both rows in one search, held after its first step
        text_metrics = httpx.get(running.url + "/metrics").text
        assert metric(text_metrics, "kt_serve_sentences_in_flight") == 2
        assert metric(text_metrics, "kt_serve_requests_searching") == 2
        leaving.close()
        deadline = time.monotonic() + 10
        while running.metric("kt_serve_dropped_sentences_total") < 1:
            assert time.monotonic() < deadline, "the departure was not noticed"
            time.sleep(0.02)
        text_metrics = httpx.get(running.url + "/metrics").text
        assert metric(text_metrics, "kt_serve_sentences_in_flight") == 1
        assert metric(text_metrics, "kt_serve_requests_searching") == 1
        engine.release.set()
        answer = staying.result()
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"translations": expected}  # the row that stayed: the same tokens
    # The departed row left at the next step: 2 rows for one step, then 1 until the end.
    flags = [poll for poll in engine.polls if poll is not None]
    assert flags and all(sorted(poll) == [False, True] for poll in flags), engine.polls
    assert engine.rows[0] == 2 and set(engine.rows[1:]) == {1} and len(engine.rows) > 10, engine.rows
    assert running.metric("kt_serve_dropped_sentences_total") == 1
    assert running.metric("kt_serve_errors_total", reason="disconnected") == 1
    assert running.metric("kt_serve_sentences_in_flight") == 0


def test_a_timeout_ms_too_short_answers_504_frees_the_rows_and_the_next_request_is_served(held, exported, caplog):
    engine, running = held
    texts = [engine.text, engine.text]  # two sentences: the search starts at once
    translator = OnnxTranslator(exported, providers=["CPUExecutionProvider"])
    engine.hold.set()
    with caplog.at_level(logging.INFO, logger="export.serve"):
        answer = post(running.url, {"text": texts, "beam_size": 1, "timeout_ms": 300}, headers={"X-Request-Id": "late-1"})
        assert engine.stepping.wait(30)  # the search that could not end before the 504 (held after its first step)
        assert answer.status_code == 504 and answer.json() == {"error": "no translation within 300 ms (timeout_ms)"}
        assert answer.headers["x-request-id"] == "late-1"
        engine.release.set()
        deadline = time.monotonic() + 10
        assert running.metric("kt_serve_sentences_in_flight") == 0  # its rows were dropped at the 504
        while running.service.batcher.running:  # the held search ends
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # Every row left: the search stopped after the step it was held at.
        assert engine.rows == [2] and engine.polls == [[True, True]], (engine.rows, engine.polls)
        assert running.metric("kt_serve_dropped_sentences_total") == 2
        assert running.metric("kt_serve_errors_total", reason="timeout") == 1
        engine.hold.clear()
        answer = post(running.url, {"text": texts, "beam_size": 1, "timeout_ms": 20_000})
        assert answer.status_code == 200 and answer.json() == {
            "translations": translator.translate(texts, beam_size=1, max_extra_length=40)
        }
    # The lines about the request carry its id: the departure from the search and the request's line.
    lines = [record.getMessage() for record in caplog.records if "late-1" in record.getMessage()]
    assert any(line.startswith("request_id=late-1: 2 sentences leave the running search") for line in lines), lines
    assert any(re.match(r"method=POST path=/v1/translate status=504 sentences=2 ms=[\d.]+ client=\S+ "
                        r"request_id=late-1$", line) for line in lines), lines


def test_a_request_max_extra_length_caps_the_output_and_batches_apart(server, exported, monkeypatch):
    translator = OnnxTranslator(exported, providers=["CPUExecutionProvider"])
    texts = sentences()[:4]
    for length in (0, 2):
        answer = post(server.url, {"text": texts, "beam_size": 2, "max_extra_length": length})
        assert answer.status_code == 200, answer.text
        translations = answer.json()["translations"]
        assert translations == translator.translate(texts, beam_size=2, max_extra_length=length)
        sources = translator.tokenizer.encode(texts, add_start=False, add_end=True)
        outputs = translator.tokenizer.encode(translations, add_start=False, add_end=False)
        assert all(len(out) <= len(src) + length for src, out in zip(sources, outputs))
    # Waiting requests with other lengths form batches of their own, as other options do.
    recording = Recording(server.service.batcher.engine)
    searched = []
    translate = recording.translate
    monkeypatch.setattr(recording, "translate", lambda texts, options, **extra: searched.append(
        (options.max_extra_length, list(texts))) or translate(texts, options, **extra))
    monkeypatch.setattr(server.service.batcher, "engine", recording)
    requests = [{"text": [text], "beam_size": 2, "max_extra_length": 1 + i % 2} for i, text in enumerate(texts)]
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        first = pool.submit(post, server.url, {"text": [sentences()[5]], "beam_size": 1})
        while not recording.batches:
            time.sleep(0.01)
        others = [pool.submit(post, server.url, payload) for payload in requests]
        deadline = time.monotonic() + 30
        while server.service.batcher.queued < len(requests) and time.monotonic() < deadline:
            time.sleep(0.01)
        recording.release.set()
        assert first.result().status_code == 200
        for payload, future in zip(requests, others):
            assert future.result().json()["translations"] == translator.translate(
                payload["text"], beam_size=2, max_extra_length=payload["max_extra_length"]
            )
    by_length = {}
    for length, batch in searched[1:]:
        by_length.setdefault(length, []).extend(batch)
    assert {length: sorted(batch) for length, batch in by_length.items()} == {
        1: sorted([texts[0], texts[2]]), 2: sorted([texts[1], texts[3]])
    }, searched


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"max_extra_length": 6}, "max_extra_length must be an integer in [0, 5] (--max-extra-length), received 6"),
        ({"max_extra_length": -1}, "max_extra_length must be an integer in [0, 5] (--max-extra-length), received -1"),
        ({"max_extra_length": "3"}, "max_extra_length must be an integer in [0, 5] (--max-extra-length), received a "
                                    "string"),
        ({"max_extra_length": 2.5}, "max_extra_length must be an integer in [0, 5] (--max-extra-length), received 2.5"),
        ({"max_extra_length": True}, "max_extra_length must be an integer in [0, 5] (--max-extra-length), received a "
                                     "boolean"),
        ({"timeout_ms": 0}, "timeout_ms must be an integer in [1, 3000] (--request-timeout), received 0"),
        ({"timeout_ms": 3001}, "timeout_ms must be an integer in [1, 3000] (--request-timeout), received 3001"),
        ({"timeout_ms": 10.5}, "timeout_ms must be an integer in [1, 3000] (--request-timeout), received 10.5"),
        ({"timeout_ms": "5"}, "timeout_ms must be an integer in [1, 3000] (--request-timeout), received a string"),
        ({"timeout_ms": [5]}, "timeout_ms must be an integer in [1, 3000] (--request-timeout), received an array"),
    ],
)
def test_max_extra_length_and_timeout_ms_out_of_range_are_one_line_400s(server, extra, message):
    answer = post(server.url, {"text": ["a dog."], **extra})
    assert answer.status_code == 400 and answer.json() == {"error": message}


def test_the_request_id_is_taken_or_made_up_and_in_the_answer_and_the_log(server, caplog):
    with caplog.at_level(logging.INFO, logger="export.serve"):
        given = post(server.url, {"text": ["a dog."]}, headers={"X-Request-Id": "client-42.a"})
        made = post(server.url, {"text": ["a dog."]})
        health = httpx.get(server.url + "/health", headers={"X-Request-Id": "probe-7"})
        deadline = time.monotonic() + 10
        while not sum("request_id=" in record.getMessage() for record in caplog.records) >= 3:
            assert time.monotonic() < deadline, [record.getMessage() for record in caplog.records]
            time.sleep(0.02)
    assert given.status_code == 200 and given.headers["x-request-id"] == "client-42.a"
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    assert health.headers["x-request-id"] == "probe-7"
    lines = [record.getMessage() for record in caplog.records]
    for identifier, path in (("client-42.a", "/v1/translate"), (made.headers["x-request-id"], "/v1/translate"),
                             ("probe-7", "/health")):
        assert any(line.startswith("method=") and f"path={path} status=200 " in line
                   and line.endswith(f" request_id={identifier}") for line in lines), (identifier, lines)
    # An id that cannot go into a log line as it is: a one-line 400 naming the header and the limit.
    for value, why in (("x" * 129, "129 characters"), ("a b", "a space or a character outside ASCII")):
        answer = post(server.url, {"text": ["a dog."]}, headers={"X-Request-Id": value})
        assert answer.status_code == 400 and answer.json() == {
            "error": f"X-Request-Id must be one header of 1 to 128 visible ASCII characters, received {why}"
        }
        assert re.fullmatch(r"[0-9a-f]{32}", answer.headers["x-request-id"])


def test_the_queue_wait_histogram_counts_each_searched_sentence(server):
    before = httpx.get(server.url + "/metrics").text
    assert post(server.url, {"text": ["a dog.", "the cat.", "", "a red ball."]}).status_code == 200
    after = httpx.get(server.url + "/metrics").text
    name = "kt_serve_queue_wait_seconds"
    assert metric(after, name + "_count") - metric(before, name + "_count") == 3  # "" is not searched
    assert metric(after, name + "_bucket", le="+Inf") == metric(after, name + "_count")
    buckets = [float(line.rsplit(" ", 1)[1]) for line in after.splitlines() if line.startswith(name + "_bucket")]
    assert buckets == sorted(buckets) and metric(after, name + "_sum") >= metric(before, name + "_sum")
    for gauge in ("kt_serve_sentences_in_flight", "kt_serve_requests_searching"):
        assert re.search(rf"^{gauge} 0$", after, re.M), gauge  # idle
    assert "# TYPE kt_serve_queue_wait_seconds histogram" in after
    assert "# TYPE kt_serve_dropped_sentences_total counter" in after


def test_language_fields_are_refused_in_one_line_for_a_model_without_language_codes(server):
    """A model of one language pair (the ONNX engine: `Translator.with_languages`' rule; an engine without
    `with_languages`: the app's) answers 400 naming the field."""
    response = post(server.url, {"text": ["the cat sees a dog."], "target_language": "deu_Latn"})
    assert response.status_code == 400
    assert response.json() == {"error": "target_language='deu_Latn': this model translates one language pair and has "
                                        "no language codes; leave source_language and target_language out"}
    with pytest.raises(serve.app.RequestError, match="this model translates one language pair"):
        serve.app.bound_engine(GatedEngine(), ("eng_Latn", None))
    assert serve.app.bound_engine(GatedEngine(), None).name == "gated"


# --------------------------------------------------------------------------- #
# Streaming: "stream": true answers with server-sent events, one per sentence as it leaves the search
# --------------------------------------------------------------------------- #
def stream(url, payload, **kwargs):
    """`(response, events)`: a streamed request's answer and its events (JSON objects; the end as "[DONE]")."""
    with httpx.stream("POST", url + "/v1/translate", json={**payload, "stream": True}, timeout=30, **kwargs) as response:
        body = response.read().decode()
    return response, [event(block) for block in body.split("\n\n") if block] if response.status_code == 200 else body


def event(block):
    assert block.startswith("data: ") and "\n" not in block, block
    data = block[len("data: "):]
    return data if data == "[DONE]" else json.loads(data)


def rebuilt(events, count):
    """The non-streamed answer rebuilt from a stream's sentence events (docs/serving.md: each text's pieces joined)."""
    pieces, hypotheses = [{} for _ in range(count)], [None] * count
    for found in events:
        assert found["sentence"] not in pieces[found["index"]], found
        pieces[found["index"]][found["sentence"]] = found["translation"]
        assert 0 <= found["sentence"] < found["sentences"], found
        if "hypotheses" in found:
            hypotheses[found["index"]] = found["hypotheses"]
    assert all(sorted(text) == list(range(len(text))) for text in pieces), pieces
    answer = {"translations": ["".join(text[k] for k in range(len(text))) for text in pieces]}
    if any(found is not None for found in hypotheses):
        answer["hypotheses"] = hypotheses
    return answer


def test_a_stream_rebuilds_exactly_the_answer(server):
    payloads = [
        {"text": ["the cat sees a dog.", "", "my bird eats the big fish.", "  ", "a red ball."], "beam_size": 1},
        {"text": "a dog."},
        {"text": ["The cat sees a dog. A dog likes my bird!\n\nThe old fish eats.", "  my bird sees the cat.  ", "",
                  " \n "], "split_sentences": True},
        {"text": ["the cat sees a dog.", "", "a red ball."], "num_hypotheses": 2, "beam_size": 3},
        {"text": []},
    ]
    for payload in payloads:
        expected = post(server.url, payload).json()
        response, events = stream(server.url, payload, headers={"X-Request-Id": "stream-1"})
        assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert response.headers["x-request-id"] == "stream-1" and response.headers["cache-control"] == "no-cache"
        assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
        count = 1 if isinstance(payload["text"], str) else len(payload["text"])
        assert rebuilt(events[:-1], count) == expected, events
    # Split texts: one event per sentence, with the whitespace around it; a text without one is one event.
    _, events = stream(server.url, payloads[2])
    assert sorted((e["index"], e["sentence"], e["sentences"]) for e in events[:-1]) == [
        (0, 0, 3), (0, 1, 3), (0, 2, 3), (1, 0, 1), (2, 0, 1), (3, 0, 1)]
    assert [e["translation"] for e in events if e != "[DONE]" and e["index"] == 3] == [" \n "]
    assert server.metric("kt_serve_sentences_in_flight") == 0


def test_an_engine_that_cannot_report_rows_streams_each_batch_when_it_is_done(gated):
    """The stand-in engine has no `finished=` (as CTranslate2): its sentences come when their search ends; a request
    past its deadline before its first event gets the JSON 504."""
    engine, running = gated(request_timeout=30)
    response, body = stream(running.url, {"text": ["one"], "timeout_ms": 200})
    assert response.status_code == 504 and response.headers["content-type"] == "application/json"
    assert json.loads(body) == {"error": "no translation within 200 ms (timeout_ms)"}
    engine.gate.set()
    payload = {"text": ["Open it. Then close it!", " Done. ", ""], "split_sentences": "en"}
    response, events = stream(running.url, payload)
    assert rebuilt(events[:-1], 3) == {"translations": ["OPEN IT. THEN CLOSE IT!", " DONE. ", ""]}
    assert engine.batches[-1] == ["Open it.", "Then close it!", "Done."]


STREAMED = ["a dog.", "my bird eats the big fish and the old cat sees a red ball."]  # the first row leaves first


@pytest.fixture
def row_held(exported, monkeypatch):
    """`(engine, server)`: a `HeldEngine` whose streamed searches stop after their first text left, until released."""
    engine = held_engine(exported, monkeypatch)
    running = InProcessServer(engine, max_extra_length=40, max_delay_ms=0, request_timeout=30, wrap=StalledReader)
    engine.expected = post(running.url, {"text": STREAMED, "beam_size": 1}).json()  # (not held: not streamed)
    engine.hold_row.set()
    yield engine, running
    engine.release.set()
    running.close()


def test_the_first_event_comes_while_the_last_sentence_is_searched(row_held):
    engine, running = row_held
    with httpx.stream("POST", running.url + "/v1/translate", json={"text": STREAMED, "beam_size": 1, "stream": True},
                      timeout=30) as response:
        lines = response.iter_lines()
        first = event(next(lines))
        # The search is held right after the first text left it: the other one is still being searched.
        assert engine.stepping.wait(30) and engine.told == [0] and first["index"] == 0
        assert running.metric("kt_serve_sentences_in_flight") == 1
        engine.release.set()
        rest = [event(line) for line in lines if line]
    assert rest[-1] == "[DONE]" and rebuilt([first] + rest[:-1], 2) == engine.expected
    after = engine.rows[engine.rows.index("held") + 1:]  # the decoder's rows once the first event was out
    assert len(after) > 1 and set(after) == {1}, engine.rows


@pytest.mark.parametrize("leaves", ["disconnects", "times out", "reads nothing"])
def test_a_stream_client_that_leaves_times_out_or_reads_nothing_frees_its_rows(row_held, leaves):
    """After the first event: the client closes the connection; or the request's deadline passes (an error event,
    then the end); or the client reads nothing (its events do not go: the stream ends at the deadline). Its last
    row leaves the search after the step it was held at, and the server answers others meanwhile and after."""
    engine, running = row_held
    payload = {"text": STREAMED, "beam_size": 1, "stream": True, "timeout_ms": 1500}
    headers = {"X-Stall": "1"} if leaves == "reads nothing" else {}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        if leaves == "reads nothing":
            stalled = pool.submit(post, running.url, payload, headers=headers)
            assert engine.stepping.wait(30)
        else:
            with httpx.stream("POST", running.url + "/v1/translate", json=payload, timeout=30) as response:
                lines = response.iter_lines()
                assert event(next(lines))["index"] == 0
                if leaves == "times out":
                    assert [event(line) for line in lines if line] == [
                        {"error": "no translation within 1500 ms (timeout_ms)"}]  # and no [DONE]
        deadline = time.monotonic() + 10
        while running.metric("kt_serve_dropped_sentences_total") < 1:
            assert time.monotonic() < deadline, "the stream's end was not noticed"
            assert httpx.get(running.url + "/health").status_code == 200  # the event loop answers meanwhile
            time.sleep(0.02)
        reason = "disconnected" if leaves == "disconnects" else "timeout"
        assert running.metric("kt_serve_errors_total", reason=reason) == 1
        assert running.metric("kt_serve_sentences_in_flight") == 0
        engine.release.set()
        while running.service.batcher.running:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        if leaves == "reads nothing":
            with pytest.raises(httpx.TransportError):  # headers, then the connection closed
                stalled.result()
    after = engine.rows[engine.rows.index("held") + 1:]
    assert after == [1] and engine.polls[-1] == [True, True], (engine.rows, engine.polls)  # (the request, abandoned)
    assert running.metric("kt_serve_dropped_sentences_total") == 1
    engine.hold_row.clear()
    assert post(running.url, {"text": STREAMED, "beam_size": 1}).json() == engine.expected
    assert running.metric("kt_serve_requests_in_flight") == 1  # (this /metrics request)


class StalledReader:
    """ASGI middleware: for a request with `X-Stall: 1`, the answer's headers go and its body never does (a client
    that reads nothing, once the socket's buffers are full)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        import asyncio

        if scope["type"] != "http" or (b"x-stall", b"1") not in scope.get("headers", ()):
            return await self.app(scope, receive, send)

        async def stalled(message):
            if message["type"] == "http.response.body":
                await asyncio.Event().wait()
            await send(message)

        return await self.app(scope, receive, stalled)
