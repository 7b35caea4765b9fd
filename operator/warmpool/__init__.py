"""SandboxWarmPool: idle sandbox pods a SandboxTask can claim.
:mod:`.plan` decides, :mod:`.builders` builds the idle pod and the claim patch,
:mod:`.reconciler` applies (and makes the claims), :mod:`.entrypoint` is the stdlib-only
program an idle pod runs until it is claimed.
"""
