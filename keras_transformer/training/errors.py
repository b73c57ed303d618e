"""The errors of a run's bad arguments, data or output paths: `UserInputError` and its three kinds.

Each kind is also a ValueError, FileNotFoundError or FileExistsError. Nothing
has been written when one is raised; the CLI prints its message as one line.
"""


class UserInputError(Exception):
    """Raised (as a ValueError or OSError subclass) for bad arguments, data or output paths.

    Nothing has been written when it is raised; the CLI prints its message
    as one line and exits with status 2.
    """


class BadArgumentError(UserInputError, ValueError):
    """An argument, a value in the data, or a difference from the interrupted run."""


class InputFileError(UserInputError, FileNotFoundError):
    """A data or preset file that does not exist."""


class OutputDirectoryError(UserInputError, FileExistsError):
    """An `output_dir` that must not be touched (not ours, finished, or unreadable state)."""


def _as_input_error(error):
    if isinstance(error, UserInputError):
        return error
    if isinstance(error, FileNotFoundError):
        return InputFileError(str(error))
    if isinstance(error, FileExistsError):
        return OutputDirectoryError(str(error))
    return BadArgumentError(str(error))
