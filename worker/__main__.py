"""`python -m bulkinfer.worker [flags]`: the same as `bulkinfer serve worker [flags]`."""

import sys

from bulkinfer.worker.process.main import serve_worker

if __name__ == "__main__":
    sys.exit(serve_worker(sys.argv[1:]))
