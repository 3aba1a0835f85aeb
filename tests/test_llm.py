"""The offline API (issue 5 item 4): `from dsv41_jax import LLM, SamplingParams`.

Same engine arguments as tests/test_engine.py, so the compiled steps are shared within a session.
"""

import os
import sys

import pytest

import configs

ENGINE_KW = dict(dtype="float32", page_size=16, context_length=128, max_running_requests=8, max_total_tokens=1024,
                 chunked_prefill_size=16, batch_buckets=[8], token_buckets=[16])


def test_import_is_light():
    import subprocess

    code = "import sys, dsv41_jax; assert 'jax' not in sys.modules; from dsv41_jax import LLM, SamplingParams"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


@pytest.fixture(scope="module")
def llm():
    from dsv41_jax import LLM

    return LLM(model="tiny", cfg=configs.micro(), **ENGINE_KW)


def test_generate_inputs_and_outputs(llm):
    from dsv41_jax import SamplingParams

    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    text = "Hello world, this is a test."
    ids = tok.encode(text)
    a = llm.generate(text, sp)
    b = llm.generate([ids], sp)
    c = llm.generate({"prompt_token_ids": ids}, sp)
    d = llm.generate(ids, sp)
    assert len(a) == len(b) == len(c) == len(d) == 1
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids == c[0].outputs[0].token_ids \
        == d[0].outputs[0].token_ids
    assert a[0].prompt == text and a[0].prompt_token_ids == ids
    out = a[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    assert out.text == tok.decode(out.token_ids)
    # a list of prompts keeps its order; per-prompt parameters
    prompts = ["one", "two two", "three three three", [5, 6, 7]]
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in (1, 2, 3, 4)]
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4]
    assert [o.prompt for o in outs] == ["one", "two two", "three three three", None]
    singles = [llm.generate(p, sp)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == singles
    # logprobs and n
    o = llm.generate("abc", SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=5, logprobs=2, ignore_eos=True))[0]
    assert len(o.outputs) == 2 and all(len(c.logprobs) == 5 and len(c.top_logprobs[0]) == 2 for c in o.outputs)
    assert llm.engine.allocator.free_pages == llm.engine.allocator.capacity


def test_generate_errors(llm):
    from dsv41_jax import LLM, SamplingParams

    with pytest.raises(ValueError):
        llm.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(model="tiny", max_runing_requests=2)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_chat_thinking_on_and_off(llm):
    from dsv41_jax import SamplingParams

    conv = [{"role": "user", "content": "What is 2 + 3?"}]
    sp = SamplingParams(temperature=0, max_tokens=12)
    off = llm.chat(conv, sp, thinking=False)[0]
    on = llm.chat([conv], sp, thinking=True)[0]
    tok = llm.get_tokenizer()
    assert tok.decode(off.prompt_token_ids, skip_special_tokens=False).endswith("<｜Assistant｜></think>")
    assert tok.decode(on.prompt_token_ids, skip_special_tokens=False).endswith("<｜Assistant｜><think>")
    c_off, c_on = off.outputs[0], on.outputs[0]
    assert c_off.reasoning_content == "" and c_off.content == c_off.text
    # thinking on: the text up to </think> is reasoning (all of it when the model never closes)
    if "</think>" in c_on.text:
        r, _, rest = c_on.text.partition("</think>")
        assert c_on.reasoning_content == r and c_on.content == rest
    else:
        assert c_on.reasoning_content == c_on.text and c_on.content == ""
    # chat == generate on the encoded prompt
    g = llm.generate([off.prompt_token_ids], sp.replace(skip_special_tokens=False))[0]
    assert g.outputs[0].token_ids == c_off.token_ids


@pytest.mark.slow
def test_llm_from_checkpoint_directory(tmp_path):
    """A model directory goes through checkpoint.load_params (compiles its own steps: slow)."""
    import jax

    from dsv41_jax import LLM, SamplingParams
    from dsv41_jax.model import ModelConfig, init_params
    from dsv41_jax.model.checkpoint import save_hf_checkpoint

    cfg = ModelConfig.preset("tiny")
    save_hf_checkpoint(init_params(cfg, jax.random.key(0)), cfg, str(tmp_path))
    a = LLM(model=str(tmp_path), **ENGINE_KW)
    b = LLM(model="tiny", **ENGINE_KW)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert a.generate("hello", sp)[0].outputs[0].token_ids == b.generate("hello", sp)[0].outputs[0].token_ids
