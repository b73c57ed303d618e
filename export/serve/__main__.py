"""`python -m export.serve`: see `export.serve`."""

import sys

from export.serve.server import main

if __name__ == "__main__":
    sys.exit(main())
