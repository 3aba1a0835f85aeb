"""NVIDIA Dynamo integration: our engine as a Dynamo worker, our chat layer in Dynamo's frontend.

* ``python -m dsv41_jax.dynamo`` (`worker`): a token worker wrapping `serving.async_engine.AsyncEngine`,
  publishing the prefix cache's blocks (`kv_events`) for KV-aware routing;
* ``python -m dsv41_jax.dynamo.frontend`` (`frontend`): Dynamo's HTTP frontend, router and discovery,
  with our chat encoding, reasoning and DSML tool-call parsing plugged in as its chat processor.

Dynamo itself is optional (``scripts/install_dynamo.sh``); only `kv_events` is importable without it.
See docs/design/dynamo.md.
"""

import sys


def dynamo_missing(err: ImportError) -> int:
    """The CLIs' answer when Dynamo is not installed: a message saying how to install it, status 2."""
    print(f"error: NVIDIA Dynamo is not installed ({err}); install it with scripts/install_dynamo.sh", file=sys.stderr)
    return 2
