"""The exit contract of ``train.py`` and ``python -m outlier_titan.launch`` (docs/launching.md).

Batch scripts (``scripts/multinode.slurm``) and the sweep engine read these codes, together with the run's own
state (steps done vs total), to decide between "done", "requeue / resume" and "failed".
"""

FINISHED = 0  # every step of training.steps is done (or the run was already complete)
FAILURE = 1  # not the user's fault and not resumable as such: a peer died, a save failed, a crash, a timeout
USER_ERROR = 2  # bad input (config, data, checkpoint); one ``error:`` line says what to change
DIVERGED = 3  # too many consecutive non-finite steps; the message names the checkpoint to resume from
STOPPED = 75  # stopped on request (SIGTERM/SIGUSR1/Ctrl-C) after saving the step reached: resumable (EX_TEMPFAIL)
INTERRUPTED = 130  # aborted by a second Ctrl-C: nothing more saved (128 + SIGINT, as a shell reports it)

NAMES = {FINISHED: "finished", FAILURE: "failure", USER_ERROR: "user error", DIVERGED: "diverged",
         STOPPED: "stopped, resumable", INTERRUPTED: "aborted by a second Ctrl-C"}
