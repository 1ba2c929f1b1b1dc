"""Exit codes of every tracedeck command: the contract CI and cron read."""

EXIT_PASS = 0  # the verdict passes (or the only deviation is expected drift)
EXIT_FAIL = 1  # the engine ran and the verdict failed
EXIT_USAGE = 2  # a usage, preset or input error: nothing was judged
EXIT_INFRA = 3  # infrastructure: connection, host key, lock busy, engine that did not run
EXIT_INTERRUPT = 130  # interrupted or cancelled by the operator

# Verdict words a console records when its own following ended, not the run: the run may go on
# (attach follows it again; prune and status ask its hosts).
DISCONNECTED = "DISCONNECTED"  # the console gave up on the link
NOT_JUDGED = "NOT_JUDGED"  # tracedeck itself failed while following
NOT_RECORDED = "NOT_RECORDED"  # the record could not be written
NOT_ENDINGS = (DISCONNECTED, NOT_JUDGED, NOT_RECORDED)
