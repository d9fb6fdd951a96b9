"""moto's S3 server (a real S3 API over HTTP) with its buckets made before it listens, so a
restarted one is never seen without them. moto keeps nothing on disk: a restart loses every
object, as a server restored from an empty volume would.

    python -m tests.s3_server HOST PORT [BUCKET ...]
"""

from __future__ import annotations

import signal
import sys

from moto.core import DEFAULT_ACCOUNT_ID
from moto.s3.models import s3_backends
from moto.server import ThreadedMotoServer


def main() -> None:
    host, port, *buckets = sys.argv[1:]
    for bucket in buckets:
        s3_backends[DEFAULT_ACCOUNT_ID]["aws"].create_bucket(bucket, "us-east-1")
    server = ThreadedMotoServer(ip_address=host, port=int(port), verbose=False)
    server.start()
    signal.signal(signal.SIGTERM, lambda *_: (server.stop(), sys.exit(0)))
    signal.pause()


if __name__ == "__main__":
    main()
