"""tools/gpu/step_loop_handlers.py: the per-call log summary on XLA's own log lines (the
command-buffer updates it times, the traced-command fallbacks it counts), and one short
run of the tool on this machine."""

from __future__ import annotations

from pathlib import Path

from scripts import load_script

T = load_script("tools/gpu/step_loop_handlers.py")

LOG = """\
I1205 01:55:10.793224    2244 custom_call_thunk.cc:675] FFI handler requested or required fallback to stream capture.
I1205 01:55:10.793224    2244 custom_call_thunk.cc:675] FFI handler requested or required fallback to stream capture.
I1205 01:55:10.793224    2244 command_buffer_thunk.cc:362] [0] Updated command buffer in 300 \u03bcs; num_commands=130
I1205 01:55:10.793228    2244 command_buffer_thunk.cc:371] [0] Execute command buffer; num_executions=1
I1205 01:55:10.793224    2244 custom_call_thunk.cc:675] FFI handler requested or required fallback to stream capture.
I1205 01:55:10.793224    2244 custom_call_thunk.cc:675] FFI handler requested or required fallback to stream capture.
I1205 01:55:10.793624    2244 command_buffer_thunk.cc:362] [0] Updated command buffer in 163 \u03bcs; num_commands=130
I1205 01:55:10.793627    2244 command_buffer_thunk.cc:371] [0] Execute command buffer; num_executions=1
I1205 01:55:10.793624    2244 command_buffer_thunk.cc:362] [0] Updated command buffer in 892 \u03bcs; num_commands=130
"""  # noqa: E501


def test_updates_and_fallbacks_per_call(tmp_path: Path) -> None:
    log = tmp_path / "arena.log"
    log.write_text(LOG, encoding="utf-8")
    assert T.command_buffer_updates(log) == (3, 300.0, 130)
    lines = {line: n for n, line in T.log_lines_per_call(log, calls=2)}
    fallback = (
        "custom_call_thunk.cc:N] FFI handler requested or required fallback to stream capture."
    )
    assert lines[fallback] == 2.0


def test_no_update_logged(tmp_path: Path) -> None:
    log = tmp_path / "prealloc.log"
    log.write_text("I1205 01:55:10.793228 2244 x.cc:1] something else\n", encoding="utf-8")
    assert T.command_buffer_updates(log) == (0, 0.0, 0)


def test_the_tool_runs(capsys) -> None:
    T.main(["--layers", "2", "--calls", "3", "--step", "views+write"])
    out = capsys.readouterr().out
    assert "arena:" in out and "prealloc:" in out
