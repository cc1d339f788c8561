"""Reliability, issue 44 item 4: output that can be forged. Every string from a file, a registry or a user is shown
escaped (control, format and bidi characters as visible escapes, never interpreted) and bounded; `--reason` that
could not be shown as typed is refused at the CLI edge; an identity name that is not an identity slug is refused at
enrolment (tests/test_data.py) and at verify-release (tests/release/test_system_release.py).

Pure tests of `pipeline.tables.shown` and the table printer, the CLI's refusals (before anything reads a registry),
and one real registry (the fast fake engine of tests/registry/test_registry.py on SQLite) holding what an older Kiln or
another client could have recorded."""

from __future__ import annotations

import shutil

import pytest

from pipeline import cli, registry, tables
from pipeline.cli.common import print_move
from pipeline.registry.aliases import AliasMove
from test_registry import FP32, REPO, make_engine, register, root  # noqa: F401  (root: a fixture)

ESC_CSI = "\x1b[2J\x1b[31mred"                                   # clear the screen, colour
OSC8 = "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\"   # a hyperlink whose text is not its target
C1 = "\x9b31m\x85next"                                          # C1 CSI, NEL
RTL = "invoice_\u202egnp.exe"                                  # reads as invoice_exe.png
FORGED = "ok\n| 2026-01-01 | production | promote | v1 | v9 | root | approved |"
HIDDEN = ("\x00", "\x07", "\x08", "\t", "\n", "\r", "\x1b", "\x7f", "\x85", "\x9b", "\u200b", "\u200e", "\u200f",
          "\u202a", "\u202e", "\u2028", "\u2029", "\u2066", "\u2069", "\ufeff", "\udc80")


def test_shown_escapes_every_control_format_and_bidi_character_and_bounds():
    for ch in HIDDEN:
        s = tables.shown(f"a{ch}b")
        assert s.isprintable() and s.startswith("a\\") and s.endswith("b") and len(s) > 3, (ch, s)
        s.encode("utf-8")                              # a lone surrogate would make print() raise
    assert tables.shown(ESC_CSI) == "\\x1b[2J\\x1b[31mred"
    assert tables.shown(OSC8) == "\\x1b]8;;https://evil.example/\\x1b\\click\\x1b]8;;\\x1b\\"
    assert tables.shown(C1) == "\\x9b31m\\x85next" and tables.shown(RTL) == "invoice_\\u202egnp.exe"
    assert tables.shown("\U000e0001") == "\\U000e0001"                     # a tag character (Cf)
    plain = "Zoë — café → ok | 東京 😀"                                   # printable text stays as it is
    assert tables.shown(plain) == plain
    long = tables.shown("x" * 10_000)
    assert len(long) == tables.MAX_SHOWN and long.endswith("…")
    cut = tables.shown("\x1b" * 100, 10)                                   # an escape is never cut in half
    assert cut == "\\x1b\\x1b…" and len(cut) <= 10
    assert tables.shown("abc", 3) == "abc" and tables.shown("abcd", 3) == "ab…"


def test_a_table_cell_is_one_escaped_bounded_line():
    out = tables.markdown(["actor", "reason"], [("\x1b[8mmallory", FORGED), ("bob", "y" * 10_000), ("carol", OSC8)])
    lines = out.splitlines()
    assert len(lines) == 2 + 3 and all(ln.isprintable() for ln in lines)
    assert "ok\\x0a\\| 2026-01-01" in lines[2] and "\\x1b[8mmallory" in lines[2]
    assert max(len(ln) for ln in lines) < tables.MAX_CELL + 50


@pytest.mark.parametrize("reason, needle", [
    (ESC_CSI, "--reason holds the control or format character \\x1b: \\x1b[2J\\x1b[31mred"),
    (OSC8, "--reason holds the control or format character \\x1b: \\x1b]8;;https://evil.example/"),
    (C1, "--reason holds the control or format character \\x9b: \\x9b31m\\x85next"),
    (RTL, "--reason holds the control or format character \\u202e: invoice_\\u202egnp.exe"),
    (FORGED, "--reason holds the control or format character \\x0a: ok\\x0a| 2026-01-01"),
    ("x" * 10_000, "--reason is 10000 characters; at most 500 are recorded"),
], ids=["esc", "osc8", "c1", "rtl", "newline", "10kB"])
@pytest.mark.parametrize("command", [["promote", "kiln-embedder-ort-cpu-fp32", "1"],
                                     ["rollback", "kiln-embedder-ort-cpu-fp32"],
                                     ["promote", "--system", "dlib-mtcnn", "1"]], ids=["promote", "rollback", "system"])
def test_a_reason_that_cannot_be_shown_as_typed_is_refused_at_the_edge(tmp_path, monkeypatch, capsys, command,
                                                                       reason, needle):
    """One `kiln: error:` line and a hint, exit 2, before a configuration or a registry is read (this folder has
    neither: nothing can have been recorded); the line itself shows the reason escaped and bounded."""
    monkeypatch.chdir(tmp_path)
    assert cli.main([*command, "--reason", reason]) == 2
    out, err = capsys.readouterr()
    first, hint, *rest = err.splitlines()
    assert out == "" and rest == [] and first.startswith(f"kiln: error: {needle}"), err
    assert hint.startswith("hint: ") and first.isprintable() and len(first) < 200
    assert list(tmp_path.iterdir()) == []


def test_history_and_moves_show_what_the_registry_holds_escaped(cfg, root, monkeypatch, capsys):  # noqa: F811
    """A reason and an actor recorded by another client (or an older Kiln) with an ESC sequence, an OSC 8 link, a
    right-to-left override and a newline forging a second table row: `kiln history` and promote's line show them
    escaped, on one bounded row each."""
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    monkeypatch.chdir(root)
    make_engine(root, cfg, FP32, b"one")
    name = register(cfg, FP32, root).name
    monkeypatch.setenv("KILN_ACTOR", "\x1b[8mmallory")
    hostile = f"{ESC_CSI} {OSC8} {RTL} {FORGED} " + "z" * 2000
    move = registry.promote(cfg, name, 1, root, reason=hostile)
    capsys.readouterr()
    print_move(move)
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and line.rstrip("\n").isprintable() and len(line) < 1000
    assert "by \\x1b[8mmallory at " in line and "(\\x1b[2J\\x1b[31mred \\x1b]8;;https://evil.example/" in line
    assert cli.main(["history", FP32]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert all(ln.isprintable() for ln in out.splitlines()), out
    assert len(rows) == 2 + 2                                  # header, rule, register, promote: no forged row
    assert "\\u202egnp.exe" in rows[-1] and "ok\\x0a\\| 2026-01-01" in rows[-1] and len(rows[-1]) < 1200
    print_move(AliasMove(name, "production", None, 1, "promote", "x", "t", "up\x1b[1A\x1b[2Kdone"))
    assert capsys.readouterr().out == f"promote: {name}@production none → v1 by x at t (up\\x1b[1A\\x1b[2Kdone)\n"
