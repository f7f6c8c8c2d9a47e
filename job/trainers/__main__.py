import sys

from job.trainers.check import main

if __name__ == "__main__":
    sys.exit(main())
