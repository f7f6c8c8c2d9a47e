"""`python -m job ...`: see job/cli.py."""

import sys

from job.cli import main

if __name__ == "__main__":  # vLLM spawns processes: everything must sit behind this guard
    sys.exit(main())
