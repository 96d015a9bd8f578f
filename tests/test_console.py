"""The runner's console filter (align/core/console.py): progress events drive one bar and become periodic plain lines
in stage.log; carriage-return bar frames are reduced to their last frame; repeated lines are written once with a
count at the end."""

from __future__ import annotations

import io
import json

from align.core.console import PROGRESS, StageConsole


def _event(n: int, total: int, **metrics) -> bytes:
    return (PROGRESS + json.dumps({"n": n, "total": total, "metrics": metrics}) + "\n").encode()


def test_stage_output_is_split_between_bar_and_plain_log(capsys):
    log = io.BytesIO()
    console = StageConsole("sft", log, stream_all=False)
    warning = b"FutureWarning: something is deprecated\n"
    chunks = [b"Map:   0%|   | 0/10\rMap:  50%|#  | 5/10\rMap: 100%|##| 10/10\n", warning, warning,
              _event(0, 100)]
    chunks += [_event(n, 100, loss=1.0 / n) for n in range(1, 101)]
    chunks += [warning, b"[align] sft: completed train/loss=0.01"]  # last line without a newline
    blob = b"".join(chunks)
    for i in range(0, len(blob), 37):  # arbitrary chunk boundaries, as a pipe delivers them
        console.feed(blob[i:i + 37])
    console.close()
    text = log.getvalue().decode()
    lines = text.splitlines()
    assert "\r" not in text and "Map: 100%|##| 10/10" in lines and "Map:   0%" not in text
    assert lines.count("FutureWarning: something is deprecated") == 1
    assert "  x3: FutureWarning: something is deprecated" in lines
    progress = [line for line in lines if line.startswith("[align] progress ")]
    # 0%, each new 10% and the end (the 30 s clock never fires in this test): 11 lines, not 101
    assert progress[0] == "[align] progress 0/100" and progress[-1] == "[align] progress 100/100 (loss=0.01)"
    assert len(progress) == 11
    assert "[align] sft: completed train/loss=0.01" in lines
    err = capsys.readouterr().err
    assert "sft" in err and "100/100" in err and "align-progress" not in err  # the bar, not the events


def test_verbose_streams_everything_raw(capsysbinary):
    log = io.BytesIO()
    console = StageConsole("ppo", log, stream_all=True)
    console.feed(b"raw line\r\n" + _event(1, 2, kl=0.5))
    console.close()
    out = capsysbinary.readouterr().out
    assert b"raw line" in out and b"align-progress" in out


def test_a_log_that_cannot_be_written_is_named_with_its_free_space(tmp_path):
    """A write to an open file that fails (the disk filled under the stage's log) raises an OSError with no file
    name: the runner's one line then read "No space left on device" alone. It names the log, its filesystem's free
    space and what to do; an error that already names its file, or is not an OSError, passes unchanged."""
    import errno

    from align.core.console import _log_failure
    from align.core.errors import describe

    log = tmp_path / "sft" / "stage.log"
    log.parent.mkdir()
    named = _log_failure(OSError(errno.ENOSPC, "No space left on device"), log)
    line = describe(named)
    assert line.startswith(f"{log}: No space left on device while writing the stage's log (") and "GiB free there" \
        in line and line.endswith("(ENOSPC)"), line
    assert "rerun the same command" in line
    other = OSError(errno.EACCES, "Permission denied", "/x/y")
    assert _log_failure(other, log) is other
    bug = ValueError("x")
    assert _log_failure(bug, log) is bug


def test_a_stage_log_on_a_full_disk_is_one_line_naming_it():
    """End to end through stream_stage with /dev/full as the log (every write fails with ENOSPC, as on a full
    disk): the error names the log and what to do (before, the runner's one line read 'No space left on device
    (ENOSPC)' alone)."""
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    from align.core.console import stream_stage
    from align.core.errors import describe

    def start():
        return subprocess.Popen([sys.executable, "-c", "print('step 1'); print('done')"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)

    with pytest.raises(OSError) as err:
        stream_stage(start, Path("/dev/full"), "sft")
    line = describe(err.value)
    assert line.startswith("/dev/full: No space left on device while writing the stage's log") and "(ENOSPC)" in line


def test_stage_log_holds_each_line_while_the_stage_still_runs(tmp_path):
    """stage.log is written line by line, not in 8 KiB blocks: `tail -f stage.log` follows a running stage (on a
    real full disk the log used to stay empty, its buffer never flushed)."""
    import subprocess
    import sys
    import threading
    import time

    from align.core.console import stream_stage

    log = tmp_path / "stage.log"
    gate = tmp_path / "gate"
    seen: list[str] = []

    def start():
        code = ("import os, time; print('step 1', flush=True)\n"
                f"while not os.path.exists({str(gate)!r}): time.sleep(0.02)\nprint('done')")
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def watch():  # while the stage waits on the gate, its first line must already be in the log
        deadline = time.time() + 30
        while time.time() < deadline and "step 1" not in (log.read_text() if log.exists() else ""):
            time.sleep(0.02)
        seen.append(log.read_text() if log.exists() else "")
        gate.touch()

    t = threading.Thread(target=watch)
    t.start()
    assert stream_stage(start, log, "sft") == 0
    t.join()
    assert seen and "step 1" in seen[0] and "done" not in seen[0], seen
    assert "done" in log.read_text()


def test_a_resumed_stages_bar_starts_at_its_checkpoint():
    """A stage resumed at step 51 of 100 drew its bar from 0, so its rate counted 50 steps it never took this time
    and its time left was wrong: the bar starts where the first event is."""
    console = StageConsole("ppo", io.BytesIO(), stream_all=False)
    console.feed(_event(51, 100) + _event(52, 100))
    assert console.bar.n == 52 and console.bar.format_dict["initial"] == 50
    console.close()


def test_a_failed_stages_tail_is_its_last_lines_not_the_summary_of_repeated_ones(tmp_path):
    """The console shows a failed stage's last 15 log lines; the log closes with a summary of repeated lines, which
    could fill all 15 and leave out the traceback."""
    from align.core.console import REPEATED, tail

    log = tmp_path / "stage.log"
    log.write_text("\n".join(["notice"] + [f"line {i}" for i in range(20)] + ["Traceback: boom", REPEATED]
                             + [f"  x3: notice {i}" for i in range(15)]) + "\n")
    shown = tail(log).splitlines()
    assert shown[-1].strip() == "Traceback: boom" and len(shown) == 15 and "x3" not in "".join(shown)
    log.write_text("a\nb\n")
    assert tail(log) == "    a\n    b"
