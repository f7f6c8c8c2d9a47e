"""The errors the job reports to its user in one line, and how a command ends on each.

Every error a user can cause or must act on (a bad config, a bad input, a path the job cannot reach, another job
holding the lock, an engine that cannot start, data that failed a check) is a `JobError`. Each module defines its
own subclass beside the code that raises it (`config.ConfigError`, `storage.StorageError`, `runs.RunError`, ...);
this module knows only the base, so it stands below all of them.

- The command line prints any JobError as one `error: ...` line and exits with its `exit_code` (2; 3 for a
  `Verdict`: the job ran and its data failed a check).
- `run_stage` records it in run.json as the stage's `failed` status (a verdict the stage recorded itself stays).
- Raised inside a Ray actor or task, Ray hands it back wrapped in its own traceback; `job_error_inside` recovers the
  original, so an actor's error reaches the user exactly as the driver's would.
"""

from __future__ import annotations

import re


class JobError(Exception):
    """An error the user reads in one line and can act on. Exit code 2."""
    exit_code = 2


class Verdict(JobError):
    """The job ran and the data failed one of its checks (the canary, the exactness self-check): exit code 3. The
    stage that raises it has recorded its own status."""
    exit_code = 3


def job_error_classes() -> list[type[JobError]]:
    """Every JobError subclass defined so far, most derived first (so a message names the most precise class)."""
    found, todo = [], [JobError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: -len(c.__mro__))


def job_error_inside(e: BaseException | None) -> JobError | None:
    """The JobError that a Ray task or actor failure wraps, if any: found among the exception's causes, or (an error
    raised while an actor starts reaches the driver only as the text of its traceback) recovered from its text as the
    same class with the same message."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        # Ray's RayTaskError(StorageError) is both: an instance of the error's class whose message is Ray's whole
        # traceback. Its `cause` is the error as it was raised.
        if isinstance(getattr(e, "cause", None), JobError):
            return e.cause
        if isinstance(e, JobError):
            return e
        text = str(e)
        for cls in job_error_classes():
            m = re.search(rf"{re.escape(cls.__module__)}\.{cls.__name__}: (.+)", text)
            if m:
                try:
                    return cls(m.group(1).strip())
                except TypeError:  # a subclass whose constructor takes more: its text as the base's
                    return JobError(m.group(1).strip())
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__
    return None


def one_line(e: BaseException, limit: int = 500) -> str:
    """The first line of an error's message, at most `limit` characters: what run.json records of a failure."""
    return (str(e).strip().splitlines() or [""])[0][:limit]
