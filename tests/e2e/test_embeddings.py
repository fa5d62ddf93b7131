"""/v1/embeddings end to end: openai client -> frontend -> gRPC -> real tritonserver -> engine (Task.EMBED),
alone and mixed with generations at concurrency 8 (the generations as they are alone)."""

from __future__ import annotations

import base64
import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

HIDDEN_SIZE = 576  # SmolLM2-135M's
TEXTS = [
    "The capital of France is Paris.",
    "A completely different sentence about the ocean and its fish.",
    "def add(a, b):\n    return a + b\n",
    "hi",
]
GENERATE = [f"Request {i}: tell me about the history of" for i in range(4)]


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=servers.base_url, api_key="unused", max_retries=0, timeout=300)


def cosine(a, b) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embeddings_of_each_input_shape(client, servers):
    r = client.embeddings.create(model=servers.model, input=TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == servers.model and r.id.startswith("embd-")
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    vectors = [np.array(d.embedding) for d in r.data]
    assert all(v.shape == (HIDDEN_SIZE,) and math.isclose(np.linalg.norm(v), 1.0, rel_tol=1e-5) for v in vectors)
    assert cosine(vectors[0], vectors[1]) < 0.999  # different texts, different vectors
    assert r.usage.prompt_tokens == r.usage.total_tokens > len(TEXTS)
    one = client.embeddings.create(model=servers.model, input=TEXTS[0], encoding_format="float")
    assert cosine(one.data[0].embedding, vectors[0]) > 0.99999
    tokenized = httpx.post(f"{servers.frontend.url}/tokenize", json={"model": servers.model, "prompt": TEXTS[0]})
    ids = tokenized.json()["tokens"]
    by_ids = client.embeddings.create(model=servers.model, input=[ids, ids[:3]], encoding_format="float")
    assert cosine(by_ids.data[0].embedding, vectors[0]) > 0.99999
    assert by_ids.usage.prompt_tokens == len(ids) + 3
    # base64: the little-endian float32 bytes (the openai client asks for it and decodes it by default)
    packed = client.embeddings.create(model=servers.model, input=TEXTS[0], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(packed.data[0].embedding), dtype="<f4")
    assert np.array_equal(decoded, np.asarray(one.data[0].embedding, dtype=np.float32))
    default = client.embeddings.create(model=servers.model, input=TEXTS[0])
    assert np.array_equal(np.asarray(default.data[0].embedding, dtype=np.float32), decoded)
    same_size = client.embeddings.create(model=servers.model, input="x", dimensions=HIDDEN_SIZE, user="u1")
    assert len(same_size.data[0].embedding) == HIDDEN_SIZE


def test_refusals_are_openai_errors(client, servers):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=servers.model, input="x", dimensions=256)
    assert e.value.body["param"] == "dimensions" and "matryoshka" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=servers.model, input=[[1, 2, 10**6]])
    assert e.value.body["param"] == "input" and "vocabulary" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=servers.model, input="word " * 9000)
    assert e.value.body["param"] == "input" and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")


@pytest.mark.slow
def test_embeddings_mixed_with_generations_at_concurrency_8(client, servers):
    def generate(prompt: str) -> tuple[str, str]:
        c = client.completions.create(model=servers.model, prompt=prompt, max_tokens=24, temperature=0)
        return c.choices[0].text, c.choices[0].finish_reason

    def embed(text: str) -> list[float]:
        return client.embeddings.create(model=servers.model, input=text, encoding_format="float").data[0].embedding

    alone_texts = [generate(p) for p in GENERATE]
    alone_vectors = [embed(t) for t in TEXTS]
    jobs = [(generate, p) for p in GENERATE] + [(embed, t) for t in TEXTS]
    jobs = [jobs[i // 2 + (len(jobs) // 2) * (i % 2)] for i in range(len(jobs))]  # interleaved
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: job[0](job[1]), jobs * 2))
    texts = [r for r in results if isinstance(r, tuple)]
    vectors = [r for r in results if not isinstance(r, tuple)]
    order = [p for f, p in jobs * 2 if f is generate]
    assert texts == [alone_texts[GENERATE.index(p)] for p in order]
    order = [t for f, t in jobs * 2 if f is embed]
    for v, t in zip(vectors, order):
        assert cosine(v, alone_vectors[TEXTS.index(t)]) > 0.99999
