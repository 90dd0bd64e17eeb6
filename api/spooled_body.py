"""A request body as a file: kept in memory up to a MiB, on local disk past that.

For a route whose body is the work itself (a message batch of up to max_message_batch_bytes): it is
read from the file a piece at a time (api/json_stream.py) rather than held and parsed whole. The
body's size limit is the request-body check's (api/body_limit.py), which stops the stream past it.
"""

from __future__ import annotations

import tempfile
from typing import IO

from fastapi import Request
from starlette.concurrency import run_in_threadpool

IN_MEMORY_BYTES = 1 << 20
WRITE_BYTES = 1 << 20  # the file is written about a MiB at a time, in the thread pool


async def spooled_body(request: Request) -> IO[bytes]:
    """The body, rewound to its start; the caller closes it (which removes the file)."""
    spool = tempfile.SpooledTemporaryFile(max_size=IN_MEMORY_BYTES, prefix="bulkinfer-body-")
    pending = bytearray()
    try:
        async for chunk in request.stream():
            pending += chunk
            if len(pending) >= WRITE_BYTES:
                await run_in_threadpool(spool.write, bytes(pending))
                pending.clear()
        await run_in_threadpool(spool.write, bytes(pending))
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    return spool
