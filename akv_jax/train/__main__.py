"""``python -m akv_jax.train``: see :mod:`akv_jax.train.cli`."""

import sys

from akv_jax.train.cli import main

sys.exit(main())
