"""`python -m mgpu_backend …`: see `mgpu_backend.serving.cli`."""
import sys

from .serving.cli import main

sys.exit(main())
