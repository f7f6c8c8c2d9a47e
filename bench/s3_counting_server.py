"""A moto S3 server on loopback that counts the requests it serves, for benches that report S3 request counts.

    .venv/bin/python bench/s3_counting_server.py PORT

The same server tests/conftest.py starts (moto's WSGI app, werkzeug, threaded), with a counter in front of it in the
same process: no proxy hop, so the counts are of what the client really sent (pyarrow.fs.S3FileSystem, boto3) and
the timings carry no extra latency. `GET /__requests` answers {"METHOD kind": count} (kind: list, get, head, put,
delete, post; a GET with a `list-type` or `prefix` query is a list); `POST /__requests` resets it. Neither is counted.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from urllib.parse import parse_qs

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

COUNT_PATH = "/__requests"


def kind_of(method: str, query: str) -> str:
    """What S3 bills a request as: LIST (a bucket GET with list-type/prefix/delimiter), else by method."""
    q = parse_qs(query)
    if method == "GET" and ({"list-type", "prefix", "delimiter"} & set(q)):
        return "LIST"
    return method


class CountingApp:
    def __init__(self, app):
        self.app, self.counts, self.lock = app, Counter(), threading.Lock()

    def __call__(self, environ, start_response):
        if environ.get("PATH_INFO") == COUNT_PATH:
            with self.lock:
                body = json.dumps(dict(self.counts)).encode()
                if environ["REQUEST_METHOD"] == "POST":
                    self.counts.clear()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        with self.lock:
            self.counts[kind_of(environ["REQUEST_METHOD"], environ.get("QUERY_STRING", ""))] += 1
        return self.app(environ, start_response)


def main() -> None:
    port = int(sys.argv[1])
    app = CountingApp(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", port, app, threaded=True, request_handler=MotoRequestHandler)
    server.serve_forever()


if __name__ == "__main__":
    main()
