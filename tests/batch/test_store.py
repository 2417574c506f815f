"""The on-disk store: what a restarted server finds (files kept, half-written ones dropped, a batch
that was running failed), and ids that cannot name a path outside it."""

from __future__ import annotations

import json

import pytest

from kvtide.batch.store import BatchStore, FileStore, StoreError

# One worker runs this folder: its conftest starts the batch server once, at the folder's first test.
pytestmark = pytest.mark.xdist_group("batch")

LINE = b'{"custom_id": "a"}\n'


def test_a_restart_keeps_files_and_fails_running_batches(tmp_path):
    files = FileStore(str(tmp_path), max_bytes=1024, max_lines=10)
    kept = files.create(LINE * 3, "in.jsonl", "batch")
    half_written = files.new_path()
    batches = BatchStore(str(tmp_path))
    running = {"id": batches.new_id(), "status": "in_progress", "created_at": 1, "failed_at": None, "errors": None}
    stopping = {"id": batches.new_id(), "status": "cancelling", "created_at": 2, "cancelled_at": None}
    done = {"id": batches.new_id(), "status": "completed", "created_at": 3}
    for batch in (running, stopping, done):
        batches.save(batch)

    files, batches = FileStore(str(tmp_path), 1024, 10), BatchStore(str(tmp_path))
    assert files.get(kept.id) == kept and open(files.content_path(kept.id), "rb").read() == LINE * 3
    assert not (tmp_path / "files" / half_written.rsplit("/", 1)[-1]).exists()
    assert batches.get(running["id"])["status"] == "failed"
    assert batches.get(running["id"])["errors"]["data"][0]["code"] == "server_stopped"
    assert batches.get(stopping["id"])["status"] == "cancelled"
    assert batches.get(done["id"])["status"] == "completed"
    assert [b["id"] for b in batches.list()] == [done["id"], stopping["id"], running["id"]]
    on_disk = json.loads((tmp_path / "batches" / f"{running['id']}.json").read_text())
    assert on_disk["status"] == "failed" and on_disk["failed_at"] is not None


def test_ids_and_limits(tmp_path):
    files = FileStore(str(tmp_path), max_bytes=64, max_lines=2)
    for bad_id in ("../../etc/passwd", "file-../x", "file-" + "0" * 24, ""):
        with pytest.raises(StoreError) as e:
            files.get(bad_id)
        assert e.value.status == 404
    with pytest.raises(StoreError) as e:
        BatchStore(str(tmp_path)).get("batch_../../x")
    assert e.value.status == 404
    for data, purpose, param in ((LINE * 4, "batch", "file"), (LINE * 3, "batch", "file"), (LINE, "fine-tune", "purpose"),
                                 (b"\n\n", "batch", "file"), (b"\xff\xfe\n", "batch", "file")):
        with pytest.raises(StoreError) as e:
            files.create(data, "x.jsonl", purpose)
        assert (e.value.status, e.value.param) == (400, param), data
    record = files.create(LINE * 2, "../../name.jsonl", "batch")
    assert record.filename == "name.jsonl"
    assert files.delete(record.id).id == record.id and files.list() == []
