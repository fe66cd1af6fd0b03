"""The errors a user can cause. The command line reports each as one line on stderr, never a traceback."""


class UserError(Exception):
    """Something the user can act on: the message says what is wrong and, where it can, what to do."""


class CheckpointError(UserError):
    """A checkpoint or export is missing, incomplete, corrupt, stale or of an unsupported kind."""


class PromptError(UserError, ValueError):
    """A prompt or a decoding option cannot be used (empty, unknown task, too long, k out of range)."""


class DataError(UserError):
    """Training data is missing (a Debian documentation package, the user's text) or unusable."""


class SiteError(UserError):
    """The site cannot be built or served (npm missing, web/ incomplete, port taken)."""


class BrowserError(UserError):
    """Headless Chromium cannot be started."""
