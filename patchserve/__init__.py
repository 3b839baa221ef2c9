"""patchserve: serve and train BitFit bias patches on one frozen shared encoder.

Its packages: ``patchserve.patches`` (the patch format, registries, training contract), ``patchserve.server`` (HTTP
serving), ``patchserve.trainer`` (training). For Python users: ``from patchserve.client import Client, AsyncClient``.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
