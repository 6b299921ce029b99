"""The error of prompt data a user must fix (a file, a row, a key); its message names the file and line."""


class PromptDataError(ValueError):
    """A prompt file or row the user must fix; the message names the file and line."""
