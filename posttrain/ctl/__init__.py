"""The cluster half of the CLI: ``apply``, ``get``, ``describe``, ``watch``, ``logs``, ``report``.

Modules by role: :mod:`~posttrain.ctl.parsers` (argparse wiring, importing nothing heavy so
that ``--help`` is instant), :mod:`~posttrain.ctl.commands` (apply/get/describe),
:mod:`~posttrain.ctl.follow` (watch and logs), :mod:`~posttrain.ctl.report` (HTML/Markdown
reports), :mod:`~posttrain.ctl.render` (pure formatting), :mod:`~posttrain.ctl.kube`
(kubeconfig, kinds, API errors) and :mod:`~posttrain.ctl.common` (shared helpers).
``posttrain.cli`` imports this package only when one of its commands is chosen.
"""

from posttrain.ctl.parsers import register

__all__ = ["register"]
