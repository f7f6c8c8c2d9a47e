"""`python -m job ...`: see job/cli.py."""

import sys

from job.cli import main

if __name__ == "__main__":  # vLLM spawns processes: everything must sit behind this guard
    try:
        sys.exit(main())
    except BrokenPipeError:  # `python -m job plan ... | head`: the reader left; nothing more to say, and no traceback
        import os  # what is still buffered for stdout goes nowhere (Python's own advice for SIGPIPE)

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
