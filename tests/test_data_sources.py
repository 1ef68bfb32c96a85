"""Where fleet.data reads from: local files, globs, gzip (suffix or magic), fsspec URLs
(``memory://``, ``file://``), ``fs_name``, ``download_cmd`` and ``pipe_command`` (its failures
with their stderr), blocks and line numbers across block boundaries."""

from __future__ import annotations

import gzip
import uuid
from pathlib import Path

import fsspec
import pytest

from collective.errors import DatasetFormatError
from fleet.data import InMemoryDataset, QueueDataset, Slot
from fleet.data.errors import DataSourceError

SLOTS = [Slot("label", dense=True), Slot("ids")]


def line(i: int) -> str:
    return f"1 {i % 2} {i % 3} " + " ".join(str(i * 10 + k) for k in range(i % 3))


def write(path: Path, lines: range, gz: bool = False) -> Path:
    text = "".join(line(i) + "\n" for i in lines).encode()
    path.write_bytes(gzip.compress(text) if gz else text)
    return path


def labels_and_ids(ds) -> tuple[list[int], list[list[int]]]:
    labels, ids = [], []
    for b in ds:
        labels += b["label"].reshape(-1).tolist()
        v, o = b["ids"].values.tolist(), b["ids"].offsets.tolist()
        ids += [v[o[k] : o[k + 1]] for k in range(len(o) - 1)]
    return labels, ids


def want(lines: range) -> tuple[list[int], list[list[int]]]:
    return [i % 2 for i in lines], [[i * 10 + k for k in range(i % 3)] for i in lines]


def loaded(files: list[str], **init) -> InMemoryDataset:
    ds = InMemoryDataset()
    ds.init(**{"batch_size": 7, "thread_num": 2, "use_var": SLOTS, **init})
    ds.set_filelist(files)
    ds.load_into_memory()
    return ds


@pytest.mark.timeout(60)
def test_local_files_globs_and_gzip_by_suffix_or_magic(tmp_path: Path) -> None:
    write(tmp_path / "part-0", range(40))
    write(tmp_path / "part-1.gz", range(40, 90), gz=True)
    write(tmp_path / "part-2", range(90, 100), gz=True)  # gzip without the suffix
    ds = loaded([str(tmp_path / "part-*")])
    assert labels_and_ids(ds) == want(range(100))
    ds2 = loaded([str(tmp_path / "part-2"), str(tmp_path / "part-0")])  # list order kept
    assert labels_and_ids(ds2) == want([*range(90, 100), *range(40)])


@pytest.mark.timeout(60)
def test_fsspec_memory_and_file_urls_and_fs_name(tmp_path: Path) -> None:
    root = f"/fleet-data-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{root}/a.txt", "".join(line(i) + "\n" for i in range(30)).encode())
    fs.pipe(
        f"{root}/b.txt.gz", gzip.compress("".join(line(i) + "\n" for i in range(30, 45)).encode())
    )
    try:
        assert labels_and_ids(loaded([f"memory://{root}/*"])) == want(range(45))
        ds = loaded([f"{root}/b.txt.gz"], fs_name="memory://")  # Paddle's fs_name + a bare path
        assert labels_and_ids(ds) == want(range(30, 45))
        with pytest.raises(DataSourceError, match=r"file not found 'memory://.*/nope\.txt'"):
            loaded([f"memory://{root}/nope.txt"])
    finally:
        fs.rm(root, recursive=True)
    local = write(tmp_path / "c.txt", range(5))
    assert labels_and_ids(loaded([f"file://{local}"])) == want(range(5))


@pytest.mark.timeout(60)
def test_missing_files_empty_lists_and_globs_matching_nothing_are_named(tmp_path: Path) -> None:
    write(tmp_path / "ok", range(3))
    with pytest.raises(DataSourceError, match=r"file not found .*missing-7"):
        loaded([str(tmp_path / "ok"), str(tmp_path / "missing-7")])
    with pytest.raises(DataSourceError, match=r"no file matches the glob .*nomatch-\*"):
        loaded([str(tmp_path / "nomatch-*")])
    with pytest.raises(DataSourceError, match="the file list is empty"):
        loaded([])


