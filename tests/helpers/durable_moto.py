"""moto's S3 server whose objects outlive a SIGKILL: `python durable_moto.py HOST PORT RECORDING`.

moto keeps its objects in memory only, so a killed server comes back empty, where S3 (and
fake-gcs-server's filesystem backend) keeps what it acknowledged. moto's own recorder
(`MOTO_ENABLE_RECORDING`) appends each request to RECORDING as it arrives; a server started on
an existing recording first replays its writes into itself, in order, and only then opens its
port, so no client sees it half restored. A request recorded just before a SIGKILL comes back
applied although its client got no answer: as on S3, a write whose reply was lost may have
happened. Multipart uploads would not replay (moto draws their upload ids anew), so what the
tests write here stays under the clients' single-request size (s3fs: 50 MB).
"""
from __future__ import annotations

import base64
import json
import os
import sys
from urllib.parse import urlsplit

READS = {"GET", "HEAD"}


def _replay(app, recording: str) -> None:
  from moto.moto_api import recorder
  from werkzeug.test import Client
  recorder.stop_recording()  # the replay is not recorded again
  client = Client(app)
  with open(recording) as lines:
    for line in lines:
      try:
        entry = json.loads(line)
      except ValueError:  # the last line, cut short by the SIGKILL
        break
      if entry["method"] in READS:
        continue
      body = entry.get("body") or b""
      if entry.get("body_encoded"):
        body = base64.b64decode(body)
      headers = {k: v for k, v in entry["headers"].items() if k.lower() != "transfer-encoding"}
      url = urlsplit(entry["url"])
      client.open(url.path, method=entry["method"], query_string=url.query, headers=headers,
                  data=body)
  recorder.start_recording()


def main(host: str, port: str, recording: str) -> None:
  os.environ.update(MOTO_ENABLE_RECORDING="1", MOTO_RECORDER_FILEPATH=recording,
                    MOTO_PORT=port)  # read when moto is imported
  from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
  from werkzeug.serving import run_simple
  app = DomainDispatcherApplication(create_backend_app)
  if os.path.exists(recording):
    _replay(app, recording)
  run_simple(host, int(port), app, threaded=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
