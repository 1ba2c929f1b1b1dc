"""The generic kind: any command per cell, judged by exit codes only."""

from __future__ import annotations

from runners.kind import Judge, Kind


class CommandKind(Kind):
    name = "command"
    description = "any command per cell; the run passes when every cell exits 0"
    judge_class = Judge
    pass_word, fail_word = "PASS", "FAIL"
    pass_words = frozenset({"PASS"})
    smoke = ("hello_command", ())
    cell_exit_is_verdict = True


KIND = CommandKind()
