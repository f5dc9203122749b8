"""The aux peer's live page: its server on its own, then in a real headless browser (Debian's chromium, driven by
Selenium through /usr/bin/chromedriver) against a real local swarm of an aux peer and two trainers.

The browser test skips when chromium or its driver is missing (.ci/run installs both). With
``DASHBOARD_SCREENSHOT=path`` it also writes its screenshot there (the docs' image: docs/img/dashboard.png).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import List

import pytest

from aux_utils import PeerProcess, assert_valid_png, start_peer, stop_all, wait_until
from lean_transformer.demo.local_swarm import command_line
from lean_transformer.swarm.monitoring.aggregation import SwarmStats
from lean_transformer.swarm.monitoring.dashboard import Dashboard, state_json
from lean_transformer.swarm.monitoring.evaluation import Evaluation
from lean_transformer.swarm.monitoring.peer_table import PeerRow

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def get(url: str) -> tuple:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.headers["Content-Type"], response.read()


def test_server_serves_the_page_the_state_and_plotly_then_stops():
    rows = [SwarmStats(epoch, 2, float("nan") if epoch == 0 else 5.0 / epoch, 10.0, 16, 4, 100.0 + epoch)
            for epoch in range(3)]
    peer = PeerRow(key="abc", peer_id="12D3KooWabc", client_mode=True, epoch=2, samples_per_second=10.0, samples=32,
                   last_seen=101.0, rounds_attempted=2, rounds_averaged=1, alive=True)
    with Dashboard("127.0.0.1", 0, title="run <1>") as dashboard:
        url = dashboard.url
        status, kind, page = get(url)
        assert status == 200 and kind.startswith("text/html")
        assert b"<title>run &lt;1&gt; - swarm</title>" in page and b'src="plotly.min.js"' in page
        assert b"cdn" not in page.lower() and b"https://" not in page and b"http://" not in page  # all served here
        status, kind, script = get(url + "plotly.min.js")
        assert kind == "text/javascript" and len(script) > 1_000_000 and b"plotly" in script[:1000].lower()
        assert json.loads(get(url + "api/state")[2])["epochs"] == []  # before the first refresh
        dashboard.publish(state_json("run <1>", 2, rows, [Evaluation(2, 2.5, 102.0)], [peer], now=103.0))
        state = json.loads(get(url + "api/state?t=1")[2])
        assert [row["loss"] for row in state["epochs"]] == [None, 5.0, 2.5]  # NaN is null in JSON
        assert state["evaluations"] == [{"epoch": 2, "validation_loss": 2.5, "time": 102.0}]
        assert state["peers"] == [{**peer.to_dict(), "averaged_fraction": 0.5}] and state["swarm_epoch"] == 2
        for missing in ("favicon.ico", "../README.md", "api/state/../../etc/passwd"):
            with pytest.raises(urllib.error.HTTPError) as error:
                get(url + missing)
            assert error.value.code == 404
    with pytest.raises(urllib.error.URLError):  # stopped with its owner
        get(url)


# ---------------------------------------------------------------- a real browser against a real swarm

def swarm_args(run_id: str) -> List[str]:
    return command_line(dict(run_id=run_id, host_maddrs="/ip4/127.0.0.1/tcp/0", target_batch_size=64,
                             per_device_batch_size=4, max_sequence_length=32, matchmaking_time=3, averaging_timeout=10,
                             startup_timeout=60))


def browser():
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip(f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): "
                    f"apt-get install chromium chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1400,600", "--no-first-run", "--disable-extensions"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(10)
    return driver


PAGE_STATE = """
const chart = id => (document.getElementById(id).data || [{x: []}]);
return {loss: chart('loss-chart')[0].x.length, validation: (chart('loss-chart')[1] || {x: []}).x.length,
        speed: chart('speed-chart')[0].x.length, peers: chart('peers-chart')[0].x.length,
        both: (chart('peers-chart')[0].y || []).filter(peers => peers === 2).length,
        rows: [...document.querySelectorAll('#peers tr')].map(tr => [...tr.cells].map(td => td.textContent)),
        titles: [...document.querySelectorAll('#peers tr td:first-child')].map(td => td.title),
        loaded: window.loadedOnce === true};
