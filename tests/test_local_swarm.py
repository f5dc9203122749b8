"""The one-command local swarm (``python -m lean_transformer.demo``), run for real: an aux peer and two
trainers on 127.0.0.1. A short run ends with a checkpoint, a plot and a summary; a trainer that crashes is reported
while the others go on; Ctrl+C (SIGINT to its process group, as a terminal sends it) stops every process it started,
the crashed trainer's orphaned hivemind processes included, and leaves no socket files behind."""
from __future__ import annotations

import math
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from aux_utils import assert_valid_png, PeerProcess, start_peer
from swarm_utils import unreadable_lines
from lean_transformer.demo import local_swarm
from lean_transformer.swarm.peers.processes import ProcessTracker

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

SUMMARY = re.compile(r"final loss ([\d.]+) nats/token at swarm epoch (\d+); the corpus's entropy floor is ([\d.]+)")
CHECKPOINT = re.compile(r"checkpoint: (\S+) \(")
VIEW = re.compile(r"^\[\d+:\d\d / \d+:\d\d\] aux +swarm epoch \d+ \|.*\n +trainer1 +epoch \d+ \| .* samples/s",
                  re.MULTILINE)


def start_local_swarm(tmp_path: Path, *args: str) -> tuple[PeerProcess, ProcessTracker]:
    run = start_peer("local_swarm", ["-m", "lean_transformer.demo", "--output_dir",
                                      str(tmp_path / "demo"), "--refresh", "2", *args], tmp_path, events=False)
    return run, ProcessTracker(run.pid).watch()


def assert_nothing_left(tracker: ProcessTracker, tmp_path: Path) -> None:
    tracker.stop_watching()
    assert len(tracker.processes) >= 6, "expected the peers and their hivemind processes to have been seen"
    assert tracker.sockets, "expected the peers' p2p sockets to have been seen"
    assert tracker.alive() == [], "processes outlived the command"
    assert tracker.leftover_sockets() == [], "socket files were left in /tmp"
    mentioning_run = [pid for pid in os.listdir("/proc") if pid.isdigit() and str(tmp_path).encode()
                      in _cmdline(pid)]
    assert mentioning_run == [], "a process started for this run is still alive"


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_short_run_ends_with_a_checkpoint_a_plot_and_a_summary(tmp_path: Path, report):
    from lean_transformer import LeanGPTForCausalLM
    from lean_transformer.swarm.storage.training_state import read_epoch

    run, watcher = start_local_swarm(tmp_path, "--duration", "20")
    try:
        assert run.wait(240) == 0, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        run.kill()
    out = run.stdout
    assert_nothing_left(watcher, tmp_path)

    assert VIEW.search(out), f"no live view with the aux peer's and the trainers' progress:\n{out[-3000:]}"
    loss, epoch, floor = SUMMARY.search(out).groups()
    assert float(floor) == pytest.approx(local_swarm.entropy_floor(), abs=1e-4)
    assert float(floor) < float(loss) < math.log(256), "the loss should be between the floor and chance"
    rounds = int(re.search(r"averaging rounds completed: (\d+) of gradients", out).group(1))
    samples = int(re.search(r"samples processed: ([\d,]+)", out).group(1).replace(",", ""))
    assert rounds >= 1 and samples >= local_swarm.SWARM_ARGS["target_batch_size"], out[-2000:]

    checkpoint = Path(CHECKPOINT.search(out).group(1))
    assert checkpoint.parent == tmp_path / "demo" / "checkpoints"
    assert read_epoch(checkpoint) == int(checkpoint.name.split("-")[1]) >= int(epoch)
    model = LeanGPTForCausalLM.from_pretrained(checkpoint)
    assert all(torch.isfinite(param).all() for param in model.parameters())
    written = re.findall(r"^    model:  (.*)$", out, re.MULTILINE)
    corpus = re.findall(r"^    corpus: (.*)$", out, re.MULTILINE)
    assert len(written) == len(corpus) == 3 and all(corpus), out[-2000:]
    assert [f"model:  {text}" for text in written] == local_swarm.writing_sample(checkpoint)[:3]  # seeded
    assert_valid_png(tmp_path / "demo" / "metrics.png")
    for log in (tmp_path / "demo" / "logs").glob("*.log"):  # a healthy run's logs read cleanly
        assert not unreadable_lines(log.read_text()), (log.name, unreadable_lines(log.read_text())[:20])
    report(f"local swarm, 20 s of training: final loss {loss} (floor {floor}) at epoch {epoch}, {samples} samples, "
           f"{rounds} averaging rounds; checkpoint {checkpoint.name} loads; PNG valid; nothing left running")


def test_a_crash_is_reported_and_ctrl_c_stops_every_process_it_started(tmp_path: Path, report):
    run, watcher = start_local_swarm(tmp_path, "--duration", "600")
    try:
        run.wait_for(r"trainer2 +epoch \d+ \|", timeout=240, stream="stdout")  # training is under way
        os.kill(peer_pid(run.process.pid, "trainer2"), signal.SIGKILL)  # its hivemind processes are orphaned
        run.wait_for(r"error: trainer2 exited unexpectedly with code -9", timeout=30)
        run.wait_for(r"trainer1 +epoch \d+ \|", timeout=30, stream="stdout")  # the others go on
        os.killpg(run.process.pid, signal.SIGINT)  # what Ctrl+C in a terminal does
        interrupted = time.monotonic()
        code = run.wait(90)
        seconds = time.monotonic() - interrupted
    finally:
        run.kill()
    assert code == 128 + signal.SIGINT, run.stderr[-3000:]
    assert seconds < local_swarm.SWARM_ARGS["shutdown_timeout"] + 15
    assert_nothing_left(watcher, tmp_path)
    assert "problems: trainer2 exited unexpectedly with code -9" in run.stdout, run.stdout[-2000:]
    report(f"SIGKILL of trainer2: reported, the swarm went on; Ctrl+C: exited with {code} after {seconds:.1f} s, "
           f"the others stopped cleanly, no process (not even trainer2's orphans) or socket file left")


def peer_pid(orchestrator_pid: int, name: str) -> int:
    """The main process of the peer ``name`` (its hivemind children share its command line but not its parent)."""
    for pid in os.listdir("/proc"):
        if pid.isdigit() and f"/{name}\0".encode() in _cmdline(pid):
            try:
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            if parent == orchestrator_pid:
                return int(pid)
    raise AssertionError(f"no process of {name} below {orchestrator_pid}")


@pytest.mark.parametrize("args, message", [
    (["--duration", "0"], "--duration must be positive"),
    (["--num_trainers", "0"], "--num_trainers must be between 1 and 16"),
    (["--refresh", "-1"], "--refresh must be positive"),
])
def test_bad_arguments_give_one_line(args, message, capsys, tmp_path: Path):
    with pytest.raises(SystemExit) as exit_info:
        local_swarm.main([*args, "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_an_output_dir_it_did_not_make_is_kept(capsys, tmp_path: Path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        local_swarm.main(["--output_dir", str(tmp_path)])
    assert "not empty and was not made by this command" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"
