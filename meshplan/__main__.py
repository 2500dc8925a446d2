"""`python -m meshplan ...` is the `meshplan` command."""

import sys

from meshplan.cli import main

if __name__ == "__main__":
    sys.exit(main())
