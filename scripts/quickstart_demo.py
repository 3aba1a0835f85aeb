"""Try every chat feature of a running server: ``python scripts/quickstart_demo.py [--base-url URL]``.

README command 1 runs it against the default server (``python -m dsv41_jax.serve``: nano, the small
trained model bundled in the package), and ``tests/test_quickstart.py`` runs it against a server
started with nothing but ``--model tiny`` (random weights), so the features hold whatever the model
says. Four requests:

1. thinking on (``reasoning_effort``): the reasoning arrives in ``reasoning_content``;
2. ``tool_choice: "required"``: a ``tool_calls`` response whose arguments follow the tool's schema;
3. ``response_format`` json_schema with thinking on: reasoning first, then an answer that parses;
4. ``GET /metrics``: Prometheus text.

nano answers the kinds of prompts it was trained on (small sums, look-ups, copies, get_weather
calls; see README "nano"), so request 1 is one of those. The tiny model has random weights, so its
words are noise: the structure is what constrained decoding and the parsers guarantee. ``thinking_budget`` (an extra field, as SGLang's) closes the
reasoning after a few tokens, since a random model rarely emits ``</think>`` by itself. Standard
library only; exits 1 naming the first feature that did not work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Beijing"]}},
                   "required": ["city"], "additionalProperties": False}}}
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100},
                                           "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}


def _request(base: str, path: str, body: dict | None = None, api_key: str | None = None):
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base.rstrip("/") + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            raw = r.read().decode()
    except urllib.error.HTTPError as e:
        raise SystemExit(f"{path}: HTTP {e.code}: {e.read().decode()[:500]}") from None
    except urllib.error.URLError as e:
        raise SystemExit(f"{path}: cannot reach the server at {base} ({e.reason})") from None
    return raw if body is None else json.loads(raw)


def wait_healthy(base: str, timeout: float) -> None:
    """Poll GET /health until the server answers 200 (it compiles before it listens)."""
    t0 = time.monotonic()
    print(f"waiting for {base}/health (the first start compiles the model) ...", flush=True)
    while True:
        try:
            with urllib.request.urlopen(base.rstrip("/") + "/health", timeout=5) as r:
                if r.status == 200:
                    print(f"healthy after {time.monotonic() - t0:.0f} s", flush=True)
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"the server at {base} was not healthy within {timeout:.0f} s")
        time.sleep(1.0)


def served_model(base: str, api_key: str | None = None) -> str:
    """The first model id of GET /v1/models."""
    raw = _request(base, "/v1/models", None, api_key)
    try:
        return json.loads(raw)["data"][0]["id"]
    except (KeyError, IndexError, ValueError) as e:
        raise SystemExit(f"/v1/models: no model id in the answer ({e}): {raw[:200]!r}") from None


def run(base: str, model: str | None = None, api_key: str | None = None) -> dict:
    """Send the four requests (model: the name to send; None: the server's, from /v1/models); returns
    what each gave. Raises SystemExit naming a failure."""
    model = model or served_model(base, api_key)
    chat = lambda **kw: _request(base, "/v1/chat/completions", {"model": model, "seed": 0, **kw}, api_key)  # noqa: E731
    out = {}

    r = chat(messages=[{"role": "user", "content": "What is 2+2?"}], reasoning_effort="high",
             max_tokens=16, thinking_budget=8)
    msg = r["choices"][0]["message"]
    print("1. thinking:    reasoning_content =", json.dumps(msg.get("reasoning_content"), ensure_ascii=False))
    print("                content           =", json.dumps(msg.get("content"), ensure_ascii=False))
    if not msg.get("reasoning_content"):
        raise SystemExit("1. thinking on gave no reasoning_content (is the reasoning parser off?)")
    out["reasoning"] = msg

    r = chat(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], tool_choice="required",
             max_tokens=200)
    choice = r["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    print("2. tool call:   finish_reason =", choice["finish_reason"], " tool_calls =",
          json.dumps([c["function"] for c in calls], ensure_ascii=False))
    if not calls or choice["finish_reason"] != "tool_calls":
        raise SystemExit("2. tool_choice 'required' gave no tool_calls (is the tool-call parser off?)")
    for c in calls:
        args = json.loads(c["function"]["arguments"])
        if c["function"]["name"] != "get_weather" or args.get("city") not in ("Paris", "Beijing"):
            raise SystemExit(f"2. a tool call does not follow the tool's schema: {c['function']}")
    out["tool_calls"] = calls

    r = chat(messages=[{"role": "user", "content": "How sure are you that 2 + 2 = 4? Answer as JSON."}],
             reasoning_effort="high", thinking_budget=8, max_tokens=64,
             response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}})
    msg = r["choices"][0]["message"]
    print("3. json_schema: reasoning_content =", json.dumps(msg.get("reasoning_content"), ensure_ascii=False))
    print("                content           =", msg.get("content"))
    try:
        value = json.loads(msg.get("content") or "")
    except json.JSONDecodeError:
        raise SystemExit(f"3. json_schema with thinking on: the content does not parse: {msg.get('content')!r}") \
            from None
    if set(value) != {"answer", "sure"} or not msg.get("reasoning_content"):
        raise SystemExit(f"3. json_schema with thinking on: unexpected answer {msg}")
    out["json"] = value

    text = _request(base, "/metrics")
    lines = [ln for ln in text.splitlines() if ln.startswith("dsv41:")]
    print("4. /metrics:   ", len(lines), "samples, e.g.", lines[0] if lines else None)
    if not lines:
        raise SystemExit("4. /metrics has no dsv41: samples")
    out["metrics"] = text
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:30000",
                    help="the server, without /v1 (default: %(default)s)")
    ap.add_argument("--model", default=None, help="the model name to send (default: the first of the server's "
                    "GET /v1/models)")
    ap.add_argument("--api-key", default=None, help="the server's API key, if it has one")
    ap.add_argument("--wait", type=float, default=0.0,
                    help="seconds to wait for GET /health first (default 0: the server must already be up)")
    args = ap.parse_args(argv)
    if args.wait < 0:
        ap.error("--wait must be >= 0")
    if args.wait:
        wait_healthy(args.base_url, args.wait)
    run(args.base_url, args.model, args.api_key)
    print("all four features work")
    return 0


if __name__ == "__main__":
    sys.exit(main())
