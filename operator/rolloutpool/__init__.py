"""RolloutPool: a Deployment of OpenAI-compatible servers and its Service.
:mod:`.plan` decides, :mod:`.builders` builds, :mod:`.reconciler` applies.
"""
