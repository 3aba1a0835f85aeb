"""The shipped nano checkpoint (issue 14): it loads, answers, calls tools, through the real server.

One server, started with no flags but a port: nano is the default model. Held-out prompts (seed 1000,
never trained on) go through the OpenAI-compatible API; the bar of the smoke check is the issue's
(>= 90 % exact answers), on 10 prompts, half with thinking on. The full measurement (200 + 200
prompts, 100 tool calls with the openai client, DSpark) is scripts/eval_nano.py's; README has its
numbers.
"""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest
from servers import start_server, stop_server, user_env

from dsv41_jax.model.config import NANO_DIR, ModelConfig, resolve_model
from dsv41_jax.training import data

HELD_OUT_SEED = 1000  # scripts/eval_nano.py's default: training uses seed 0, its held-out loss seed 1


def test_nano_is_shipped_in_the_release_layout():
    """`--model nano` is the package's directory with a release-format checkpoint of the nano preset."""
    assert resolve_model("nano") == NANO_DIR
    names = set(os.listdir(NANO_DIR))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens.json"} <= names
    assert any(n.endswith(".safetensors") for n in names)
    cfg = ModelConfig.from_pretrained("nano")
    assert cfg.replace(name="nano") == ModelConfig.preset("nano")
    with open(os.path.join(NANO_DIR, "nano_run.json"), encoding="utf-8") as f:
        run = json.load(f)
    assert run["seed"] != HELD_OUT_SEED and run["eval_seed"] != HELD_OUT_SEED


@pytest.fixture(scope="module")
def nano_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("nano_server")
    env = user_env()
    cache = os.environ.get("DSV41_TEST_JAX_CACHE") or str(d / "jax_cache")
    proc, base, logf = start_server([], d / "server.log", cache, env=env)  # no --model: the default
    yield {"base": base, "log": d / "server.log"}
    rc = stop_server(proc, logf)
    assert rc == 0, (d / "server.log").read_text()[-3000:]


def _chat(base, ex, **kw):
    body = {"model": "nano", "messages": ex.messages, "temperature": 0, "max_tokens": 64,
            "chat_template_kwargs": {"thinking": ex.thinking}, **kw}
    if ex.tools:
        body["tools"] = ex.tools
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_default_server_is_nano_and_answers_held_out_prompts(nano_server):
    models = httpx.get(nano_server["base"] + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]][0] == "nano"
    exs = [data.make_example(HELD_OUT_SEED, i, kinds=data.TEXT_KINDS, thinking=bool(i % 2)) for i in range(10)]
    right, seen = 0, []
    for ex in exs:
        ch = _chat(nano_server["base"], ex)
        msg = ch["message"]
        ok = msg["content"] == ex.answer and ch["finish_reason"] == "stop"
        if ex.thinking:  # the reasoning comes back apart, through the server's reasoning parser
            ok = ok and bool(msg.get("reasoning_content")) and "</think>" not in msg["content"]
        right += ok
        seen.append((ex.kind, ex.answer, msg.get("reasoning_content"), msg["content"]))
    assert right >= 9, seen


def test_nano_calls_a_tool_through_the_server_with_the_openai_client(nano_server):
    client = openai.OpenAI(base_url=nano_server["base"] + "/v1", api_key="none")
    for i, think in ((0, False), (1, True)):
        ex = data.make_example(HELD_OUT_SEED + 1, i, kinds=("tool_call",), thinking=think)
        r = client.chat.completions.create(model="nano", messages=ex.messages, tools=ex.tools, temperature=0,
                                           max_tokens=96, extra_body={"chat_template_kwargs": {"thinking": think}})
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls]
        assert calls == [ex.answer]
        assert "DSML" not in (ch.message.content or "")
