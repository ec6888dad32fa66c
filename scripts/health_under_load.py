"""The longest /health answer while maximum-size (just under 32 MiB) requests of each shape are rejected:
usage `python scripts/health_under_load.py http://127.0.0.1:8000` against a running server."""
import json, sys, threading, time, httpx
url = sys.argv[1]
L = 32 * 2**20 - 64
def probe(name, path, make, n):
    while len(body := json.dumps(make(n)).encode()) > L:
        n = int(n * L / len(body) * 0.999)
    res = {}
    def send():
        res["r"] = httpx.post(url + path, content=body, timeout=300, headers={"content-type": "application/json"})
    t = threading.Thread(target=send); t.start()
    lat = []
    while t.is_alive():
        s = time.perf_counter(); httpx.get(url + "/health", timeout=30); lat.append(time.perf_counter() - s)
        time.sleep(0.005)
    t.join()
    print(f"{name:28s} {len(body)/2**20:5.1f} MiB -> {res['r'].status_code}  /health max {max(lat)*1000:6.1f} ms "
          f"over {len(lat)} probes  {res['r'].json()['error']['message'][:70]!r}")
C, CH = "/v1/completions", "/v1/chat/completions"
probe("prompt string", C, lambda n: {"prompt": "hello world " * n}, L // 12)
probe("chat content string", CH, lambda n: {"messages": [{"role": "user", "content": "hello world " * n}]}, L // 12)
probe("empty messages", CH, lambda n: {"messages": [{"role": "user", "content": ""}] * n}, L // 34)
probe("4096 messages", CH, lambda n: {"messages": [{"role": "user", "content": "x" * n}] * 4096}, L // 4200)
probe("text parts", CH, lambda n: {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * n}]}, L // 30)
probe("token ids", C, lambda n: {"prompt": [1] * n}, L // 3)
probe("token id lists", C, lambda n: {"prompt": [[1]] * n}, L // 5)
probe("string list", C, lambda n: {"prompt": [""] * n}, L // 4)
probe("logit_bias keys", C, lambda n: {"prompt": "x", "logit_bias": {str(i): 1 for i in range(n)}}, L // 14)
probe("stop list", C, lambda n: {"prompt": "x", "stop": [""] * n}, L // 4)
