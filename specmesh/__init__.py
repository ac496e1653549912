"""specmesh: speculative decoding with drafters and verifiers as separate, independently scaled services."""


def package_version() -> str | None:
    """The installed specmesh distribution's version; None when run from a source tree never installed."""
    import importlib.metadata

    try:
        return importlib.metadata.version("specmesh")
    except importlib.metadata.PackageNotFoundError:
        return None
