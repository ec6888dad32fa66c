"""nanoserve on Ray Serve (`nanoserve.ray`, the optional `ray` extra): two replicas on a local Ray
instance faking two nodes (`ray.cluster_utils.Cluster`), driven by the official `openai` client and raw
HTTP through the OpenAI ingress: prefix affinity, streaming, and a killed replica replaced by Ray."""
import time

import httpx
import openai
import pytest

from server_process import free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.server

SYSTEMS = ["You are a careful assistant for a travel agency. Answer briefly and name the country first. " * 3,
           "You are a chemistry tutor. Explain each step, use simple words, and check the units twice. " * 3]


@pytest.fixture(scope="module")
def ray_url():
    from ray.cluster_utils import Cluster

    from nanoserve.ray import build_app

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)  # a second "machine": one replica on each
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"num_replicas": 2, "max_model_len": 512, "kv_cache_memory": 1 << 28}),
              name="nanoserve", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def test_the_openai_client_through_the_ingress(ray_url):
    client = openai.OpenAI(base_url=f"{ray_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in out.choices[0].text and out.usage.completion_tokens == 8
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and streamed
    bad = httpx.post(f"{ray_url}/v1/completions", json={"prompt": "x", "temperature": 9})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"


def test_repeated_prefixes_stay_on_their_replica(ray_url):
    seen: dict[int, set] = {0: set(), 1: set()}
    per_replica: dict[str, list[int]] = {}  # replica -> [prompt tokens, cached tokens]
    for turn in range(3):
        for k, system in enumerate(SYSTEMS):
            r = httpx.post(f"{ray_url}/v1/completions", timeout=60,
                           json={"prompt": f"{system}\nUser {turn}: hello?", "max_tokens": 4})
            assert r.status_code == 200, r.text
            replica = r.headers["x-nanoserve-replica"]
            seen[k].add(replica)
            usage = r.json()["usage"]
            tokens = per_replica.setdefault(replica, [0, 0])
            tokens[0] += usage["prompt_tokens"]
            tokens[1] += usage["prompt_tokens_details"]["cached_tokens"]
    assert all(len(replicas) == 1 for replicas in seen.values()), seen
    for prompt_tokens, cached in per_replica.values():  # each replica that served found 2 of 3 (or 4 of 6)
        assert cached >= 0.5 * prompt_tokens, per_replica


def test_a_killed_replica_ends_its_stream_with_an_error_and_is_replaced(ray_url):
    body = {"prompt": "Go on forever.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{ray_url}/v1/completions", json=body, timeout=60) as r:
        replica = r.headers["x-nanoserve-replica"]
        lines = r.iter_lines()
        next(lines)
        ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=True)
        rest = "\n".join(lines)
    assert '"error"' in rest and rest.rstrip().endswith("data: [DONE]"), rest[-300:]
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # Ray starts a replacement; meanwhile the other replica serves
        status = serve.status().applications["nanoserve"].deployments["NanoserveReplica"]
        if status.replica_states.get("RUNNING", 0) == 2 and status.status == "HEALTHY":
            break
        time.sleep(1)
    assert status.replica_states.get("RUNNING", 0) == 2, status
    replicas = set()
    for i in range(6):
        r = httpx.post(f"{ray_url}/v1/completions", json={"prompt": f"Say {i}.", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        replicas.add(r.headers["x-nanoserve-replica"])
    assert replica not in replicas
