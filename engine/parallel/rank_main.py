"""Entry point of a tensor-parallel rank process: ``python -m bulkinfer.engine.parallel.rank_main FD``, FD its
end of a socket pair with rank 0 (engine/parallel/group.py). A module nothing imports, so runpy
runs it fresh."""

from __future__ import annotations

import gc
import sys
from multiprocessing.connection import Connection

from bulkinfer.engine.parallel.rank_worker import run_rank


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    run_rank(conn.recv(), conn)
    # Stopped: the process ends. Its objects (torch's, the model's) left out of the collector's pass
    # at interpreter exit, which took 0.5-1 s of every engine shutdown (rank 0 waits for the exit).
    gc.freeze()


if __name__ == "__main__":
    main()
