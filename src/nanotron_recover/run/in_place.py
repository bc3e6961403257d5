"""What the launcher tells the ranks of a job about relaunching it in place (environment variables, set per launch).

The ranks decide a regrow from them (:mod:`nanotron_recover.recovery.regrow`): it needs a relaunch in place left,
and weighs what one costs.
"""

IN_PLACE_ENV = "NANOTRON_RECOVER_IN_PLACE_RESTARTS"  # relaunches in place the launcher has left after this job
RELAUNCH_S_ENV = "NANOTRON_RECOVER_RELAUNCH_S"  # what the launcher expects one to cost, in seconds
