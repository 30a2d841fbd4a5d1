"""``python -m akv_jax.train``: see :mod:`akv_jax.train.cli`."""

import sys

from akv_jax.train.cli import main

if __name__ == "__main__":  # importing the module (tools, tests) runs nothing
    sys.exit(main())
