"""MAX custom-architecture module of attnquant: pass this folder to MAX.

``max serve --custom-architectures <this folder>``; MAX puts the parent on ``sys.path`` and
imports this module by its folder name. This is the ``max serve`` child's process boundary: the
architectures are bound here, once, to the serving options its ``ATTNQUANT_*`` variables hold
(what ``attnquant serve`` wrote with :meth:`ServingOptions.to_env`).
:func:`attnquant_max.architectures_path` returns the folder.
"""

from attnquant_core.serving import ServingOptions
from attnquant_max.architectures import build_architectures

ARCHITECTURES = build_architectures(ServingOptions.from_env())

__all__ = ["ARCHITECTURES"]
