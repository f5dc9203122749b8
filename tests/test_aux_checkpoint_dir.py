"""Atomic, rotated checkpoint directories (used by the aux peer's checkpoints and the trainers' backups)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aux_utils import wait_until
from lean_transformer.swarm.storage.checkpoint_dir import CheckpointDir


def write_files(contents: dict):
    def write(directory: Path) -> None:
        for name, text in contents.items():
            (directory / name).write_text(text)

    return write


def test_save_publishes_whole_checkpoints_and_keeps_the_newest(tmp_path: Path):
    store = CheckpointDir(tmp_path, keep_last=2)
    for epoch in (3, 5, 8):
        path = store.save(epoch, write_files({"a.txt": f"a{epoch}", "b.txt": f"b{epoch}"}))
        assert path == tmp_path / f"epoch-{epoch:06d}"
    assert [epoch for epoch, _ in store.checkpoints()] == [5, 8]
    assert store.latest() == (8, tmp_path / "epoch-000008")
    assert (tmp_path / "epoch-000008" / "b.txt").read_text() == "b8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-000005", "epoch-000008"]  # nothing else left


def test_saving_an_epoch_again_replaces_it(tmp_path: Path):
    store = CheckpointDir(tmp_path, keep_last=3)
    store.save(4, write_files({"a.txt": "old", "stale.txt": "x"}))
    store.save(4, write_files({"a.txt": "new"}))
    assert sorted(p.name for p in (tmp_path / "epoch-000004").iterdir()) == ["a.txt"]
    assert (tmp_path / "epoch-000004" / "a.txt").read_text() == "new"


def test_a_failing_writer_leaves_no_trace(tmp_path: Path):
    store = CheckpointDir(tmp_path, keep_last=3)
    store.save(1, write_files({"a.txt": "1"}))

    def failing(directory: Path) -> None:
        (directory / "a.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store.save(2, failing)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-000001"]


def test_bad_arguments_name_the_field(tmp_path: Path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointDir(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="epoch"):
        CheckpointDir(tmp_path, keep_last=1).save(-1, write_files({}))


def test_sigkill_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path: Path):
    """A real SIGKILL while the second checkpoint is half-written: the first one stays complete and listed, the
    partial one is never listed, and the next writer cleans it up."""
    marker = tmp_path / "writing"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from lean_transformer.swarm.storage.checkpoint_dir import CheckpointDir

        store = CheckpointDir({str(tmp_path / "ckpt")!r}, keep_last=2)
        store.save(1, lambda d: (d / "model.bin").write_bytes(b"1" * 100_000))

        def slow(directory):
            (directory / "model.bin").write_bytes(b"2" * 50_000)
            Path({str(marker)!r}).touch()
            time.sleep(60)

        store.save(2, slow)
    """)
    writer = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parent.parent)
    try:
        wait_until(marker.exists, timeout=60, what="the writer to be half-way through the second checkpoint")
        writer.kill()
        assert writer.wait(10) == -9
    finally:
        if writer.poll() is None:
            writer.kill()

    root = tmp_path / "ckpt"
    assert [p.name for p in root.glob(".tmp-*")], "the half-written checkpoint is still on disk..."
    store = CheckpointDir(root, keep_last=2)  # ...until the next writer starts
    assert store.checkpoints() == [(1, root / "epoch-000001")]
    assert (root / "epoch-000001" / "model.bin").read_bytes() == b"1" * 100_000
    assert sorted(os.listdir(root)) == ["epoch-000001"]