@pytest.mark.timeout(60)
def test_pipe_command_and_download_cmd(tmp_path: Path) -> None:
    src = tmp_path / "raw.txt"
    src.write_text("".join(f"{i % 2},{i}\n" for i in range(50)))
    # a pipe turning CSV into MultiSlot text (sed through the shell, as Paddle runs it)
    ds = loaded([str(src)], pipe_command=r"sed -E 's/^([0-9]+),([0-9]+)$/1 \1 1 \2/'")
    labels, ids = labels_and_ids(ds)
    assert labels == [i % 2 for i in range(50)] and ids == [[i] for i in range(50)]
    write(tmp_path / "g.gz", range(20), gz=True)
    # gzip is undone before the pipe, as Paddle's reader does for .gz files
    assert labels_and_ids(loaded([str(tmp_path / "g.gz")], pipe_command="cat -")) == want(range(20))
    # download_cmd: the file's bytes are "<download_cmd> <path>"'s stdout
    write(tmp_path / "d.txt", range(10))
    assert labels_and_ids(loaded([str(tmp_path / "d.txt")], download_cmd="head -n 4")) == want(
        range(4)
    )


@pytest.mark.timeout(60)
def test_failing_pipe_command_names_the_command_the_file_and_its_stderr(tmp_path: Path) -> None:
    f = write(tmp_path / "x.txt", range(10))
    cmd = "cat >/dev/null; echo 'reader.py: KeyError: slot_9' >&2; exit 3"
    with pytest.raises(DataSourceError) as info:
        loaded([str(f)], pipe_command=cmd)
    msg = str(info.value)
    assert "pipe_command" in msg and "exited with code 3" in msg and str(f) in msg
    assert "KeyError: slot_9" in msg
    # lots of stderr does not block the command; the tail is quoted
    noisy = "head -c 300000 /dev/zero | tr '\\0' e >&2; cat"
    assert labels_and_ids(loaded([str(f)], pipe_command=noisy)) == want(range(10))
    with pytest.raises(DataSourceError, match="download_cmd .* exited with code"):
        loaded([str(f)], download_cmd="false")
    queue = QueueDataset()
    queue.init(batch_size=4, use_var=SLOTS, pipe_command="exit 5")
    queue.set_filelist([str(f)])
    with pytest.raises(DataSourceError, match="exited with code 5"):
        list(queue)


@pytest.mark.timeout(60)
def test_small_blocks_long_lines_and_line_numbers_across_blocks(tmp_path: Path) -> None:
    lines = [line(i) for i in range(300)]
    lines[5] = "1 1 40 " + " ".join(str(k) for k in range(40))  # longer than a block
    bad_at = 257
    text = "\n".join(lines[: bad_at - 1] + ["1 0 2 5 oops"] + lines[bad_at - 1 :]) + "\n"
    f = tmp_path / "blocks.txt"
    f.write_text(text)
    with pytest.raises(DatasetFormatError) as info:
        loaded([str(f)], block_bytes=64, thread_num=3)
    assert (info.value.line, info.value.slot, info.value.text) == (bad_at, "ids", "oops")
    ds = loaded([str(f)], block_bytes=64, thread_num=3, on_error="skip")
    assert len(ds) == 300 and ds.skipped_lines == 1
    labels, ids = labels_and_ids(ds)
    assert ids[5] == list(range(40)) and ids[7] == [70] and labels[:3] == [0, 1, 0]


@pytest.mark.timeout(60)
def test_truncated_or_corrupt_gzip_is_named(tmp_path: Path) -> None:
    data = gzip.compress("".join(line(i) + "\n" for i in range(200)).encode())
    (tmp_path / "trunc.gz").write_bytes(data[: len(data) // 2])
    (tmp_path / "bad.gz").write_bytes(data[:12] + b"\xff" * 16 + data[28:])
    for name in ("trunc.gz", "bad.gz"):
        for pipe in ("cat", "cat -"):  # read here, or fed to a pipe_command
            with pytest.raises(DataSourceError, match=f"cannot read '.*{name}'"):
                loaded([str(tmp_path / name)], pipe_command=pipe)
