"""The ``attnquant`` commands, one module each; ``attnquant_cli._app`` registers them.

``decompose``, ``export``, ``analyze``, ``serve``, ``generate``, ``verify`` and ``bench`` live
here; ``check``, ``calibrate`` and ``eval`` in ``attnquant_cli._check``, ``_calibrate`` and
``_eval``. What they share (consoles, progress bars, JSON output, the demo model and the
serving options) is in :mod:`attnquant_cli.commands._shared`. MAX is imported inside the
commands that need it, so importing these modules stays cheap.
"""
