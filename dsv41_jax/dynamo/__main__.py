"""``python -m dsv41_jax.dynamo``: the Dynamo worker (see `dsv41_jax.dynamo.worker`)."""

import sys

from dsv41_jax.dynamo.worker import main

if __name__ == "__main__":
    sys.exit(main())
