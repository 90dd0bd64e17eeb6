"""Entry point of a tensor-parallel rank process: ``python -m bulkinfer.engine.parallel.rank_main FD``, FD its
end of a socket pair with rank 0 (engine/parallel/group.py). A module nothing imports, so runpy
runs it fresh."""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from bulkinfer.engine.parallel.rank_worker import run_rank


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    run_rank(conn.recv(), conn)


if __name__ == "__main__":
    main()
