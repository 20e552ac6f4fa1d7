"""Errors jaxspec raises for bad input. Every message names the file, line, field or key at fault."""


class JaxspecError(Exception):
    """Base class of jaxspec's user-facing errors."""


class ModelLoadError(JaxspecError):
    """A model file or directory is missing, corrupt, or of an unsupported kind."""


class InputError(JaxspecError):
    """A prompt, request or parameter is invalid."""


class TemplateError(JaxspecError):
    """A chat template failed to render or tried to escape the sandbox."""


class DatasetError(JaxspecError):
    """A distilled data set (manifest or shard) is corrupt, truncated or of another model."""
