"""User-facing errors: one clear line saying what was wrong and what would be valid."""


class KvlabError(Exception):
    """An error caused by the user's input (file, flag, request), not by a bug.

    The CLI prints it as one line and exits with status 2; the server turns it
    into an OpenAI-style 4xx JSON error.
    """


class ModelLoadError(KvlabError):
    """The checkpoint is missing, truncated, corrupt or of an unsupported kind."""


class RequestError(KvlabError):
    """A request is invalid: bad sampling values, a prompt longer than the context, ..."""
