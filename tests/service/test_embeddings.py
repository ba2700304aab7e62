"""``/v1/embeddings``: the policy's encoder served by name, through the official client (which asks
for base64 by default), with the API's own errors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from tests import lanes
from tests.conftest import SHARED_DATA, Gateway, LlamaServer, start_llama_server

MODEL = "all-minilm-l6-v2"
TEXTS = ["What is the capital of France?", "A cat sat on the mat.", "Résumé: naïve café, 東京"]


def policy(artifacts: Path, precision: str = "int8") -> str:
    return f"""version: 1
classifier:
  data_dir: {SHARED_DATA}
  artifacts: {artifacts}
  heads: [question_type, category, reasoning]
  encoder: {{precision: {precision}}}
backends:
  echo: {{type: scripted, echo: true}}
models:
  echo: {{backend: echo}}
"""


@pytest.fixture
def served(gateway: Callable[..., Gateway], trained_heads: Path) -> Gateway:
    return gateway(policy(trained_heads))


def test_the_official_client_gets_the_encoders_vectors(served: Gateway) -> None:
    from classifiers.encoder import Encoder, EncoderSettings

    out = served.client().embeddings.create(model=MODEL, input=TEXTS)  # base64 on the wire, decoded by the client
    assert out.model == MODEL and [d.index for d in out.data] == [0, 1, 2]
    got = np.array([d.embedding for d in out.data])
    assert got.shape == (3, 384)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    direct = Encoder.load(EncoderSettings(precision="int8")).embed(TEXTS)
    assert np.allclose(got, direct, atol=1e-6)  # the same session, rows apart: the same vectors
    assert out.usage.prompt_tokens == out.usage.total_tokens > 3 * 3
    one = served.client().embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert np.allclose(one.data[0].embedding, got[0], atol=1e-6)
    assert MODEL in [m.id for m in served.client().models.list()]
    assert served.client().models.retrieve(MODEL).id == MODEL


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"model": "nope", "input": "x"}, "model", 404),
        ({"model": "echo", "input": "x"}, "model", 404),  # a chat model serves no embeddings
        ({"model": MODEL, "input": "x", "dimensions": 100}, "dimensions", 400),
        ({"model": MODEL, "input": []}, "input", 400),
        ({"model": MODEL, "input": ""}, "input", 400),
        ({"model": MODEL, "input": [1, 2, 3]}, "input", 400),  # token ids of another tokenizer
        ({"model": MODEL, "input": ["x"] * 2049}, "input", 400),
        ({"model": MODEL, "input": "x", "encoding_format": "int8"}, "encoding_format", 400),
        ({"model": MODEL}, "input", 400),
    ],
)
def test_bad_requests_get_the_apis_error_and_the_server_keeps_serving(
    served: Gateway, body: dict, param: str, status: int
) -> None:
    with served.http() as http:
        r = http.post("/v1/embeddings", json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param
        assert http.post("/v1/embeddings", json={"model": MODEL, "input": "ok"}).status_code == 200


def test_without_a_classifier_there_is_no_embedding_model(gateway: Callable[..., Gateway]) -> None:
    gw = gateway("""version: 1
backends:
  echo: {type: scripted, echo: true}
models:
  echo: {backend: echo}
""")
    with pytest.raises(openai.NotFoundError) as caught:
        gw.client().embeddings.create(model=MODEL, input="x")
    assert "the policy has no classifier" in caught.value.body["message"]  # type: ignore[index]
    assert [m.id for m in gw.client().models.list()] == ["echo"]


@pytest.fixture(scope="module")
@lanes.engine
def embedding_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """A real llama.cpp server in embedding mode (SmolLM2's mean-pooled hidden states)."""
    server = start_llama_server(tmp_path_factory.mktemp("llama-embed"), ["--embedding", "True"])
    yield server
    server.kill()


def test_a_policy_model_gets_its_engines_embeddings(
    gateway: Callable[..., Gateway], embedding_server: LlamaServer
) -> None:
    import httpx

    gw = gateway(f"""version: 1
backends:
  engine: {{type: openai, replicas: [{{api_base: "{embedding_server.api_base}"}}], health: {{enabled: false}}}}
  echo: {{type: scripted, echo: true}}
models:
  smollm2: {{backend: engine, upstream: smollm2}}
  echo: {{backend: echo, fallbacks: [smollm2]}}
""")
    out = gw.client().embeddings.create(model="smollm2", input=["a cat", "a dog"])
    direct = httpx.post(
        embedding_server.api_base + "/embeddings", json={"model": "smollm2", "input": ["a cat", "a dog"]}
    )
    ref = np.array([d["embedding"] for d in direct.json()["data"]])
    got = np.array([d.embedding for d in out.data])
    assert out.model == "smollm2" and got.shape == ref.shape and np.allclose(got, ref, atol=1e-5)
    # a chat model without an embeddings API falls down its chain to one that has it
    assert gw.client().embeddings.create(model="echo", input="a cat").model == "smollm2"


def test_a_keys_models_list_holds_on_proxied_embeddings(
    gateway: Callable[..., Gateway], embedding_server: LlamaServer
) -> None:
    import hashlib

    import openai

    digest = hashlib.sha256(b"sk-chat-only").hexdigest()
    gw = gateway(f"""version: 1
backends:
  engine: {{type: openai, replicas: [{{api_base: "{embedding_server.api_base}"}}], health: {{enabled: false}}}}
  script: {{type: scripted}}
models:
  smollm2: {{backend: engine, upstream: smollm2}}
  scripted: {{backend: script}}
keys:
  - {{name: chat-only, sha256: '{digest}', models: [scripted]}}
""")
    with pytest.raises(openai.PermissionDeniedError) as info:
        gw.client("sk-chat-only").embeddings.create(model="smollm2", input="a cat")
    assert info.value.body["code"] == "model_not_allowed"  # type: ignore[index]
