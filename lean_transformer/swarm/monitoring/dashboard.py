"""The aux peer's live page: a read-only web page of the run that updates itself without a reload.

The server is the standard library's ``ThreadingHTTPServer`` in a daemon thread (three read-only routes need no web
framework), and the charts are drawn by plotly.js as the ``plotly`` package ships it (``package_data/plotly.min.js``),
served from this peer: nothing is fetched from a CDN, so the page works on an offline aux peer. Routes:

- ``/``: the page; it polls ``/api/state`` every few seconds (each request bounded by a timeout) and redraws;
- ``/api/state``: the run's state as JSON: per-epoch rows (loss, samples/s, alive peers), validation losses, the
  table of contributors. The aux peer builds it after each refresh (:meth:`Dashboard.publish`), so the server thread
  never reads the peer's live structures;
- ``/plotly.min.js``: the charting library.

It shows the run's ID, public statistics and key fingerprints; no addresses, tokens, keys or paths.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Iterable, Optional

from lean_transformer.swarm.monitoring.aggregation import SwarmStats
from lean_transformer.swarm.monitoring.evaluation import Evaluation
from lean_transformer.swarm.monitoring.peer_table import PeerRow

logger = logging.getLogger(__name__)

MAX_EPOCHS_SHOWN = 2000  # the page gets the newest rows only: a JSON reply stays small in a long run


def state_json(run_id: str, swarm_epoch: int, rows: Iterable[SwarmStats], evaluations: Iterable[Evaluation],
               peers: Iterable[PeerRow], now: float) -> bytes:
    """What ``/api/state`` returns (NaN losses become ``null``)."""
    rows, evaluations = list(rows)[-MAX_EPOCHS_SHOWN:], list(evaluations)[-MAX_EPOCHS_SHOWN:]
    state = dict(run_id=run_id, swarm_epoch=swarm_epoch, time=now, epochs=[row.to_dict() for row in rows],
                 evaluations=[evaluation.to_dict() for evaluation in evaluations],
                 peers=[row.to_dict() for row in peers])
    return json.dumps(state, allow_nan=False).encode()


class Dashboard:
    """Serves the page on ``host:port`` (port 0: a free one, see :attr:`url`) from :meth:`start` to :meth:`close`."""

    def __init__(self, host: str, port: int, title: str):
        self._state = json.dumps(dict(run_id=title, swarm_epoch=None, time=time.time(), epochs=[], evaluations=[],
                                      peers=[])).encode()
        self._page = PAGE.replace("{{title}}", _html_escape(title)).encode()
        self._plotly = (resources.files("plotly") / "package_data" / "plotly.min.js").read_bytes()
        dashboard = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                routes = {"/": (dashboard._page, "text/html; charset=utf-8", "no-cache"),
                          "/api/state": (dashboard._state, "application/json", "no-store"),
                          "/plotly.min.js": (dashboard._plotly, "text/javascript", "max-age=86400")}
                if path not in routes:
                    self.send_error(HTTPStatus.NOT_FOUND)
                    return
                body, content_type, cache = routes[path]
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", cache)
                self.send_header("X-Content-Type-Options", "nosniff")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:  # not one line per poll in the peer's log
                logger.debug(f"dashboard: {self.address_string()} {format % args}")

        Handler.timeout = 10  # a client that stops sending cannot hold a thread for ever
        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/"

    def start(self) -> "Dashboard":
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs=dict(poll_interval=0.5),
                                        name="dashboard", daemon=True)
        self._thread.start()
        return self

    def publish(self, state: bytes) -> None:
        """Serve ``state`` (see :func:`state_json`) from now on."""
        self._state = state

    def close(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._server.shutdown()  # returns once serve_forever has stopped (within its poll interval)
            self._thread.join(timeout)
        self._server.server_close()

    def __enter__(self) -> "Dashboard":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()


def _html_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{title}} - swarm</title>
<script src="plotly.min.js"></script>
<style>
  body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; background: #fafafa; }
  h1 { font-size: 1.4em; margin: 0 0 0.2em; }
  #status { color: #555; margin-bottom: 1em; }
  #status.stale { color: #b00; }
  .charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(380px, 1fr)); gap: 1em; }
  .chart { height: 280px; background: #fff; border: 1px solid #ddd; }
  table { border-collapse: collapse; margin-top: 1.5em; background: #fff; width: 100%; }
  th, td { border: 1px solid #ddd; padding: 0.35em 0.6em; text-align: right; font-variant-numeric: tabular-nums; }
  th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; font-family: monospace; }
  tr.gone { color: #999; }
</style>
</head>
<body>
<h1>{{title}}</h1>
<div id="status">waiting for the first update</div>
<div class="charts">
  <div id="loss-chart" class="chart"></div>
  <div id="speed-chart" class="chart"></div>
  <div id="peers-chart" class="chart"></div>
</div>
<table>
  <thead><tr><th>peer</th><th>mode</th><th>epoch</th><th>samples/s</th><th>samples contributed</th>
    <th>last seen</th><th>rounds averaged</th><th>excluded</th></tr></thead>
  <tbody id="peers"></tbody>
</table>
<script>
"use strict";
const POLL_MS = 3000, TIMEOUT_MS = 5000;
const layout = (title, y) => ({title: {text: title, font: {size: 14}, x: 0.02, xanchor: "left"},
  margin: {l: 55, r: 10, t: 40, b: 45}, xaxis: {title: {text: "epoch"}}, yaxis: {title: {text: y}},
  showlegend: true, legend: {orientation: "h", x: 1, xanchor: "right", y: 1.02, yanchor: "bottom"}});
const config = {displayModeBar: false, responsive: true};

function text(value) { const span = document.createElement("span"); span.textContent = value; return span.innerHTML; }
function ago(seconds) {
  if (seconds < 60) return Math.round(seconds) + " s ago";
  if (seconds < 3600) return Math.round(seconds / 60) + " min ago";
  return (seconds / 3600).toFixed(1) + " h ago";
}
function shortId(peer) { return peer.peer_id ? "..." + peer.peer_id.slice(-8) : "key " + peer.key; }

function draw(state) {
  const epochs = state.epochs.map(row => row.epoch);
  Plotly.react("loss-chart", [
    {x: epochs, y: state.epochs.map(row => row.loss), name: "training loss", mode: "lines+markers"},
    {x: state.evaluations.map(row => row.epoch), y: state.evaluations.map(row => row.validation_loss),
     name: "validation loss", mode: "markers", marker: {size: 9, color: "#d62728"}},
  ], layout("loss", "loss"), config);
  Plotly.react("speed-chart", [{x: epochs, y: state.epochs.map(row => row.samples_per_second),
    name: "swarm samples/s", mode: "lines+markers", line: {color: "#2ca02c"}}],
    layout("swarm samples / s", "samples / s"), config);
  Plotly.react("peers-chart", [{x: epochs, y: state.epochs.map(row => row.alive_peers), name: "peers alive",
    mode: "lines+markers", line: {color: "#ff7f0e", shape: "hv"}}],
    {...layout("peers alive", "peers"), yaxis: {title: {text: "peers"}, rangemode: "tozero", dtick: 1}}, config);
  document.getElementById("peers").innerHTML = state.peers.map(peer => {
    const rounds = peer.rounds_attempted == null ? "n/a" :
      `${peer.rounds_averaged} / ${peer.rounds_attempted} (${Math.round(100 * peer.averaged_fraction)}%)`;
    const mode = peer.client_mode == null ? "n/a" : (peer.client_mode ? "client" : "full");
    return `<tr class="${peer.alive ? "alive" : "gone"}" data-key="${text(peer.key)}">` +
      `<td title="${text(peer.peer_id || "")}">${text(shortId(peer))}</td><td>${mode}</td><td>${peer.epoch}</td>` +
      `<td>${peer.samples_per_second.toFixed(1)}</td><td>${peer.samples}</td>` +
      `<td>${ago(state.time - peer.last_seen)}</td><td>${rounds}</td><td>${peer.excluded ? "yes" : "no"}</td></tr>`;
  }).join("");
  const last = state.epochs[state.epochs.length - 1];
  const alive = state.peers.filter(peer => peer.alive).length;
  const status = document.getElementById("status");
  status.className = "";
  status.textContent = `swarm epoch ${state.swarm_epoch ?? "?"} | ${alive} trainer(s) reporting` +
    (last ? ` | epoch ${last.epoch}: loss ${last.loss == null ? "n/a" : last.loss.toFixed(4)}, ` +
            `${last.samples_per_second.toFixed(1)} samples/s` : "") +
    ` | updated ${new Date(state.time * 1000).toLocaleTimeString()}`;
}

async function poll() {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), TIMEOUT_MS);
  try {
    const response = await fetch("api/state", {signal: controller.signal, cache: "no-store"});
    if (!response.ok) throw new Error("HTTP " + response.status);
    draw(await response.json());
  } catch (error) {
    const status = document.getElementById("status");
    status.className = "stale";
    status.textContent = "cannot reach the aux peer (" + error.message + "); retrying";
  } finally {
    clearTimeout(timer);
    setTimeout(poll, POLL_MS);
  }
}
poll();
</script>
</body>
</html>
"""
