"""A damaged timeline directory stops the node with a clear error; never a fresh term 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from protocol.ids import TenantId, TimelineId
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn, segment_file_name
from protocol.safekeeper import TermSwitchEntry
from safekeeper.config import SafekeeperConfig
from safekeeper.control_file import CONTROL_FILE_NAME, ControlFileError, write_control_file
from safekeeper.node import SafekeeperNode
from safekeeper.testing import SafekeeperProcess, synthetic_wal
from safekeeper.timeline import Timeline
from safekeeper.wal_storage import WalStorageError

TENANT = TenantId(bytes(range(16)))
TIMELINE = TimelineId(bytes(range(16, 32)))


def node_for(data_dir: Path) -> SafekeeperNode:
    return SafekeeperNode(
        SafekeeperConfig(
            data_dir=str(data_dir), listen_pg="127.0.0.1:0", listen_http="127.0.0.1:0",
            no_sync=True,
        )
    )


def make_timeline(data_dir: Path, tenant: TenantId = TENANT, timeline: TimelineId = TIMELINE) -> Path:
    directory = data_dir / tenant.hex / timeline.hex
    Timeline.create(directory, 1, tenant, timeline, no_sync=True)
    (directory / (segment_file_name(1) + ".partial")).write_bytes(bytes(8192))
    return directory


def test_corrupt_control_file_refuses_to_start_naming_the_file(tmp_path: Path) -> None:
    sk = SafekeeperProcess(tmp_path / "w", no_sync=True)
    directory = make_timeline(sk.data_dir)
    control = directory / CONTROL_FILE_NAME
    data = bytearray(control.read_bytes())
    data[30] ^= 0x40
    control.write_bytes(bytes(data))
    proc = subprocess.run(
        [sys.executable, "-m", "control_plane.cli", "safekeeper", "-c", str(sk.config_path)],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, timeout=60,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert "cannot start" in err and str(control) in err and "CRC" in err
    assert "Traceback" not in err


def test_wal_without_a_control_file_is_refused_not_recreated(tmp_path: Path) -> None:
    directory = make_timeline(tmp_path / "sk")
    (directory / CONTROL_FILE_NAME).unlink()
    with pytest.raises(ControlFileError, match="WAL segments but no"):
        node_for(tmp_path / "sk").load_timelines()
    # And a proposer's first connection would not create term 0 over it either.
    with pytest.raises(ControlFileError, match="WAL segments but no control file"):
        Timeline.create(directory, 1, TENANT, TIMELINE, no_sync=True)
    assert not (directory / CONTROL_FILE_NAME).exists()


def test_an_empty_directory_without_a_control_file_is_skipped(tmp_path: Path) -> None:
    # A crash inside Timeline.create before the control file's rename: nothing was promised.
    (tmp_path / "sk" / TENANT.hex / TIMELINE.hex).mkdir(parents=True)
    node = node_for(tmp_path / "sk")
    node.load_timelines()
    assert node.timelines == {}


def test_a_timeline_directory_copied_under_another_id_is_refused(tmp_path: Path) -> None:
    directory = make_timeline(tmp_path / "sk")
    other = TimelineId(bytes(range(32, 48)))
    directory.rename(directory.with_name(other.hex))
    make_timeline(tmp_path / "sk")
    with pytest.raises(ControlFileError, match="its control file is for"):
        node_for(tmp_path / "sk").load_timelines()


def test_missing_segment_holding_commit_lsn_is_refused(tmp_path: Path) -> None:
    """Without the check the restart scan ends WAL at commit_lsn and reports it flushed."""
    directory = tmp_path / "tl"
    tl = Timeline.create(directory, 1, TENANT, TIMELINE, no_sync=True)
    start = Lsn(WAL_SEGMENT_SIZE + 0x28)
    wal = synthetic_wal(start, 3 * 8192)
    tl.storage.init_first_segment(start, 1)
    tl.storage.truncate(start)
    tl.storage.write(start, [wal])
    tl.storage.flush()
    end = tl.storage.flush_record_lsn
    assert end > start
    write_control_file(
        directory,
        attrs.evolve(
            tl.acceptor.state, term=1, term_history=(TermSwitchEntry(1, start),),
            timeline_start_lsn=start, commit_lsn=start,
        ),
        no_sync=True,
    )
    tl.storage.close()
    assert Timeline.load(directory, 1, no_sync=True).acceptor.flush_lsn == end
    (directory / (segment_file_name(1) + ".partial")).unlink()
    with pytest.raises(ControlFileError, match=r"holding commit_lsn .* is missing"):
        Timeline.load(directory, 1, no_sync=True)


def test_a_filesystem_without_direct_io_stops_the_node_with_the_reason(
    tmp_path: Path, refuse_direct_io: None
) -> None:
    """wal_direct_io (the default) on a filesystem that refuses O_DIRECT: a timeline is
    neither created (no control file claims it) nor loaded; nothing falls back to buffered
    writes behind the operator's back."""
    directory = make_timeline(tmp_path / "sk")
    assert SafekeeperConfig(data_dir="x").direct_io
    # no_sync makes nothing durable: its writes stay in the page cache either way.
    assert not SafekeeperConfig(data_dir="x", no_sync=True).direct_io
    node = SafekeeperNode(
        SafekeeperConfig(
            data_dir=str(tmp_path / "sk"), listen_pg="127.0.0.1:0", listen_http="127.0.0.1:0",
        )
    )
    with pytest.raises(WalStorageError, match=r"refuses O_DIRECT.*wal_direct_io"):
        node.load_timelines()
    fresh = tmp_path / "other" / TENANT.hex / TIMELINE.hex
    with pytest.raises(WalStorageError, match="refuses O_DIRECT"):
        Timeline.create(fresh, 1, TENANT, TIMELINE, no_sync=True, direct_io=True)
    assert not (fresh / CONTROL_FILE_NAME).exists()
    # With wal_direct_io off the same timeline loads.
    buffered = SafekeeperNode(
        SafekeeperConfig(
            data_dir=str(tmp_path / "sk"), listen_pg="127.0.0.1:0", listen_http="127.0.0.1:0",
            wal_direct_io=False,
        )
    )
    buffered.load_timelines()
    assert len(buffered.timelines) == 1 and directory.is_dir()
