"""`python -m mgpu_backend …`: see `mgpu_backend.cli`."""
import sys

from .cli import main

sys.exit(main())
