"""Exception types shared by the model loader (engine side) and the frontends (API servers), kept
free of torch so that importing them costs an API-server process nothing."""


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message names the file and the reason."""
