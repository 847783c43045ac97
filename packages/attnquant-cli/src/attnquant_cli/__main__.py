"""``python -m attnquant_cli`` runs the ``attnquant`` command."""

from ._app import main

main()