"""


@pytest.mark.swarm
@pytest.mark.timeout(150)
def test_live_page_in_a_real_browser_against_a_local_swarm(tmp_path: Path):
    """The page loads against a running swarm, its table lists both trainers and its charts have points; it keeps
    updating without a reload; the server stops with the aux peer."""
    driver = browser()
    run = swarm_args("dashboard-test")
    peers: List[PeerProcess] = []
    try:
        aux = start_peer("aux", ["run_aux_peer.py", *run, "--dashboard_port", "0", "--refresh_period", "0.5",
                                  "--checkpoint_every_epochs", "4", "--eval_batches", "2",
                                  "--checkpoint_dir", str(tmp_path / "ckpt"), "--metrics_path",
                                  str(tmp_path / "swarm.jsonl"), "--wandb_project", ""], tmp_path)
        peers.append(aux)
        url = aux.wait_for(r"The live page of the run: (http://127\.0\.0\.1:\d+/)", timeout=90).group(1)
        initial_peers = aux.initial_peers()
        trainers = [start_peer(name, ["tests/slow_trainer.py", "run_trainer.py", *run, "--initial_peers",
                                      *initial_peers, "--output_dir", str(tmp_path / name), "--backup_every_epochs",
                                      "0"], tmp_path, {"SLOW_BATCH_SECONDS": "0.1"})
                    for name in ("trainer1", "trainer2")]
        peers += trainers
        driver.get(url)
        driver.execute_script("window.loadedOnce = true")  # gone if the page reloads
        trainer_ids = {trainer.events("joined")[0]["peer"] for trainer in
                       [wait_until(lambda t=t: t.events("joined") and t, 90, f"{t.name} to join") for t in trainers]}

        def ready():
            state = driver.execute_script(PAGE_STATE)
            listed = set(state["titles"]) >= trainer_ids
            # a newcomer out of sync drops its micro-batches for downloads, and hivemind's speed estimate shows 0.0
            # samples/s until it keeps up (CI: 12 samples in 27 s, against a solo trainer whose epochs took 0.35 s
            # before the trainers slept 0.1 s per micro-batch; the wait then took up to 98 s, now ~37 s)
            speeds = listed and all(len(row) == 8 and float(row[3]) > 0 for row in state["rows"])
            return speeds and state["loss"] >= 3 and state["both"] >= 3 and state["validation"] >= 1 and state

        state = wait_until(ready, timeout=90, what="the page to list both trainers at work, 3 epochs with both charted",
                           interval=0.5)
        assert state["loaded"], "the page reloaded"
        assert len(state["rows"]) == 2, state["rows"]
        for peer, mode, epoch, speed, samples, last_seen, rounds, excluded in state["rows"]:
            assert mode == "full" and float(speed) > 0 and int(samples) > 0 and excluded == "no", state["rows"]
            assert last_seen.endswith("ago") and "%" in rounds, state["rows"]
        driver.save_screenshot(str(tmp_path / "dashboard.png"))
        assert_valid_png(tmp_path / "dashboard.png")
        if os.environ.get("DASHBOARD_SCREENSHOT"):
            shutil.copyfile(tmp_path / "dashboard.png", os.environ["DASHBOARD_SCREENSHOT"])

        more = wait_until(lambda: (now := driver.execute_script(PAGE_STATE))["loss"] > state["loss"] and now,
                          timeout=60, what="the page to show a newer epoch without a reload", interval=0.5)
        assert more["loaded"], "the page reloaded"
        assert stop_all(trainers) == [0, 0], [trainer.log_tail() for trainer in trainers]
        assert aux.stop() == 0, aux.log_tail()
        assert re.search(r"\| 2 trainers \(0 client mode\), averaged in \d+% of rounds", aux.stderr)  # status line
        with pytest.raises(urllib.error.URLError):
            get(url)  # the server stopped with the aux peer
    finally:
        driver.quit()
        for peer in peers:
            peer.kill()
