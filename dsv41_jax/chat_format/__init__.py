"""The DeepSeek-V4.1 chat format (docs/design/spec.md §10), shared by serving and training.

* `encoding` — OpenAI messages -> the prompt text (`encode_messages`, `encode_chat_request`), the
  special-token strings, the prose of a checkpoint (`Wording`, `load_wording`);
* `effort` — the thinking switch and ``reasoning_effort`` (`resolve_thinking`, `ServerDefaults`),
  and `ChatError`, the chat layer's 400;
* `dsml` — the tool-call markup as written (`render_calls_block`), the JSON style, and the
  ``tools`` / ``tool_choice`` checks;
* `encoding_v4` — the earlier DeepSeek-V4 checkpoints' encoding (unspaced DSML, Non-think / Think High /
  Think Max), built from the pieces above;
* `registry` — `ChatFormat`: the encoding a checkpoint uses (its model family), with its wording and the server's
  thinking / effort defaults, chosen once (`ChatFormat.for_model`) and passed to the server and `LLM.chat`.

Nothing here imports the rest of dsv41_jax: `serving` (the server, `LLM.chat`) and `training` (the
nano corpus) both build on it, so training never imports `serving`. The model-output side (the
reasoning and tool-call parsers) stays in `dsv41_jax.serving`.
"""
