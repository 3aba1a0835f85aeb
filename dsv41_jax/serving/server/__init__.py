"""The OpenAI-compatible HTTP server (FastAPI on uvicorn), in small parts.

:func:`build_app` wires an engine (``AsyncEngine``: ``generate`` / ``abort`` / ``stats``), the
tokenizer, the chat layer and constrained decoding into these endpoints (`ENDPOINTS` lists them;
``python -m dsv41_jax.serve --help`` and its start-up log print that list):

* ``POST /v1/chat/completions`` (`chat`) and ``POST /v1/completions`` (`completions`), over one
  response module (`responses`: the engine run, choices, JSON and SSE responses, disconnects);
* ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (`tokenize`);
* ``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``POST /pause_generation`` /
  ``/continue_generation``, ``POST /{start,stop,dump}_expert_distribution_record`` (`admin`).

`context` holds what the routes share (engine calls, admission, errors), `gate` the API key and
body limit, `app` puts them together. Text comes from the engine's detokenizer (the one
detokenizer, `tokenizer.IncrementalDetokenizer`): the server never decodes generated ids itself.
"""

from .app import ENDPOINTS, build_app, endpoints
from .context import ServerConfig

__all__ = ["ENDPOINTS", "ServerConfig", "build_app", "endpoints"]
