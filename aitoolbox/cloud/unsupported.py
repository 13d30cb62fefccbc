"""The stand-ins of aitoolbox 1.x's cloud classes until cloud storage is supported: constructing one raises."""


class CloudNotSupported:
    """Raises :class:`NotImplementedError` when constructed, naming the service and the local alternative.

    Subclasses set ``service`` (e.g. ``'AWS S3'``) and ``local_alternative`` (what to use instead).
    """

    service = "cloud storage"
    local_alternative = "the local experiment folder"

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}: {self.service} is not supported yet. Use "
                                  f"{self.local_alternative} and copy the files with your own tools.")


def not_supported(name: str, service: str, local_alternative: str, module: str) -> type:
    """A :class:`CloudNotSupported` subclass called ``name``, defined in ``module``."""
    return type(name, (CloudNotSupported,), {
        "service": service, "local_alternative": local_alternative, "__module__": module,
        "__doc__": f"{service} is not supported yet: use {local_alternative}."})
