"""patchserve for Python users: ``from patchserve.client import Client, AsyncClient``."""

from patches import __version__

__all__ = ["__version__"]
